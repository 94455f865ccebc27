"""The trajectory browser's data: the saved train and held-out episodes, capped (`Caps`) so that a
long run's page stays small, with a line saying how many of each are shown.

Train episodes: per step, whole groups (`Caps.train_groups_per_step`), groups whose rewards
differ first (only they carry a non-zero GRPO advantage, the colouring worth looking at).
Held-out episodes: up to `Caps.eval_per_evaluation` per evaluation, in order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pyarrow as pa

from steprl.report.run_data import RunData, encode_episode


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


def build(run: RunData) -> dict[str, Any]:
    train = train_rows(run.train, run.caps.train_groups_per_step)
    evals = eval_rows(run.evals, run.caps.eval_per_evaluation)
    episodes = [encode_episode(r, "train", run.tokens) for r in rows_of(run.train, train)]
    episodes += [encode_episode(r, "eval", run.tokens) for r in rows_of(run.evals, evals)]
    shown = (
        f"{len(train)} of {run.train.num_rows} train episodes "
        f"(up to {run.caps.train_groups_per_step} whole groups per step); "
        f"{len(evals)} of {run.evals.num_rows} held-out episodes "
        f"(up to {run.caps.eval_per_evaluation} per evaluation)"
    )
    return {
        "episodes": episodes,
        "shown": shown,
        "token_note": run.tokens.note,
        "empty": "" if episodes else "no episodes recorded",
    }
