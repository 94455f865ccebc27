"""Unit tests over the final state: required changes, no collateral changes, the answer.

A task lists its expected `Change`s (data, stored in `Task.params["changes"]`). At the end of
an episode the final database is compared with the golden one (AppWorld-style evaluation):

* one test per expected change: the new row exists / the row has the new values / the row is
  gone;
* one "no collateral changes" test: every difference between the golden and the final state is
  explained by an expected change (a deleted row by a `delete`, a changed row by an `update`
  naming every changed column, each new row by a distinct `insert` it matches);
* for question tasks, one test that the answer matches.

The reward is the fraction of tests passed (partial credit, LOOP's
``passed_unit_tests / num_tests``); success means all passed. Strings are compared
case-insensitively with whitespace collapsed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from steprl.envs.library.apps.db import Row, Snapshot

Op = Literal["insert", "update", "delete"]
_EMPTY: Mapping[str, Any] = MappingProxyType({})


def norm(value: Any) -> Any:
    """Strings compared loosely: case-folded, whitespace collapsed; other values as they are."""
    return " ".join(value.casefold().split()) if isinstance(value, str) else value


@dataclass(frozen=True)
class Change:
    """One expected state change.

    insert: a new row of `table` whose columns equal `equals` and contain `contains`;
    update: row `row` of `table` now has the `equals` values (only those columns change);
    `contains` maps a column to a substring (or a list of them) its value must contain;
    delete: row `row` of `table` is gone.
    """

    op: Op
    table: str
    label: str
    row: int | None = None
    equals: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    contains: Mapping[str, str | Sequence[str]] = field(default_factory=lambda: _EMPTY)

    def __post_init__(self) -> None:
        if (self.row is None) != (self.op == "insert"):
            raise ValueError(f"{self.op} changes need row={'None' if self.op == 'insert' else 'an id'}")
        object.__setattr__(self, "equals", MappingProxyType(dict(self.equals)))
        contains = {k: v if isinstance(v, str) else tuple(v) for k, v in self.contains.items()}
        object.__setattr__(self, "contains", MappingProxyType(contains))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (what a `Task` stores)."""
        return {
            "op": self.op,
            "table": self.table,
            "label": self.label,
            "row": self.row,
            "equals": dict(self.equals),
            "contains": {k: v if isinstance(v, str) else list(v) for k, v in self.contains.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Change:
        return cls(
            op=data["op"],
            table=data["table"],
            label=data["label"],
            row=data.get("row"),
            equals=data.get("equals", {}),
            contains=data.get("contains", {}),
        )

    def matches(self, columns: Sequence[str], row: Row) -> bool:
        """Does `row` have the expected values (for inserts and updates)?"""
        values = dict(zip(columns, row, strict=True))
        if not all(norm(values.get(k)) == norm(v) for k, v in self.equals.items()):
            return False
        for key, wanted in self.contains.items():
            text = norm(str(values.get(key, "")))
            if not all(norm(part) in text for part in ([wanted] if isinstance(wanted, str) else wanted)):
                return False
        return True


def insert(
    table: str, label: str, contains: Mapping[str, str | Sequence[str]] | None = None, **equals: Any
) -> Change:
    return Change("insert", table, label, None, equals, contains or {})


def update(table: str, row: int, label: str, **equals: Any) -> Change:
    return Change("update", table, label, row, equals)


def delete(table: str, row: int, label: str) -> Change:
    return Change("delete", table, label, row)


@dataclass(frozen=True)
class UnitResult:
    name: str
    passed: bool


@dataclass(frozen=True)
class Report:
    """The task's unit tests and their outcome."""

    tests: tuple[UnitResult, ...]

    @property
    def score(self) -> float:
        """Fraction of tests passed, in [0, 1]."""
        return sum(t.passed for t in self.tests) / len(self.tests) if self.tests else 0.0

    @property
    def success(self) -> bool:
        return all(t.passed for t in self.tests)


def _new_rows(golden: Snapshot, final: Snapshot, table: str) -> list[Row]:
    old = golden[table][1]
    return [row for key, row in final[table][1].items() if key not in old]


def change_done(change: Change, golden: Snapshot, final: Snapshot) -> bool:
    """Is `change` visible in the final state?"""
    columns, rows = final[change.table]
    if change.op == "insert":
        return any(change.matches(columns, row) for row in _new_rows(golden, final, change.table))
    if change.op == "delete":
        return change.row not in rows
    return change.row in rows and change.matches(columns, rows[change.row])


def collateral(changes: Sequence[Change], golden: Snapshot, final: Snapshot) -> list[str]:
    """Differences between golden and final that no expected change explains (empty: none)."""
    problems: list[str] = []
    for table, (columns, old) in golden.items():
        new = final[table][1]
        specs = [c for c in changes if c.table == table]
        allowed_deletes = {c.row for c in specs if c.op == "delete"}
        for key in sorted(set(old) - set(new)):
            if key not in allowed_deletes:
                problems.append(f"{table} row {key} deleted")
        for key in sorted(set(old) & set(new)):
            if old[key] == new[key]:
                continue
            allowed = {col for c in specs if c.op == "update" and c.row == key for col in c.equals}
            changed = {col for col, a, b in zip(columns, old[key], new[key], strict=True) if a != b}
            if not changed <= allowed:
                problems.append(f"{table} row {key} changed {sorted(changed - allowed)}")
        inserts = [c for c in specs if c.op == "insert"]
        added = _new_rows(golden, final, table)
        if len(added) > len(inserts) or not _assign(added, inserts, columns):
            problems.append(f"{len(added)} unexpected new {table} row(s)")
    return problems


def _assign(rows: list[Row], inserts: list[Change], columns: Sequence[str]) -> bool:
    """Can every new row be matched to a distinct expected insert? (tiny bipartite matching)"""
    owner: dict[int, int] = {}  # insert index -> row index

    def place(r: int, seen: set[int]) -> bool:
        for i, spec in enumerate(inserts):
            if i in seen or not spec.matches(columns, rows[r]):
                continue
            seen.add(i)
            if i not in owner or place(owner[i], seen):
                owner[i] = r
                return True
        return False

    return all(place(r, set()) for r in range(len(rows)))


def _strip_answer(text: str) -> str:
    """`text` without leading whitespace and quotes, nor trailing whitespace, quotes and periods.

    A scan, not a regex: the regex that did this (a trailing ``[\\s"'`.]+$``) retried from every
    character of an inner run of those, quadratic in it (a 30000-space answer took 10 s).
    """
    start, end = 0, len(text)
    while start < end and (text[start].isspace() or text[start] in "\"'`"):
        start += 1
    while end > start and (text[end - 1].isspace() or text[end - 1] in "\"'`."):
        end -= 1
    return text[start:end]


def answer_matches(given: str, expected: str) -> bool:
    """Loose match: case, surrounding quotes, a final period and inner spacing are ignored."""
    return norm(_strip_answer(given)) == norm(_strip_answer(expected))


def run_tests(
    changes: Sequence[Change],
    golden: Snapshot,
    final: Snapshot,
    *,
    answer: str | None = None,
    expected_answer: str | None = None,
) -> Report:
    """All of a task's tests on the final state (see the module docstring)."""
    tests = [UnitResult(c.label, change_done(c, golden, final)) for c in changes]
    tests.append(UnitResult("no collateral changes", not collateral(changes, golden, final)))
    if expected_answer is not None:
        ok = answer is not None and answer_matches(answer, expected_answer)
        tests.append(UnitResult(f"answer is {expected_answer!r}", ok))
    return Report(tuple(tests))
