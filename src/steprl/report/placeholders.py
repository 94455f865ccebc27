"""Slots that later features fill: alarms and interventions, curriculum stages, per-env weights.

Until a feature records them, each section shows "none recorded". A feature replaces its slot's
entry in `SECTIONS` (registry.py) with its own function, returning the same shape: {"columns":
[...], "rows": [[...], ...], "empty": "" or why there is nothing}, which the generic "table"
renderer draws (or a renderer of its own, given as the spec's script).
"""

from __future__ import annotations

from typing import Any

from steprl.report.run_data import RunData

NONE_RECORDED = "none recorded"


def nothing_yet(run: RunData) -> dict[str, Any]:
    """An empty table: the run recorded nothing for this slot."""
    del run  # a slot's feature reads the run; the placeholder has nothing to read
    return {"columns": [], "rows": [], "empty": NONE_RECORDED}
