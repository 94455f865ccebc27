"""How a documented tool is implemented over the state, with no LLM: one template per shape of
tool, in one dict (`TEMPLATES`); `check_template` (run by the tests over every entry) holds each
to its contract on a generated world.

A template says what a tool must declare to be one of its kind (`problem`: None if it fits),
runs a call on a world (`call`: returns the result text, raises `ToolError` for a model's bad
input), names the semantic type of its result (what the dependency graph links on), and words a
call for a task's request (`phrase`). A tool's template is `template:` in the spec, or the first
entry here whose `problem` is None (`infer_template`).
"""

from __future__ import annotations

import ast
import dataclasses
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from steprl.envs.base import ToolError
from steprl.envs.synth.sandboxed import runner_for
from steprl.envs.synth.spec import SynthSpec, SynthSpecError, Table, ToolDoc, read_spec, read_yaml
from steprl.envs.synth.world import World, new_key, referrers


class Template(Protocol):
    writes: bool  # whether a call changes the state
    needs: str  # what a tool declares to be of this kind (for the error when none fits)

    def problem(self, spec: SynthSpec, tool: ToolDoc) -> str | None: ...

    def result_type(self, spec: SynthSpec, tool: ToolDoc) -> str | None: ...

    def call(self, spec: SynthSpec, tool: ToolDoc, world: World, args: Mapping[str, Any]) -> str: ...

    def phrase(self, spec: SynthSpec, tool: ToolDoc, words: Mapping[str, str]) -> str: ...


def _field(ref: str) -> str:
    return ref.partition(".")[2]


def _key_param(spec: SynthSpec, tool: ToolDoc) -> str | None:
    table = spec.tables[tool.table]
    return next((p.name for p in tool.params if p.semantic == table.key_type), None)


def _record(spec: SynthSpec, tool: ToolDoc, world: World, key: Any) -> dict[str, Any]:
    table = spec.tables[tool.table]
    record = world[table.name].get(str(key))
    if record is None:
        raise ToolError(f"no {table.singular} {key}")
    return record


def _check_refs(spec: SynthSpec, world: World, tool: ToolDoc, args: Mapping[str, Any]) -> None:
    """A value typed by a table's key must name one of its records."""
    owner = spec.key_types()
    for p in tool.params:
        if p.semantic in owner and str(args[p.name]) not in world[owner[p.semantic]]:
            raise ToolError(f"no {spec.tables[owner[p.semantic]].singular} {args[p.name]}")


class Find:
    writes = False
    needs = "find: reads [T.f], one parameter of f's type, returns T's key type"

    def problem(self, spec: SynthSpec, tool: ToolDoc) -> str | None:
        table = spec.tables[tool.table]
        if tool.writes or len(tool.reads) != 1 or not _field(tool.reads[0]):
            return "reads exactly one table.field and writes nothing"
        want = table.type_of(_field(tool.reads[0]))
        if len(tool.params) != 1 or tool.params[0].semantic != want:
            return f"takes one parameter of type {want!r}"
        if tool.returns != table.key_type:
            return f"returns {table.key_type!r}"
        return None

    def result_type(self, spec: SynthSpec, tool: ToolDoc) -> str | None:
        return spec.tables[tool.table].key_type

    def call(self, spec: SynthSpec, tool: ToolDoc, world: World, args: Mapping[str, Any]) -> str:
        table, f = spec.tables[tool.table], _field(tool.reads[0])
        value = args[tool.params[0].name]
        hits = [k for k, r in sorted(world[table.name].items()) if r.get(f) == value]
        if not hits:
            raise ToolError(f"no {table.singular} with {f} {value!r}")
        return hits[0]

    def phrase(self, spec: SynthSpec, tool: ToolDoc, words: Mapping[str, str]) -> str:
        return ""  # implied by the references to what it finds


class Get:
    writes = False
    needs = "get: reads [T.f], one parameter of T's key type"

    def problem(self, spec: SynthSpec, tool: ToolDoc) -> str | None:
        if tool.writes or len(tool.reads) != 1 or not _field(tool.reads[0]):
            return "reads exactly one table.field and writes nothing"
        key = _key_param(spec, tool)
        if key is None or len(tool.params) != 1:
            return "takes only the record's key"
        return None

    def result_type(self, spec: SynthSpec, tool: ToolDoc) -> str | None:
        return spec.tables[tool.table].type_of(_field(tool.reads[0]))

    def call(self, spec: SynthSpec, tool: ToolDoc, world: World, args: Mapping[str, Any]) -> str:
        key = args[tool.params[0].name]
        return str(_record(spec, tool, world, key)[_field(tool.reads[0])])

    def phrase(self, spec: SynthSpec, tool: ToolDoc, words: Mapping[str, str]) -> str:
        return f"the {_field(tool.reads[0])} of {words[tool.params[0].name]}"


