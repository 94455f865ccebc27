"""One saved episode as the page embeds it, within a byte allowance: whatever the episode holds
(a 1 MiB observation, 10,000 turns, a megabyte of step info), the page gets a bounded piece of
it, and each cut says how long the whole was and which `steprl show` line prints it.

Only the kept part of a long row is converted to Python: its turns and token lists are cut in
Arrow (converting a 1 MiB observation to a Python list costs more than building the whole
report). Rows that fit the caps whole (most of a run's) are converted together, at once.
The cut is derived from the allowance (`first_shape`), measured as the page stores it, and
halved until the episode and the token texts it adds fit.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from steprl.report.budget import clip, size
from steprl.report.run_data import Caps, TokenText, is_success, json_object

Columns = Mapping[str, pa.ChunkedArray]  # a trajectory table's columns by name

_ID_BYTES = 12  # an embedded id: its digits, a comma, its advantage, its share of the token table
_TURN_BYTES = 150  # a turn without tokens: reward, version, keys


@dataclass(frozen=True)
class Shape:
    """How much of one episode the page embeds."""

    turns: int  # the first turns - 1 and the last (the answer), in order
    tokens: int  # the most ids of one prompt, action or observation


def first_shape(n_turns: int, allowance: int, caps: Caps) -> Shape:
    """The largest cut the allowance (bytes) should hold; `encode` halves it until it does."""
    turns = min(n_turns, caps.max_turns, max(1, allowance // (4 * _TURN_BYTES)))
    pieces = 1 + 2 * turns  # the prompt, and each turn's action and observation
    by_bytes = (allowance - _TURN_BYTES * turns - 1000) // (_ID_BYTES * pieces)
    return Shape(turns, max(8, min(caps.turn_tokens, caps.episode_tokens // pieces, by_bytes)))


def kept_turns(n_turns: int, turns: int) -> list[int]:
    """The turn indices a shape keeps: the first `turns - 1` and the last."""
    if n_turns <= turns:
        return list(range(n_turns))
    return [*range(turns - 1), n_turns - 1] if turns > 0 else []


def _cut(
    column: pa.ChunkedArray | None, row: int, keep: Sequence[int], cap: int
) -> dict[int, tuple[list[Any], int]]:
    """{turn: (its first `cap` values, its full length)} of a list-of-lists cell, for the kept
    turns the cell has (a null cell or turn: none)."""
    cell = column[row] if column is not None else None  # an older run's file may lack the column
    if cell is None or not cell.is_valid:
        return {}
    turns = cell.values
    keep = [k for k in keep if k < len(turns)]
    if not keep:
        return {}
    sub = turns.take(pa.array(keep, type=pa.int64()))
    heads = pc.list_slice(sub, 0, cap).to_pylist()
    lengths = pc.list_value_length(sub).to_pylist()
    return {k: (h or [], n or 0) for k, h, n in zip(keep, heads, lengths, strict=True)}


def _each(column: pa.ChunkedArray | None, row: int, keep: Sequence[int]) -> dict[int, Any]:
    """{turn: value} of a list cell (one value per turn), for the kept turns it has."""
    cell = column[row] if column is not None else None  # an older run's file may lack the column
    if cell is None or not cell.is_valid:
        return {}
    values = cell.values
    keep = [k for k in keep if k < len(values)]
    return dict(zip(keep, values.take(pa.array(keep, type=pa.int64())).to_pylist(), strict=True))


_META = ("step", "task_id", "group_id", "env", "end", "outcome_reward", "info_json")


class _Row(Protocol):
    """One trajectory row, read either from Arrow (a long row, cut there) or from Python."""

    n_turns: int

    def cut(self, name: str, keep: Sequence[int], cap: int) -> dict[int, tuple[list[Any], int]]: ...
    def each(self, name: str, keep: Sequence[int]) -> dict[int, Any]: ...
    def prompt(self, cap: int) -> tuple[list[int], int]: ...
    def meta(self) -> dict[str, Any]: ...


class _ArrowRow:
    def __init__(self, cols: Columns, row: int) -> None:
        self.cols, self.row = cols, row
        actions = cols["action_ids"][row]
        self.n_turns = len(actions.values) if actions.is_valid else 0

    def cut(self, name: str, keep: Sequence[int], cap: int) -> dict[int, tuple[list[Any], int]]:
        return _cut(self.cols.get(name), self.row, keep, cap)  # an older run's files may lack one

    def each(self, name: str, keep: Sequence[int]) -> dict[int, Any]:
        return _each(self.cols.get(name), self.row, keep)

    def prompt(self, cap: int) -> tuple[list[int], int]:
        cell = self.cols["prompt_ids"][self.row]
        return (cell.values.slice(0, cap).to_pylist(), len(cell.values)) if cell.is_valid else ([], 0)

    def meta(self) -> dict[str, Any]:
        return {name: self.cols[name][self.row].as_py() for name in _META}


class _PyRow:
    def __init__(self, row: Mapping[str, Any]) -> None:
        self.row = row
        self.n_turns = len(row.get("action_ids") or [])

    def cut(self, name: str, keep: Sequence[int], cap: int) -> dict[int, tuple[list[Any], int]]:
        cell = self.row.get(name)
        if cell is None:
            return {}
        return {k: ((cell[k] or [])[:cap], len(cell[k] or [])) for k in keep if k < len(cell)}

    def each(self, name: str, keep: Sequence[int]) -> dict[int, Any]:
        cell = self.row.get(name)
        return {} if cell is None else {k: cell[k] for k in keep if k < len(cell)}

    def prompt(self, cap: int) -> tuple[list[int], int]:
        ids = self.row.get("prompt_ids") or []
        return ids[:cap], len(ids)

    def meta(self) -> dict[str, Any]:
        return dict(self.row)


def _ids_per_row(column: pa.ChunkedArray) -> np.ndarray:
    """Each row's ids over all its turns, of a list-of-lists column (no values converted)."""
    out: list[np.ndarray] = [np.zeros(0)]
    for chunk in column.chunks:
        per_turn = pc.list_value_length(chunk.flatten()).fill_null(0).to_numpy(zero_copy_only=False)
        parents = pc.list_parent_indices(chunk).to_numpy(zero_copy_only=False)
        out.append(np.bincount(parents, weights=per_turn, minlength=len(chunk)))
    return np.concatenate(out)


