"""The tool-documentation file `steprl synth` reads: a typed state and JSON-schema tools over it.

```yaml
name: shop
description: A shop's products, customers and orders.
tables:                      # the typed state: tables of records, each keyed by one field
  products:
    key: sku                 # the key field; its values are ids the generator makes (P482)
    fields: {name: product_name, price: int, stock: int}
    rows: 6                  # records per generated world
  orders:
    key: order_id
    fields: {sku: sku, qty: int, status: order_status}   # a field typed by another table's key
types:                       # value pools: a list, or {min, max} for integers
  product_name: [lamp, chair, desk, sofa, shelf, stool, bench, mirror]
  order_status: [open, shipped, cancelled]
tools:                       # name, description, typed parameters, what each reads and writes
  - name: find_product
    description: The SKU of the product with this name.
    parameters: {type: object, properties: {name: {type: string}}, required: [name]}
    reads: [products.name]
    returns: sku
  - name: set_price
    description: Set a product's price.
    parameters:
      type: object
      properties: {sku: {type: string}, price: {type: integer}}
      required: [sku, price]
    writes: [products.price]
tasks: {count: 150, max_writes: 2, holdout_shapes: 0.25, seed: 0}   # see `TaskGen`
```

Instead of each tool's schema, ``mcp: {command, args, ignore}`` takes the tools' names,
descriptions and schemas from an MCP server's `tools/list` (`mcp_tools.py`); a tool no template
expresses is ``template: written`` with ``code:`` (or the LLM writer writes it: `writer.py`).

A parameter's semantic type is its ``x-type`` if given, else the type of the field of the same
name in the table the tool reads or writes (the key field included): that is what links one
tool's result to another's input in the dependency graph. ``template`` (one of
`templates.TEMPLATES`) says how a tool is implemented; without it the template is inferred from
reads, writes, returns and an ``effect: add`` (`templates.parse_spec`). Every problem
is a `SynthSpecError`: one line naming the key and what it may be.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from steprl.bounded_yaml import load_yaml_bounded
from steprl.errors import UserError

BUILTIN_TYPES = ("int", "bool", "str")
_JSON_OF = {"int": "integer", "bool": "boolean"}  # every other semantic type is a JSON string
#: the most values a type under `types:` may have (a list, or an int range): every value is
#: drawn from, copied into worlds and searched for free ones; a 10^6-string pool ran 248 s
MAX_POOL = 10_000
_WORDS = ("amber", "birch", "cedar", "delta", "ember", "fjord", "grove", "heron", "iris", "jade")


class SynthSpecError(UserError):
    """A tool-documentation file that cannot be synthesized (one line: which key, what is allowed)."""


@dataclass(frozen=True)
class Table:
    name: str
    key: str  # the key field's name
    key_type: str  # the semantic type of its values (the key field's name unless typed)
    fields: Mapping[str, str]  # field -> semantic type (the key field not included)
    rows: int
    singular: str
    prefix: str  # the first letter of generated ids

    def type_of(self, name: str) -> str | None:
        return self.key_type if name == self.key else self.fields.get(name)


@dataclass(frozen=True)
class Param:
    name: str
    json_type: str
    semantic: str  # a table's key type, a pool type, or a builtin


@dataclass(frozen=True)
class ToolDoc:
    name: str
    description: str
    params: tuple[Param, ...]
    schema: Mapping[str, Any]  # the JSON schema as given (the policy sees it)
    reads: tuple[str, ...]  # "table.field" or "table"
    writes: tuple[str, ...]
    returns: str | None
    effect: str  # "set" | "add": how a written field takes its value
    template: str  # filled in by `templates.infer_template` when not given
    phrase: str  # "" = the template's default wording
    code: str = ""  # a `written` tool's Python: `def call(world, args) -> str` (writer.py)

    @property
    def table(self) -> str:
        return (self.writes or self.reads)[0].split(".")[0]

    def param(self, name: str) -> Param:
        return next(p for p in self.params if p.name == name)


@dataclass(frozen=True)
class TaskGen:
    count: int = 150
    max_writes: int = 2
    holdout_shapes: float = 0.25  # the share of DAG shapes kept out of training (eval only)
    seed: int = 0
    partial_credit: bool = False
    ask_user: float = 0.0  # the share of tasks whose request leaves one value to ask the user for
    user_error_rate: float = 0.0  # how often the simulated user answers that value wrong
    # digits of generated record ids (3: P482); fewer are easier for a small model to copy from
    # a result into its next call, more are harder to guess
    key_digits: int = 3
    # held-out shapes drawn only among those whose every tool some train shape calls (a
    # compositional split: unseen combinations of seen tools), not from all shapes
    holdout_tools_seen: bool = False


@dataclass(frozen=True)
class SynthSpec:
    name: str
    description: str
    tables: Mapping[str, Table]
    pools: Mapping[str, Any]  # semantic type -> list of values, or {"min", "max"}
    tools: tuple[ToolDoc, ...]
    tasks: TaskGen = field(default_factory=TaskGen)
    max_turns: int = 10
    source: str = ""

    def tool(self, name: str) -> ToolDoc:
        return next(t for t in self.tools if t.name == name)

    def key_types(self) -> dict[str, str]:
        """A table's key type -> the table."""
        return {t.key_type: t.name for t in self.tables.values()}

    def json_type(self, semantic: str) -> str:
        return _JSON_OF.get(semantic, "string")

    def pool(self, semantic: str) -> Any:
        if semantic in self.pools:
            return self.pools[semantic]
        if semantic == "int":
            return {"min": 1, "max": 50}
        if semantic == "bool":
            return [True, False]
        return list(_WORDS)