def _write_field_problem(spec: SynthSpec, tool: ToolDoc, effect: str) -> str | None:
    if len(tool.writes) != 1 or not _field(tool.writes[0]) or tool.effect != effect:
        return f"writes exactly one table.field with effect {effect}"
    table: Table = spec.tables[tool.table]
    key = _key_param(spec, tool)
    others = [p for p in tool.params if p.name != key]
    want = "int" if effect == "add" else table.type_of(_field(tool.writes[0]))
    if key is None or len(others) != 1 or others[0].semantic != want:
        return f"takes the record's key and one value of type {want!r}"
    if effect == "add" and table.type_of(_field(tool.writes[0])) != "int":
        return "adds to an int field"
    return None


class Set:
    writes = True
    needs = "set: writes [T.f], the record's key and a value of f's type"

    def problem(self, spec: SynthSpec, tool: ToolDoc) -> str | None:
        return _write_field_problem(spec, tool, "set")

    def result_type(self, spec: SynthSpec, tool: ToolDoc) -> str | None:
        return None

    def call(self, spec: SynthSpec, tool: ToolDoc, world: World, args: Mapping[str, Any]) -> str:
        key = _key_param(spec, tool)
        _check_refs(spec, world, tool, args)
        value = next(args[p.name] for p in tool.params if p.name != key)
        _record(spec, tool, world, args[str(key)])[_field(tool.writes[0])] = value
        return "ok"

    def phrase(self, spec: SynthSpec, tool: ToolDoc, words: Mapping[str, str]) -> str:
        key = str(_key_param(spec, tool))
        value = next(words[p.name] for p in tool.params if p.name != key)
        return f"set the {_field(tool.writes[0])} of {words[key]} to {value}"


class Add:
    writes = True
    needs = "add: writes [T.f] (an int) with effect: add, the record's key and an int amount"

    def problem(self, spec: SynthSpec, tool: ToolDoc) -> str | None:
        return _write_field_problem(spec, tool, "add")

    def result_type(self, spec: SynthSpec, tool: ToolDoc) -> str | None:
        return None

    def call(self, spec: SynthSpec, tool: ToolDoc, world: World, args: Mapping[str, Any]) -> str:
        key = str(_key_param(spec, tool))
        amount = next(args[p.name] for p in tool.params if p.name != key)
        record = _record(spec, tool, world, args[key])
        record[_field(tool.writes[0])] += int(amount)
        return str(record[_field(tool.writes[0])])

    def phrase(self, spec: SynthSpec, tool: ToolDoc, words: Mapping[str, str]) -> str:
        key = str(_key_param(spec, tool))
        amount = next(words[p.name] for p in tool.params if p.name != key)
        return f"add {amount} to the {_field(tool.writes[0])} of {words[key]}"


class Create:
    writes = True
    needs = (
        "create: writes [T], parameters among T's fields (every field that names a record), "
        "returns T's key type"
    )

    def problem(self, spec: SynthSpec, tool: ToolDoc) -> str | None:
        table = spec.tables[tool.table]
        if len(tool.writes) != 1 or _field(tool.writes[0]):
            return "writes a whole table"
        if tool.returns != table.key_type:
            return f"returns the new record's {table.key_type!r}"
        if not tool.params or any(table.fields.get(p.name) != p.semantic for p in tool.params):
            return f"takes some of the fields of {table.name} ({', '.join(table.fields)}) by name"
        owner = spec.key_types()
        refs = [f for f, typ in table.fields.items() if typ in owner]
        if not set(refs) <= {p.name for p in tool.params}:  # a default would name no record
            return f"takes every field that names a record ({', '.join(refs)})"
        return None

    def result_type(self, spec: SynthSpec, tool: ToolDoc) -> str | None:
        return spec.tables[tool.table].key_type

    def call(self, spec: SynthSpec, tool: ToolDoc, world: World, args: Mapping[str, Any]) -> str:
        table = spec.tables[tool.table]
        _check_refs(spec, world, tool, args)
        record = {f: args.get(f, default_value(spec, typ)) for f, typ in table.fields.items()}
        key = new_key(world, table)
        world[table.name][key] = record
        return key

    def phrase(self, spec: SynthSpec, tool: ToolDoc, words: Mapping[str, str]) -> str:
        table = spec.tables[tool.table]
        parts = [f"{p.name} {words[p.name]}" for p in tool.params]
        return f"create a {table.singular} with " + " and ".join(parts)


