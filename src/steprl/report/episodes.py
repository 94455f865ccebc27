"""The trajectory browser's data: the saved train and held-out episodes, capped (`Caps`) so that a
long run's page stays small, with a line saying how many of each are shown.

Train episodes: per step, whole groups (`Caps.train_groups_per_step`), groups whose rewards
differ first (only they carry a non-zero GRPO advantage, the colouring worth looking at).
Held-out episodes: up to `Caps.eval_per_evaluation` per evaluation, in order. At most
`Caps.episodes` in all (half for each kind, what one leaves to the other), from steps spread
over the run; each cut to its share of `Caps.episode_bytes` (`embed.encode_all`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pyarrow as pa

from steprl.report.budget import thin
from steprl.report.embed import encode_all
from steprl.report.run_data import RunData

_SLACK = 20_000  # of the section's share, for what it says around the episodes


def train_rows(table: pa.Table, groups_per_step: int) -> list[int]:
    """Row indices of the train episodes a page shows: per step, `groups_per_step` whole groups."""
    if table.num_rows == 0:
        return []
    steps = table.column("step").to_pylist()
    groups = table.column("group_id").to_pylist()
    rewards = table.column("outcome_reward").to_pylist()
    by_step: dict[int, dict[str, list[int]]] = {}
    for i, (s, g) in enumerate(zip(steps, groups, strict=True)):
        by_step.setdefault(int(s), {}).setdefault(str(g), []).append(i)
    picked: list[int] = []
    for s in sorted(by_step):
        members = list(by_step[s].values())
        # stable: groups with differing rewards first, then in the order they were logged
        members.sort(key=lambda rows: len({rewards[i] for i in rows}) <= 1)
        for rows in members[:groups_per_step]:
            picked.extend(rows)
    return sorted(picked)


def eval_rows(table: pa.Table, per_evaluation: int) -> list[int]:
    """Row indices of the held-out episodes a page shows: the first `per_evaluation` of each."""
    if table.num_rows == 0:
        return []
    seen: dict[int, int] = {}
    picked = []
    for i, s in enumerate(table.column("step").to_pylist()):
        seen[int(s)] = seen.get(int(s), 0) + 1
        if seen[int(s)] <= per_evaluation:
            picked.append(i)
    return picked


def rows_of(table: pa.Table, indices: Iterable[int]) -> list[dict[str, Any]]:
    """The rows at `indices` as dicts; only those are converted to Python (the slow part)."""
    indices = list(indices)
    if not indices:
        return []
    return table.take(pa.array(indices, type=pa.int64())).to_pylist()


def spread(table: pa.Table, rows: list[int], limit: int) -> list[int]:
    """At most `limit` of `rows`, whole steps of them, the steps spread over the run (its first
    and last among them)."""
    if len(rows) <= limit:
        return rows
    steps = table.column("step").to_pylist()
    by_step: dict[int, list[int]] = {}
    for i in rows:
        by_step.setdefault(int(steps[i]), []).append(i)
    order = sorted(by_step)
    per_step = max(1, max(len(v) for v in by_step.values()))
    chosen = thin(order, max(1, limit // per_step))
    return sorted(i for s in chosen for i in by_step[s])[:limit]


def build(run: RunData) -> dict[str, Any]:
    caps = run.caps
    train = train_rows(run.train, caps.train_groups_per_step)
    evals = eval_rows(run.evals, caps.eval_per_evaluation)
    train_kept = spread(run.train, train, max(caps.episodes // 2, caps.episodes - len(evals)))
    evals_kept = spread(run.evals, evals, caps.episodes - len(train_kept))
    # the budget by share of the rows: a page of mostly train episodes spends mostly on them
    budget = caps.episode_bytes - _SLACK
    share = budget * len(train_kept) // max(1, len(train_kept) + len(evals_kept))
    trains = [e for e in encode_all(run.train, train_kept, "train", run.tokens, share, caps, run.path) if e]
    left = budget - share
    held_out = [e for e in encode_all(run.evals, evals_kept, "eval", run.tokens, left, caps, run.path) if e]
    episodes = trains + held_out
    shown = (
        f"{len(trains)} of {run.train.num_rows} train episodes "
        f"(up to {caps.train_groups_per_step} whole groups per step); "
        f"{len(held_out)} of {run.evals.num_rows} held-out episodes "
        f"(up to {caps.eval_per_evaluation} per evaluation)"
    )
    if len(train_kept) < len(train) or len(evals_kept) < len(evals):
        shown += f"; at most {caps.episodes} in all, from steps spread over the run"
    if any("show" in e for e in episodes):
        shown += "; long episodes are cut (each cut says how long the whole is, and how to print it)"
    return {
        "episodes": episodes,
        "shown": shown,
        "token_note": run.tokens.note,
        "empty": "" if episodes else "no episodes recorded",
    }
