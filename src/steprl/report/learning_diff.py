"""The learning diff: one held-out task at the first and at the last evaluation, side by side,
turn by turn, with the first turn where the policy acted differently marked.

Every evaluation runs the same held-out tasks with the same per-task seeds, so a task's two
episodes differ only by the policy. Tasks are offered failed-then-solved first (what training
taught), then solved-then-failed (what it broke), then the rest whose behaviour changed, then
unchanged ones; up to `Caps.diff_pairs` of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from steprl.report.episodes import rows_of
from steprl.report.run_data import RunData, encode_episode, is_success

_ORDER = {"learned": 0, "forgot": 1, "changed": 2, "same": 3}


def first_difference(first: Sequence[Sequence[int]], last: Sequence[Sequence[int]]) -> int | None:
    """The index of the first turn whose action tokens differ (one episode having a turn the
    other has not counts), or None when the two acted identically."""
    for k in range(max(len(first), len(last))):
        if k >= len(first) or k >= len(last) or list(first[k]) != list(last[k]):
            return k
    return None


def _verdict(a: bool, b: bool, differ: bool) -> str:
    if a != b:
        return "learned" if b else "forgot"
    return "changed" if differ else "same"


def build(run: RunData) -> dict[str, Any]:
    table = run.evals
    steps = sorted({int(s) for s in table.column("step").to_pylist()}) if table.num_rows else []
    if len(steps) < 2:
        why = f"needs two evaluations with saved held-out episodes; this run has {len(steps)}"
        return {"pairs": [], "empty": why}
    first_step, last_step = steps[0], steps[-1]
    # the k-th episode of a task at one evaluation pairs with its k-th at the other
    index: dict[tuple[int, str, int], int] = {}
    count: dict[tuple[int, str], int] = {}
    columns = zip(table.column("step").to_pylist(), table.column("task_id").to_pylist(), strict=True)
    for i, (s, task) in enumerate(columns):
        if int(s) in (first_step, last_step):
            k = count.get((int(s), task), 0)
            count[(int(s), task)] = k + 1
            index[(int(s), task, k)] = i
    keys = [(task, k) for (s, task, k) in index if s == first_step and (last_step, task, k) in index]
    actions = table.column("action_ids").to_pylist()
    successes = {i: is_success(r) for i, r in _light_rows(table, index.values())}
    candidates = []
    for task, k in keys:
        a, b = index[(first_step, task, k)], index[(last_step, task, k)]
        turn = first_difference(actions[a] or [], actions[b] or [])
        verdict = _verdict(successes[a], successes[b], turn is not None)
        candidates.append((_ORDER[verdict], task, k, a, b, turn, verdict))
    candidates.sort(key=lambda c: c[:3])
    picked = candidates[: run.caps.diff_pairs]
    wanted = [i for c in picked for i in c[3:5]]
    rows = dict(zip(wanted, rows_of(table, wanted), strict=True))
    pairs = [
        {
            "task": task,
            "verdict": verdict,
            "first_diff_turn": turn,
            "first": encode_episode(rows[a], "eval", run.tokens),
            "last": encode_episode(rows[b], "eval", run.tokens),
        }
        for _, task, _, a, b, turn, verdict in picked
    ]
    tally = {v: sum(c[6] == v for c in candidates) for v in _ORDER}
    return {"first_step": first_step, "last_step": last_step, "pairs": pairs, "tally": tally, "empty": ""}


def _light_rows(table: Any, indices: Any) -> list[tuple[int, dict[str, Any]]]:
    """(index, {outcome_reward, info_json}) for success, without converting the token columns."""
    idx = sorted(set(indices))
    light = table.select(["outcome_reward", "info_json"])
    return list(zip(idx, rows_of(light, idx), strict=True))