def _fail(where: str, what: str) -> SynthSpecError:
    return SynthSpecError(f"{where}: {what}")


def _as_map(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _fail(where, f"must be a mapping, got {type(value).__name__}")
    return value


def _identifier(name: Any, where: str) -> str:
    if not isinstance(name, str) or not name.isidentifier():
        raise _fail(where, f"must be a name of letters, digits and _ (got {name!r})")
    return name


def _tables(raw: Mapping[str, Any], pools: Mapping[str, Any]) -> dict[str, Table]:
    out: dict[str, Table] = {}
    prefixes: set[str] = set()
    for name, body in _as_map(raw, "tables").items():
        where = f"tables.{_identifier(name, 'tables')}"
        body = _as_map(body, where)
        unknown = set(body) - {"key", "fields", "rows", "singular", "key_type"}
        if unknown:
            raise _fail(
                where, f"unknown keys {sorted(unknown)}; allowed: key, key_type, fields, rows, singular"
            )
        key = _identifier(body.get("key"), f"{where}.key")
        fields = {
            _identifier(f, f"{where}.fields"): str(t)
            for f, t in _as_map(body.get("fields", {}), f"{where}.fields").items()
        }
        rows = body.get("rows", 6)
        if not isinstance(rows, int) or not 2 <= rows <= 200:
            raise _fail(f"{where}.rows", f"must be an integer in [2, 200], got {rows!r}")
        prefix = next((c.upper() for c in name if c.upper() not in prefixes), name[0].upper())
        prefixes.add(prefix)
        singular = str(body.get("singular", name[:-1] if name.endswith("s") else name))
        out[name] = Table(name, key, str(body.get("key_type", key)), fields, rows, singular, prefix)
    if not out:
        raise _fail("tables", "needs at least one table")
    known = set(BUILTIN_TYPES) | set(pools) | {t.key_type for t in out.values()}
    for t in out.values():
        for f, typ in t.fields.items():
            if typ == t.key_type:  # its records would refer to records not made yet
                raise _fail(
                    f"tables.{t.name}.fields.{f}",
                    f"is of type {typ!r}, the key of its own table: a table cannot refer to itself; "
                    f"put the link in a table of its own (one with fields of type {typ!r})",
                )
            if typ not in known:
                raise _fail(
                    f"tables.{t.name}.fields.{f}",
                    f"type {typ!r} is not a builtin ({', '.join(BUILTIN_TYPES)}), a pool under `types`, "
                    f"or a table's key type ({', '.join(sorted(x.key_type for x in out.values()))})",
                )
    return out


def _refs(raw: Any, where: str, tables: Mapping[str, Table]) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise _fail(where, "must be a list of table or table.field names")
    for ref in raw:
        table, _, fname = str(ref).partition(".")
        if table not in tables:
            raise _fail(where, f"{ref!r} names no table; tables: {', '.join(tables)}")
        if fname and tables[table].type_of(fname) is None:
            fields = [tables[table].key, *tables[table].fields]
            raise _fail(
                where, f"{ref!r}: table {table!r} has no field {fname!r}; fields: {', '.join(fields)}"
            )
    return tuple(str(r) for r in raw)


def _tool(raw: Any, i: int, tables: Mapping[str, Table], pools: Mapping[str, Any]) -> ToolDoc:
    where = f"tools[{i}]"
    body = _as_map(raw, where)
    name = _identifier(body.get("name"), f"{where}.name")
    where = f"tools[{i}] ({name})"
    allowed = {
        "name",
        "description",
        "parameters",
        "reads",
        "writes",
        "returns",
        "effect",
        "template",
        "phrase",
        "code",
    }
    unknown = set(body) - allowed
    if unknown:
        raise _fail(where, f"unknown keys {sorted(unknown)}; allowed: {', '.join(sorted(allowed))}")
    reads = _refs(body.get("reads"), f"{where}.reads", tables)
    writes = _refs(body.get("writes"), f"{where}.writes", tables)
    if not reads and not writes:
        raise _fail(
            where, "says neither what it reads nor what it writes; add reads: [table.field] or writes"
        )
    table = tables[(writes or reads)[0].split(".")[0]]
    schema = _as_map(body.get("parameters", {"type": "object", "properties": {}}), f"{where}.parameters")
    if schema.get("type", "object") != "object":
        raise _fail(f"{where}.parameters", "must be a JSON schema of type object")
    params = []
    for pname, prop in _as_map(schema.get("properties", {}), f"{where}.parameters.properties").items():
        prop = _as_map(prop, f"{where}.parameters.properties.{pname}")
        semantic = prop.get("x-type") or table.type_of(str(pname))
        known = set(BUILTIN_TYPES) | set(pools) | {t.key_type for t in tables.values()}
        if semantic is not None and semantic not in known:
            raise _fail(
                f"{where}.parameters.properties.{pname}.x-type",
                f"{semantic!r} is not a builtin ({', '.join(BUILTIN_TYPES)}), a pool under `types` or a "
                "table's key type",
            )
        if semantic is None:
            raise _fail(
                f"{where}.parameters.properties.{pname}",
                f"has no x-type and table {table.name!r} has no field {pname!r}; add x-type: <a type>",
            )
        json_type = str(prop.get("type", "string"))
        params.append(Param(str(pname), json_type, str(semantic)))
    raw_required = schema.get("required", [p.name for p in params])
    if not isinstance(raw_required, list) or not all(isinstance(r, str) for r in raw_required):
        raise _fail(
            f"{where}.parameters.required", f"must be a list of parameter names, got {raw_required!r}"
        )
    required = set(raw_required)
    if required != {p.name for p in params}:
        raise _fail(
            f"{where}.parameters.required",
            "every parameter must be required (synthesized tasks bind them all)",
        )
    returns = body.get("returns")
    known = set(BUILTIN_TYPES) | set(pools) | {t.key_type for t in tables.values()}
    if returns is not None and (not isinstance(returns, str) or returns not in known):
        raise _fail(
            f"{where}.returns",
            f"{returns!r} is not a builtin ({', '.join(BUILTIN_TYPES)}), a pool under `types` or a table's "
            f"key type ({', '.join(sorted(t.key_type for t in tables.values()))})",
        )
    effect = str(body.get("effect", "set"))
    if effect not in ("set", "add"):
        raise _fail(f"{where}.effect", f"must be set or add, got {effect!r}")
    keep = {k: v for k, v in schema.items() if k != "x-type"}
    return ToolDoc(
        name,
        str(body.get("description", "")),
        tuple(params),
        {**keep, "required": sorted(required)},
        reads,
        writes,
        None if returns is None else str(returns),
        effect,
        str(body.get("template", "")),
        str(body.get("phrase", "")),
        str(body.get("code", "")),
    )


def read_spec(raw: Any, source: str = "<spec>") -> SynthSpec:
    """A `SynthSpec` from a YAML document's data, its tools' templates as given (`templates.parse_spec`
    infers and checks them)."""
    body = _as_map(raw, source)
    allowed = {"name", "description", "tables", "types", "tools", "tasks", "max_turns"}
    unknown = set(body) - allowed
    if unknown:
        raise _fail(source, f"unknown keys {sorted(unknown)}; allowed: {', '.join(sorted(allowed))}")
    name = _identifier(body.get("name"), "name")
    pools = dict(_as_map(body.get("types", {}), "types"))
    for typ, pool in pools.items():
        ok = (isinstance(pool, list) and len(pool) >= 2) or (
            isinstance(pool, Mapping)
            and isinstance(pool.get("min"), int)
            and isinstance(pool.get("max"), int)
            and pool["max"] > pool["min"]
        )
        if not ok:
            raise _fail(
                f"types.{typ}", "must be a list of at least 2 values or {min: int, max: int} with max > min"
            )
        size = len(pool) if isinstance(pool, list) else pool["max"] - pool["min"] + 1
        if size > MAX_POOL:
            raise _fail(
                f"types.{typ}",
                f"has {size} values, more than {MAX_POOL}; keep the ones tasks need to draw from",
            )
    tables = _tables(_as_map(body.get("tables"), "tables"), pools)
    raw_tools = body.get("tools")
    if not isinstance(raw_tools, list) or not raw_tools:
        raise _fail("tools", "must be a non-empty list of tool specs")
    tools = [_tool(t, i, tables, pools) for i, t in enumerate(raw_tools)]
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise _fail("tools", f"tool names must be unique, got {names}")
    tg = dict(_as_map(body.get("tasks", {}), "tasks"))
    unknown = set(tg) - {f.name for f in TaskGen.__dataclass_fields__.values()}
    if unknown:
        raise _fail(
            "tasks", f"unknown keys {sorted(unknown)}; allowed: {', '.join(TaskGen.__dataclass_fields__)}"
        )
    for key, default in ((f.name, f.default) for f in TaskGen.__dataclass_fields__.values()):
        value = tg.get(key, default)
        kind = type(default)
        ok = isinstance(value, kind) or (kind is float and isinstance(value, int))
        if not ok or (kind is not bool and isinstance(value, bool)):
            raise _fail(f"tasks.{key}", f"must be {kind.__name__}, got {value!r}")
    gen = TaskGen(**tg)
    if (
        not 1 <= gen.count <= 100_000
        or not 1 <= gen.max_writes <= 4
        or not 0 < gen.holdout_shapes < 1
        or not 0 <= gen.ask_user <= 1
        or not 0 <= gen.user_error_rate < 1
        or not 1 <= gen.key_digits <= 6
    ):
        raise _fail(
            "tasks",
            "count in [1, 100000], max_writes in [1, 4], holdout_shapes in (0, 1), ask_user in [0, 1], "
            "user_error_rate in [0, 1), key_digits in [1, 6]",
        )
    max_turns = body.get("max_turns", 10)
    if not isinstance(max_turns, int) or isinstance(max_turns, bool) or not 1 <= max_turns <= 100:
        raise _fail("max_turns", f"must be an integer in [1, 100], got {max_turns!r}")
    return SynthSpec(
        name,
        str(body.get("description", "")),
        tables,
        pools,
        tuple(tools),
        gen,
        max_turns,
        source,
    )


def read_yaml(path: str | Path) -> Any:
    p = Path(path)
    try:
        return load_yaml_bounded(p.read_text(encoding="utf-8"), str(p))  # bounded: no alias bombs
    except FileNotFoundError:
        raise SynthSpecError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise SynthSpecError(f"{p}: is a directory; give a tool-documentation YAML file") from None
    except UnicodeDecodeError as exc:
        raise SynthSpecError(f"{p}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    except OSError as exc:
        raise SynthSpecError(f"{p}: cannot be read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise SynthSpecError(f"{p}: not valid YAML: {str(exc).splitlines()[0]}") from None