def _whole(table: pa.Table, rows: Sequence[int], caps: Caps) -> dict[int, dict[str, Any]]:
    """The rows of `rows` that fit the caps whole, converted to Python together."""
    if not rows:
        return {}
    lengths = pc.list_value_length(table.column("prompt_ids")).fill_null(0).to_numpy(zero_copy_only=False)
    total = lengths + _ids_per_row(table.column("action_ids")) + _ids_per_row(table.column("observation_ids"))
    turns = pc.list_value_length(table.column("action_ids")).fill_null(0).to_numpy(zero_copy_only=False)
    small = [r for r in rows if total[r] <= caps.turn_tokens and turns[r] <= caps.max_turns]
    if not small:
        return {}
    return dict(zip(small, table.take(pa.array(small, type=pa.int64())).to_pylist(), strict=True))


def _info(text: str | None, caps: Caps) -> dict[str, Any]:
    """A turn's info: parsed when short; else its head as text (parsing a megabyte to show a
    line of it is the cost this module avoids)."""
    text = text or "{}"
    if len(text) > caps.info_chars:
        return {"raw": clip(text, caps.info_chars)}
    return json_object(text)


def _number(value: Any, digits: int) -> float:
    return round(float(value), digits) if value is not None else 0.0


def _encode(src: _Row, kind: str, shape: Shape, caps: Caps) -> dict[str, Any]:
    n_turns = src.n_turns
    keep = kept_turns(n_turns, shape.turns)
    actions = src.cut("action_ids", keep, shape.tokens)
    advantages = src.cut("advantages", keep, shape.tokens)
    observations = src.cut("observation_ids", keep, shape.tokens)
    rewards, versions = src.each("rewards", keep), src.each("policy_versions", keep)
    infos, credit = src.each("step_info_json", keep), src.each("step_credit", keep)
    turns = []
    for k in keep:
        a, a_len = actions.get(k, ([], 0))
        o, o_len = observations.get(k, ([], 0))
        adv = advantages[k][0] if k in advantages else None
        turn: dict[str, Any] = {
            "a": [int(i) for i in a],
            "adv": None if adv is None else [_number(x, 3) for x in adv],
            "o": [int(i) for i in o],
            "r": _number(rewards.get(k), 4),
            "v": int(versions.get(k) or 0),
            "info": _info(infos.get(k), caps),
        }
        turn |= {"c": _number(credit[k], 4)} if credit.get(k) is not None else {}
        turn |= {"al": a_len} if a_len > len(a) else {}
        turn |= {"ol": o_len} if o_len > len(o) else {}
        turn |= {"k": k} if len(keep) < n_turns else {}
        turns.append(turn)
    prompt, prompt_len = src.prompt(shape.tokens)
    meta = src.meta()
    episode: dict[str, Any] = {
        "kind": kind,
        "step": int(meta["step"] or 0),
        "task": clip(str(meta["task_id"] or ""), caps.text_chars),
        "group": clip(str(meta["group_id"] or ""), caps.text_chars),
        "env": clip(str(meta["env"] or ""), caps.text_chars),
        "end": clip(str(meta["end"] or ""), caps.text_chars),
        "reward": _number(meta["outcome_reward"], 4),
        "success": is_success(meta),
        "prompt": [int(i) for i in prompt],
        "turns": turns,
    }
    episode |= {"pl": prompt_len} if prompt_len > len(prompt) else {}
    episode |= {"turns_total": n_turns} if len(keep) < n_turns else {}
    return episode


