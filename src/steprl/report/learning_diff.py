"""The learning diff: one held-out task at the first and at the last evaluation, side by side,
turn by turn, with the first turn where the policy acted differently marked.

Every evaluation runs the same held-out tasks with the same per-task seeds, so a task's two
episodes differ only by the policy. But one episode is one sample: a task failed at the first
evaluation and solved once at the last may be a lucky guess, above all on a run whose held-out
success fell. So each task comes with its evidence: its successes at every evaluation, and the
one-sided p-value of Fisher's exact test for a change as large as the one from the first to
the last (how often chance alone gives it, were the task's success rate unchanged). A change
with p <= `SIGNIFICANT` is "learned" or "forgot"; a smaller one is a "weak gain" or "weak loss".
Tasks are offered by evidence: learned and forgot first, then the weak changes (the direction
the run's held-out success moved first), then tasks whose behaviour changed, then unchanged
ones, each by p; up to `Caps.diff_pairs` of them. The page also says how the held-out success
of these tasks moved in all, and warns when it fell.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from steprl.report.budget import thin
from steprl.report.embed import encode_all
from steprl.report.episodes import rows_of
from steprl.report.run_data import RunData, is_success

SIGNIFICANT = 0.05
HISTORY = 20  # evaluations listed per task (spread over the run)
_SLACK = 60_000  # of the section's share, for the evidence and the notes around the episodes
_TIER = {"learned": 0, "forgot": 0, "weak_gain": 1, "weak_loss": 1, "changed": 2, "same": 3}


def fisher_one_sided(first: tuple[int, int], last: tuple[int, int]) -> float:
    """P(a change at least as large, in the same direction) when `first` = (successes, episodes)
    and `last` come from one success rate: Fisher's exact test on the 2x2 table, one-sided
    (the hypergeometric tail of the last evaluation's successes). 1.0 when the rates are equal."""
    (s1, n1), (s2, n2) = first, last
    if n1 == 0 or n2 == 0 or s1 * n2 == s2 * n1:
        return 1.0
    total, solved = n1 + n2, s1 + s2
    lo, hi = max(0, solved - n1), min(solved, n2)
    tail = range(s2, hi + 1) if s2 * n1 > s1 * n2 else range(lo, s2 + 1)
    p = sum(math.comb(n2, k) * math.comb(n1, solved - k) for k in tail) / math.comb(total, solved)
    return round(min(1.0, p), 4)


def first_difference(first: Sequence[Sequence[int]], last: Sequence[Sequence[int]]) -> int | None:
    """The index of the first turn whose action tokens differ (one episode having a turn the
    other has not counts), or None when the two acted identically."""
    for k in range(max(len(first), len(last))):
        if k >= len(first) or k >= len(last) or list(first[k]) != list(last[k]):
            return k
    return None


def _turns(actions: pa.ChunkedArray, row: int) -> tuple[np.ndarray, np.ndarray]:
    """(turn offsets, all ids) of a row's actions, without converting them to Python."""
    cell = actions[row]
    if not cell.is_valid or len(cell.values) == 0:
        return np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64)
    turns = cell.values
    offsets = np.asarray(turns.offsets.to_numpy(zero_copy_only=False), dtype=np.int64)
    ids = np.asarray(turns.flatten().fill_null(-1).to_numpy(zero_copy_only=False), dtype=np.int64)
    return offsets - offsets[0], ids


def first_difference_at(actions: pa.ChunkedArray, a: int, b: int) -> int | None:
    """`first_difference` of rows `a` and `b` of an `action_ids` column, in numpy (an episode of
    10,000 turns compares in a millisecond)."""
    (oa, va), (ob, vb) = _turns(actions, a), _turns(actions, b)
    la, lb = np.diff(oa), np.diff(ob)
    n = min(len(la), len(lb))
    unequal = np.flatnonzero(la[:n] != lb[:n])
    k = int(unequal[0]) if len(unequal) else n  # turns before k have equal lengths
    end = int(oa[k])
    differ = np.flatnonzero(va[:end] != vb[:end])
    if len(differ):
        return int(np.searchsorted(oa, differ[0], side="right") - 1)
    return k if k < max(len(la), len(lb)) else None


