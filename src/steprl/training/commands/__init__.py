"""The CLI's commands other than `train`: `steprl eval` (`evaluate_cli.py`), `check-template`
(`template_cli.py`), `serve-policy` (`serve_policy.py`), a step-reward kind's check
(`step_reward_check.py`)."""
