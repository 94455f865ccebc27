"""A synthesized env's state: tables of records in a key-value store, made from a seed.

`make_world(spec, seed)` is a pure function: a task stores only its world seed, and every
episode (the expert's, the policy's, a validation probe's) rebuilds the same start state. Keys
are a table's letter and a random number (P482), so no key can be guessed from a name or a
position. Fields a tool looks records up by are unique within a world.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Mapping
from typing import Any

from steprl.envs.synth.spec import SynthSpec, SynthSpecError, Table

#: table -> key -> record (field -> value; the key field is the record's key, not stored)
World = dict[str, dict[str, dict[str, Any]]]
#: (table, key) -> the record after the episode, or None where it was deleted
Diff = dict[tuple[str, str], dict[str, Any] | None]


def lookup_fields(spec: SynthSpec) -> set[tuple[str, str]]:
    """(table, field) pairs some tool finds records by: unique in every world."""
    return {(t.table, t.reads[0].split(".")[1]) for t in spec.tools if t.template == "find"}


def table_order(spec: SynthSpec) -> list[Table]:
    """Tables with every table a field refers to (by its key type) before the table itself."""
    owner = spec.key_types()
    done: list[Table] = []
    seen: set[str] = set()

    def visit(t: Table, path: tuple[str, ...]) -> None:
        if t.name in seen:
            return
        if t.name in path:
            raise SynthSpecError(f"tables: {' -> '.join((*path, t.name))} refer to each other in a cycle")
        for typ in t.fields.values():
            if typ in owner and owner[typ] != t.name:
                visit(spec.tables[owner[typ]], (*path, t.name))
        seen.add(t.name)
        done.append(t)

    for t in spec.tables.values():
        visit(t, ())
    return done


def draw(spec: SynthSpec, semantic: str, rng: random.Random, world: World | None = None) -> Any:
    """A value of a semantic type: an existing key of the table it names, or from its pool."""
    owner = spec.key_types()
    if semantic in owner:
        keys = sorted((world or {}).get(owner[semantic], {}))
        if not keys:
            raise SynthSpecError(f"type {semantic!r}: table {owner[semantic]!r} has no rows to refer to")
        return rng.choice(keys)
    pool = spec.pool(semantic)
    if isinstance(pool, Mapping):
        return rng.randint(int(pool["min"]), int(pool["max"]))
    return rng.choice(pool if isinstance(pool, list) else list(pool))  # no copy per draw


def make_world(spec: SynthSpec, seed: int) -> World:
    rng = random.Random(f"world:{spec.name}:{seed}")
    unique = lookup_fields(spec)
    world: World = {}
    for t in table_order(spec):
        digits = spec.tasks.key_digits
        low = 10 ** (digits - 1) if digits > 1 else 0
        if t.rows > 10**digits - low:
            raise SynthSpecError(
                f"tables.{t.name}.rows: {t.rows} records do not fit in ids of {digits} digit(s); "
                "raise tasks.key_digits or lower rows"
            )
        numbers = rng.sample(range(low, 10**digits), t.rows)
        keys = [f"{t.prefix}{n}" for n in numbers]
        columns: dict[str, list[Any]] = {}
        for f, typ in t.fields.items():
            if (t.name, f) in unique:
                pool = spec.pool(typ)
                # a range, not a list of it: `sample` draws the same values from either
                values = range(pool["min"], pool["max"] + 1) if isinstance(pool, Mapping) else list(pool)
                if len(values) < t.rows:
                    raise SynthSpecError(
                        f"types.{typ}: tools find {t.name} by {f!r}, so it needs at least {t.rows} distinct "
                        f"values (tables.{t.name}.rows), has {len(values)}"
                    )
                columns[f] = rng.sample(values, t.rows)
            else:
                columns[f] = [draw(spec, typ, rng, world) for _ in keys]
        world[t.name] = {k: {f: columns[f][i] for f in t.fields} for i, k in enumerate(keys)}
    return world


def referrers(spec: SynthSpec, world: World, table: str, key: str) -> list[str]:
    """The records whose fields name record `key` of `table` ("loan L12"), in order."""
    key_type = spec.tables[table].key_type
    return [
        f"{t.singular} {k}"
        for t in spec.tables.values()
        for k, record in sorted(world.get(t.name, {}).items())
        if any(typ == key_type and record.get(f) == key for f, typ in t.fields.items())
    ]


def dangling(spec: SynthSpec, world: World) -> list[str]:
    """Fields that name a record no longer in the world ("loans.L12.card"): a state no task's
    golden state may be (a written tool may delete records a template's delete would refuse)."""
    owner = spec.key_types()
    return [
        f"{t.name}.{k}.{f}"
        for t in spec.tables.values()
        for k, record in sorted(world.get(t.name, {}).items())
        for f, typ in t.fields.items()
        if typ in owner and f in record and str(record[f]) not in world.get(owner[typ], {})
    ]


def new_key(world: World, table: Table) -> str:
    """The id a create gives its record: the next number after the table's largest."""
    numbers = [int(k[len(table.prefix) :]) for k in world[table.name]] or [99]
    return f"{table.prefix}{max(numbers) + 1}"


def diff(before: World, after: World) -> Diff:
    out: Diff = {}
    for table in before.keys() | after.keys():
        old, new = before.get(table, {}), after.get(table, {})
        for key in old.keys() | new.keys():
            if old.get(key) != new.get(key):
                out[(table, key)] = copy.deepcopy(new.get(key))
    return out


def diff_cells(d: Diff, before: World) -> set[tuple[str, str, str, str]]:
    """Each changed (table, key, field, new value) cell; a deleted record is one cell "-"."""
    cells = set()
    for (table, key), record in d.items():
        if record is None:
            cells.add((table, key, "", "-"))
            continue
        old = before.get(table, {}).get(key, {})
        cells |= {(table, key, f, repr(v)) for f, v in record.items() if old.get(f, object()) != v}
    return cells


def encode_diff(d: Diff) -> list[list[Any]]:
    """A JSON-able diff (task params): [[table, key, record or null], ...], sorted."""
    return [[t, k, r] for (t, k), r in sorted(d.items())]


def decode_diff(rows: list[list[Any]]) -> Diff:
    return {(str(t), str(k)): (dict(r) if r is not None else None) for t, k, r in rows}