def default_value(spec: SynthSpec, semantic: str) -> Any:
    """The value a create gives a field it does not take: the pool's first (or least) value."""
    pool = spec.pool(semantic)
    return pool["min"] if isinstance(pool, Mapping) else list(pool)[0]


class Delete:
    writes = True
    needs = "delete: writes [T], only the record's key, returns nothing"

    def problem(self, spec: SynthSpec, tool: ToolDoc) -> str | None:
        if len(tool.writes) != 1 or _field(tool.writes[0]) or tool.returns is not None:
            return "writes a whole table and returns nothing"
        if _key_param(spec, tool) is None or len(tool.params) != 1:
            return "takes only the record's key"
        return None

    def result_type(self, spec: SynthSpec, tool: ToolDoc) -> str | None:
        return None

    def call(self, spec: SynthSpec, tool: ToolDoc, world: World, args: Mapping[str, Any]) -> str:
        key = str(args[tool.params[0].name])
        _record(spec, tool, world, key)
        named_by = referrers(spec, world, tool.table, key)
        if named_by:  # deleted, it would leave them naming a record that is gone
            table = spec.tables[tool.table]
            raise ToolError(
                f"cannot delete {table.singular} {key}: {', '.join(named_by[:3])} still refer to it"
            )
        del world[tool.table][key]
        return "ok"

    def phrase(self, spec: SynthSpec, tool: ToolDoc, words: Mapping[str, str]) -> str:
        return f"delete {words[tool.params[0].name]}"


def code_problem(code: str) -> str | None:
    """What is wrong with a written tool's code that reading it shows (it is never run here:
    `sandboxed.py` runs it, in the sandbox), or None."""
    try:
        tree = ast.parse(code, "<written tool>")
    except (SyntaxError, ValueError) as exc:  # what an LLM may write
        return f"its code does not run: {type(exc).__name__}: {exc}"
    if not any(isinstance(n, ast.FunctionDef) and n.name == "call" for n in tree.body):
        return "its code defines no function call(world, args)"
    return None


class Written:
    """A tool no template expresses, implemented by code in the spec (`code:`, by hand or by the
    LLM writer, `writer.py`): `call(world, args)` changes `world[table][key]` records and returns
    a short text (the new key, when the tool `returns` a key type). The code runs only in the
    bubblewrap sandbox (`sandboxed.py`), on a copy of the world: only its own table comes back, so
    a call that fails half way changes nothing. `check_tool` holds it to the contract every
    template keeps (it changes only its table, is deterministic, a missing id is a `ToolError`)
    before any task is made."""

    writes = True
    needs = (
        "written: writes [T] or [T.f], code: with call(world, args) (or steprl synth --writer-url), a phrase"
    )

    def problem(self, spec: SynthSpec, tool: ToolDoc) -> str | None:
        if not tool.writes:
            return "writes something (reading tools are find and get)"
        if not tool.code:
            return "has no code: give code: (def call(world, args): ...) or run steprl synth --writer-url"
        if not tool.phrase:
            return "needs a phrase: (how a request words a call, e.g. 'move {qty} from {a} to {b}')"
        return code_problem(tool.code)

    def result_type(self, spec: SynthSpec, tool: ToolDoc) -> str | None:
        return tool.returns

    def call(self, spec: SynthSpec, tool: ToolDoc, world: World, args: Mapping[str, Any]) -> str:
        _check_refs(spec, world, tool, args)
        out, table = runner_for(tool).call(tool, world, args)
        world[tool.table] = table
        return out

    def phrase(self, spec: SynthSpec, tool: ToolDoc, words: Mapping[str, str]) -> str:
        return fill_phrase(tool, words)


#: name -> template; inference tries them in this order.
TEMPLATES: dict[str, Template] = {
    "find": Find(),
    "get": Get(),
    "set": Set(),
    "add": Add(),
    "create": Create(),
    "delete": Delete(),
    "written": Written(),
}


