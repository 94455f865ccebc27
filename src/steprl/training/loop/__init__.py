"""The RL loop: `trainer.py` (reads top to bottom), the step's batch (`step_batch.py`,
`saved_advantages.py`, `cross_policy.py`), rollouts in flight (`pipeline.py`, `producers.py`),
the levers the controllers return (`levers.py`, `health_run.py`, `mi_probe.py`), evaluations
(`evaluate.py`, `held_out.py`), outputs and checkpoints (`run_sinks.py`, `resume.py`,
`run_lock.py`), signals (`stop_signal.py`)."""
