"""The learner and what it computes with: the `Learner` protocol (`learner_protocol.py`, the only
way the run reaches the policy, its reference, value head and optimizer) and its in-process
implementation (`learner.py`); collation, chunked log-probs and prefix-tree packing
(`batching.py`, `packing.py`, `tree_forward.py`); the non-finite guard (`guards.py`); critics
(`critic.py`); LoRA (`lora.py`); model checkpoints on disk (`checkpoint.py`); the ring of recent
learner snapshots a health rollback restores (`health_snapshots.py`)."""