def _cut_anything(episode: dict[str, Any]) -> bool:
    return (
        "pl" in episode or "turns_total" in episode or any("al" in t or "ol" in t for t in episode["turns"])
    )


def show_command(run_path: Path, episode: dict[str, Any], task: str) -> str:
    """The `steprl show` line that prints this episode whole, in the terminal."""
    where = " --eval" if episode["kind"] == "eval" else ""
    return (
        f"steprl show {shlex.quote(str(run_path))} --step {episode['step']} --task {shlex.quote(task)}{where}"
    )


def episode_ids(episode: dict[str, Any]) -> list[int]:
    return [*episode["prompt"], *(i for t in episode["turns"] for i in (*t["a"], *t["o"]))]


def encode(
    src: _Row, kind: str, tokens: TokenText, allowance: int, caps: Caps, run_path: Path
) -> dict[str, Any] | None:
    """One row as the page's episode, costing at most `allowance` bytes with the token texts it
    adds to `tokens` (recorded there); None when not even its header fits."""
    shape = first_shape(src.n_turns, allowance, caps)
    task = str(src.meta().get("task_id") or "")
    while True:
        episode = _encode(src, kind, shape, caps)
        if _cut_anything(episode):
            episode["show"] = clip(show_command(run_path, episode, task), 2 * caps.text_chars)
        ids = episode_ids(episode)
        if size(episode) + tokens.cost(ids) <= allowance:
            tokens.use(ids)
            return episode
        if shape == Shape(0, 0):
            return None
        shape = replace(shape, turns=shape.turns // 2, tokens=shape.tokens // 2)


def encode_all(
    table: pa.Table,
    rows: Sequence[int],
    kind: str,
    tokens: TokenText,
    budget: int,
    caps: Caps,
    run_path: Path,
) -> list[dict[str, Any] | None]:
    """The episodes at `rows` (None for one whose header alone is over its share), each given an
    equal share of what is left of `budget` (bytes): a short episode's unused share goes to
    those after it."""
    out: list[dict[str, Any] | None] = []
    left = budget
    cols = {name: table.column(name) for name in table.column_names}
    whole = _whole(table, rows, caps)
    for n, row in enumerate(rows):
        mark = tokens.bytes
        src: _Row = _PyRow(whole[row]) if row in whole else _ArrowRow(cols, row)
        episode = encode(src, kind, tokens, left // (len(rows) - n), caps, run_path)
        left -= 0 if episode is None else size(episode) + 1 + tokens.bytes - mark
        out.append(episode)
    return out