def _verdict(first: tuple[int, int], last: tuple[int, int], p: float, differ: bool) -> str:
    up = last[0] * first[1] > first[0] * last[1]
    down = last[0] * first[1] < first[0] * last[1]
    if up or down:
        strong = p <= SIGNIFICANT
        return ("learned" if strong else "weak_gain") if up else ("forgot" if strong else "weak_loss")
    return "changed" if differ else "same"


def build(run: RunData) -> dict[str, Any]:
    table = run.evals
    steps = sorted({int(s) for s in table.column("step").to_pylist()}) if table.num_rows else []
    if len(steps) < 2:
        why = f"needs two evaluations with saved held-out episodes; this run has {len(steps)}"
        return {"pairs": [], "empty": why}
    first_step, last_step = steps[0], steps[-1]
    # each task's episodes per evaluation, in order: the k-th at one pairs with the k-th at another
    rows: dict[tuple[str, int], list[int]] = {}
    for i, (s, task) in enumerate(
        zip(table.column("step").to_pylist(), table.column("task_id").to_pylist(), strict=True)
    ):
        rows.setdefault((str(task), int(s)), []).append(i)
    light = table.select(["outcome_reward", "info_json"])
    success = [is_success(r) for r in rows_of(light, range(table.num_rows))]

    def tally(task: str, step: int) -> tuple[int, int]:
        mine = rows.get((task, step), [])
        return sum(success[i] for i in mine), len(mine)

    tasks = sorted({t for (t, s) in rows if s == first_step} & {t for (t, s) in rows if s == last_step})
    totals = [sum(tally(t, s)[j] for t in tasks) for s in (first_step, last_step) for j in (0, 1)]
    pooled = ((totals[0], totals[1]), (totals[2], totals[3]))
    pooled_p = fisher_one_sided(*pooled)
    fell = pooled[1][0] * pooled[0][1] < pooled[0][0] * pooled[1][1]
    actions = table.column("action_ids")
    candidates = []
    for task in tasks:
        first, last = tally(task, first_step), tally(task, last_step)
        firsts, lasts = rows[(task, first_step)], rows[(task, last_step)]
        pairs = list(zip(firsts, lasts, strict=False))
        turns = [first_difference_at(actions, a, b) for a, b in pairs]
        p = fisher_one_sided(first, last)
        verdict = _verdict(first, last, p, any(t is not None for t in turns))
        gain = verdict in ("learned", "weak_gain")
        # the pair that shows the verdict: one that flipped its way, else one that acted apart
        flipped = [k for k, (a, b) in enumerate(pairs) if success[a] != success[b] and success[b] == gain]
        acted = [k for k, t in enumerate(turns) if t is not None]
        k = (flipped or acted or [0])[0]
        against = _TIER[verdict] < 2 and gain == fell  # a change the run as a whole did not make
        history = [[s, *tally(task, s)] for s in thin([s for s in steps if (task, s) in rows], HISTORY)]
        evidence = {"first": list(first), "last": list(last), "p": p, "history": history}
        candidates.append(((_TIER[verdict], p, against, task), task, verdict, pairs[k], turns[k], evidence))
    candidates.sort(key=lambda c: c[0])
    picked = candidates[: run.caps.diff_pairs]
    wanted = [row for c in picked for row in c[3]]
    budget = run.caps.diff_bytes - _SLACK
    encoded = encode_all(table, wanted, "eval", run.tokens, budget, run.caps, run.path)
    by_row = {row: e for row, e in zip(wanted, encoded, strict=True) if e is not None}
    out = [
        {
            "task": task,
            "verdict": verdict,
            "evidence": evidence,
            "first_diff_turn": turn,
            "first": by_row.get(a),
            "last": by_row.get(b),
        }
        for _, task, verdict, (a, b), turn, evidence in picked
        if a in by_row and b in by_row
    ]
    counts = {v: sum(c[2] == v for c in candidates) for v in _TIER}
    warn = ""
    if fell and pooled_p <= SIGNIFICANT:
        warn = (
            f"Held-out success on these tasks fell from {pooled[0][0]}/{pooled[0][1]} to "
            f"{pooled[1][0]}/{pooled[1][1]} (p = {pooled_p}): a task that flipped to solved is likely luck"
        )
    return {
        "first_step": first_step,
        "last_step": last_step,
        "pairs": out,
        "tally": counts,
        "success": {"first": list(pooled[0]), "last": list(pooled[1]), "p": pooled_p},
        "warn": warn,
        "empty": "" if out else "no held-out pair fits the page",
    }
