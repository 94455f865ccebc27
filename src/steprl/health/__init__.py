"""Training health: signals over the recent steps' metrics (`signals.py`), the RAGEN-2
mutual-information probe's math (`mutual_info.py`), actions a rule can take (`actions.py`) and
the rules that ship on (`rules.py`). Pure: the trainer's controller (`training/controllers/
health.py`) keeps the state and `training/loop/health_run.py` carries the actions out."""
