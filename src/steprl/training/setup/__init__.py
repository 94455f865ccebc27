"""Building a run before its first step: `build.py` (`build(cfg)` -> `Parts`), the envs and
prompt format (`env_setup.py`), the engine and context rule (`rollout_parts.py`), the policy and
its warm start (`policy.py`, `sft.py`, `pretrained_sft.py`, `warm_start_check.py`)."""