def infer_template(spec: SynthSpec, tool: ToolDoc, where: str) -> ToolDoc:
    """`tool` with its template: the one it names (checked) or the first that fits."""
    for p in tool.params:
        if p.json_type != spec.json_type(p.semantic):
            raise SynthSpecError(
                f"{where}.parameters.properties.{p.name}: type {p.json_type!r} does not hold values of "
                f"type {p.semantic!r}; use {spec.json_type(p.semantic)!r}"
            )
    if tool.phrase:  # a phrase that does not format is one line now, not mid-synthesis
        phrase_fields(tool)
    if tool.template:
        template = TEMPLATES.get(tool.template)
        if template is None:
            raise SynthSpecError(f"{where}.template: {tool.template!r} is not one of {', '.join(TEMPLATES)}")
        problem = template.problem(spec, tool)
        if problem is not None:
            raise SynthSpecError(f"{where}: a {tool.template} tool {problem}")
        return tool
    for name, template in TEMPLATES.items():
        if template.problem(spec, tool) is None:
            return dataclasses.replace(tool, template=name)
    raise SynthSpecError(
        f"{where}: no template implements it (reads {list(tool.reads)}, writes {list(tool.writes)}, "
        f"returns {tool.returns}); one of: " + "; ".join(t.needs for t in TEMPLATES.values())
    )


def phrase_fields(tool: ToolDoc) -> list[tuple[str, str | None]]:
    """The tool's `phrase` as (text, parameter or None) pieces: only plain ``{name}`` fields of
    its parameters. `str.format` would also run ``{sku.__class__.__mro__}`` (attribute and index
    access), a conversion or a nested field in a format spec: each is one line here."""
    names = [p.name for p in tool.params]
    pieces: list[tuple[str, str | None]] = []
    try:
        parsed = list(string.Formatter().parse(tool.phrase))
    except ValueError as exc:  # an unmatched brace
        raise _phrase_error(tool, names, str(exc)) from None
    for text, field, spec, conversion in parsed:
        pieces.append((text, None))
        if field is None:
            continue
        if field not in names or spec or conversion:
            shown = field + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            raise _phrase_error(tool, names, f"{{{shown}}} is not one of them")
        pieces.append(("", field))
    return pieces


def _phrase_error(tool: ToolDoc, names: list[str], what: str) -> SynthSpecError:
    return SynthSpecError(
        f"tool {tool.name}: phrase {tool.phrase!r} may hold only its parameters as plain fields "
        f"({', '.join('{' + n + '}' for n in names)}): {what}"
    )


def fill_phrase(tool: ToolDoc, words: Mapping[str, str]) -> str:
    return "".join(text if field is None else str(words[field]) for text, field in phrase_fields(tool))


def phrase(spec: SynthSpec, tool: ToolDoc, words: Mapping[str, str]) -> str:
    """A call in words: the tool's own `phrase` with {param} filled, else the template's."""
    if tool.phrase:
        return fill_phrase(tool, words)
    return TEMPLATES[tool.template].phrase(spec, tool, words)


def check_opt_in(carried: list[str], source: str, allow_written_code: bool) -> None:
    """Tools `carried` code: one line unless their code is allowed to run (in the sandbox)."""
    if carried and not allow_written_code:
        raise SynthSpecError(
            f"{source}: tools {carried} carry code: (template written), which runs in the bubblewrap "
            "sandbox only if you allow it: read it, then pass --allow-written-code (steprl synth) or "
            "env.params.allow_written_code: true (env synth)"
        )


def parse_spec(raw: Any, source: str = "<spec>", allow_written_code: bool = False) -> SynthSpec:
    """A `SynthSpec` from a YAML document's data, every tool's template inferred or checked.
    Tools that carry `code:` need `allow_written_code` (the code runs, in the sandbox, on every
    call: whoever loads the spec says they read it)."""
    spec = read_spec(raw, source)
    check_opt_in([t.name for t in spec.tools if t.code], source, allow_written_code)
    tools = tuple(infer_template(spec, t, f"tools[{i}] ({t.name})") for i, t in enumerate(spec.tools))
    return dataclasses.replace(spec, tools=tools)


def load_raw(path: str | Path) -> Any:
    """The spec file's data; a spec with `mcp:` gets its tools from the server (`mcp_tools.py`)."""
    raw = read_yaml(path)
    if isinstance(raw, Mapping) and "mcp" in raw:
        from steprl.envs.synth.mcp_tools import merge_mcp_tools, server_tools

        if not isinstance(raw["mcp"], Mapping):
            raise SynthSpecError(
                f"mcp: must be a mapping with command (and args, ignore), got {raw['mcp']!r}"
            )
        return merge_mcp_tools(raw, server_tools(raw["mcp"]))
    return raw


def load_spec(path: str | Path, allow_written_code: bool = False) -> SynthSpec:
    return parse_spec(load_raw(path), str(path), allow_written_code)
