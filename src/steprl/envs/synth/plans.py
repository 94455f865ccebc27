"""From tools to tasks: the dependency graph, random walks over it, walks merged with reasoning
nodes into DAG templates, and concrete tasks with a reference plan and a golden final state.

* **Graph**: an edge A -> B (labelled with B's parameter) where A's result is of the type B's
  parameter takes, for the types that name records (a table's key type): entities flow from a
  tool that finds or creates them into the tools that act on them.
* **Walk**: from a writing tool back along the edges until every parameter that names a record
  has a producer (a `find`, or a `create` that may need producers of its own); the walk read
  forwards is the tool sequence.
* **Merge**: a task joins 1..`max_writes` walks; walks that act on a record of the same type
  share its producer half of the time (two writes on one record). A write may be wrapped in a
  reasoning node: `branch` (read an int field of the record, then one write if it is below a
  threshold and another if not: only reading tells which) or `offset` (set an int field to its
  current value plus a delta: read, compute, write).
* **Task**: the template on a world (`world.make_world`): request values drawn (a find's value
  from an existing record, a write's value from its type's pool), the template run on a copy of
  the world to get the reference plan (the concrete calls, the branch taken) and the golden
  diff, and the request rendered in words. A task whose plan changes nothing, or whose writes
  include a no-op, is redrawn.

A template's `shape` names its structure without values (tools, edges, reasoning nodes): the
unit that train and held-out splits keep apart.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from steprl.envs.synth.spec import SynthSpec, ToolDoc
from steprl.envs.synth.templates import TEMPLATES, phrase
from steprl.envs.synth.world import Diff, World, dangling, diff, draw, lookup_fields, make_world

#: ("in", semantic) a value the request states | ("out", i) node i's result |
#: ("plus", i, semantic) node i's (int) result plus a value the request states
Ref = tuple[Any, ...]


@dataclass(frozen=True)
class Call:
    tool: str
    args: tuple[tuple[str, Ref], ...]


@dataclass(frozen=True)
class Branch:
    read: int  # the node whose (int) result decides
    then: Call
    orelse: Call


Node = Call | Branch


@dataclass(frozen=True)
class Template:
    nodes: tuple[Node, ...]

    @property
    def shape(self) -> str:
        def one(n: Node) -> str:
            if isinstance(n, Branch):
                return f"if({n.read}?{one(n.then)}:{one(n.orelse)})"
            args = ",".join(f"{r[0]}{r[1] if r[0] != 'in' else ''}" for _, r in n.args)
            return f"{n.tool}({args})"

        return ">".join(one(n) for n in self.nodes)


def graph(spec: SynthSpec) -> dict[str, list[tuple[str, str]]]:
    """Tool -> [(producer tool, parameter)]: the edges into each tool's record-typed parameters."""
    owner = spec.key_types()
    results = {t.name: TEMPLATES[t.template].result_type(spec, t) for t in spec.tools}
    return {
        b.name: [
            (a, p.name)
            for p in b.params
            if p.semantic in owner
            for a, r in results.items()
            if r == p.semantic and a != b.name
        ]
        for b in spec.tools
    }


def _writes(spec: SynthSpec) -> list[ToolDoc]:
    return [t for t in spec.tools if TEMPLATES[t.template].writes]


class _Builder:
    """One template under construction: nodes in order, and the producers it can share."""

    def __init__(self, spec: SynthSpec, rng: random.Random) -> None:
        self.spec, self.rng, self.edges = spec, rng, graph(spec)
        self.nodes: list[Node] = []
        self.produced: dict[str, list[int]] = {}  # record type -> nodes that produce one

    def producer(self, semantic: str, depth: int) -> int | None:
        have = self.produced.get(semantic, [])
        if have and self.rng.random() < 0.5:
            return self.rng.choice(have)
        makers = [self.spec.tool(a) for a in {a for es in self.edges.values() for a, _ in es}]
        makers = [t for t in makers if TEMPLATES[t.template].result_type(self.spec, t) == semantic]
        finds = [t for t in makers if t.template == "find"]
        pick = finds if finds and (depth > 1 or self.rng.random() < 0.8) else makers
        if not pick:
            return None
        i = self.walk(self.rng.choice(sorted(pick, key=lambda t: t.name)), depth + 1)
        if i is not None:
            self.produced.setdefault(semantic, []).append(i)
        return i

    def call(self, tool: ToolDoc, depth: int) -> Call | None:
        owner = self.spec.key_types()
        args: list[tuple[str, Ref]] = []
        for p in tool.params:
            if p.semantic in owner:
                src = self.producer(p.semantic, depth)
                if src is None:
                    return None
                args.append((p.name, ("out", src)))
            else:
                args.append((p.name, ("in", p.semantic)))
        return Call(tool.name, tuple(args))

    def walk(self, tool: ToolDoc, depth: int = 0) -> int | None:
        """Adds `tool` after producers for its record-typed parameters; its node index."""
        if depth > 3:
            return None
        c = self.call(tool, depth)
        if c is None:
            return None
        self.nodes.append(c)
        return len(self.nodes) - 1

    def reasoned(self, write: ToolDoc) -> None:
        """`write` as a plain call, an offset or inside a branch, with a read of its record."""
        c = self.call(write, 0)
        if c is None:
            return
        key = next((r for _, r in c.args if r[0] == "out"), None)
        table = self.spec.tables[write.table]
        reads = [
            t
            for t in self.spec.tools
            if t.template == "get"
            and t.table == write.table
            and table.type_of(t.reads[0].split(".")[1]) == "int"
        ]
        roll = self.rng.random()
        if key is not None and reads and roll < 0.5:
            others = [t for t in _writes(self.spec) if t.table == write.table and t.name != write.name]
            same = [t for t in reads if t.reads[0] == (write.writes[0] if "." in write.writes[0] else "")]
            if write.template == "set" and same and roll < 0.2:  # offset: value = read + delta
                self.nodes.append(Call(same[0].name, ((same[0].params[0].name, key),)))
                r = len(self.nodes) - 1
                value = next(p for p in write.params if p.semantic != table.key_type)
                args = tuple((n, ("plus", r, "int") if n == value.name else ref) for n, ref in c.args)
                self.nodes.append(Call(write.name, args))
                return
            alt = [o for o in others if self._on(o, key) is not None]
            if alt:
                read = self.rng.choice(reads)
                self.nodes.append(Call(read.name, ((read.params[0].name, key),)))
                r = len(self.nodes) - 1
                other = self._on(self.rng.choice(alt), key)
                assert other is not None
                self.nodes.append(Branch(r, c, other))
                return
        self.nodes.append(c)

    def _on(self, tool: ToolDoc, key: Ref) -> Call | None:
        """`tool` acting on the record `key` refers to, its other parameters stated."""
        table, owner = self.spec.tables[tool.table], self.spec.key_types()
        args = [(p.name, key if p.semantic == table.key_type else ("in", p.semantic)) for p in tool.params]
        others = [p for p in tool.params if p.semantic in owner and p.semantic != table.key_type]
        if tool.template == "create" or others or not any(r == key for _, r in args):
            return None  # (a record it names besides `key` would have to be stated by its id)
        return Call(tool.name, tuple(args))


def random_template(spec: SynthSpec, rng: random.Random) -> Template | None:
    b = _Builder(spec, rng)
    writes = sorted(_writes(spec), key=lambda t: t.name)
    if not writes:
        return None
    for _ in range(rng.randint(1, spec.tasks.max_writes)):
        b.reasoned(rng.choice(writes))
    if not any(isinstance(n, Branch) or TEMPLATES[spec.tool(n.tool).template].writes for n in b.nodes):
        return None
    return Template(tuple(b.nodes))


@dataclass(frozen=True)
class Concrete:
    prompt: str
    plan: tuple[tuple[str, dict[str, Any]], ...]  # the reference calls, in order
    golden: Diff
    shape: str
    intent: dict[str, Any]  # what the request leaves for the user to say: parameter -> value


ASK = "ask_user"  # the tool a synthesized env adds when some requests leave a value open


def instantiate(
    spec: SynthSpec, t: Template, world_seed: int, rng: random.Random, ask: bool = False
) -> Concrete | None:
    """The template on the world of `world_seed`: None if it cannot change the state as worded.
    `ask`: the first value a write states is left out of the request (the user's intent: the
    reference plan asks for it first)."""
    world = make_world(spec, world_seed)
    state: World = copy.deepcopy(world)
    results: dict[int, Any] = {}
    words: dict[int, str] = {}  # node -> how the request refers to its result
    plan: list[tuple[str, dict[str, Any]]] = []
    phrases: list[str] = []
    intent: dict[str, Any] = {}

    def bind(c: Call, may_ask: bool = True) -> tuple[dict[str, Any], dict[str, str]] | None:
        tool = spec.tool(c.tool)
        args, said = {}, {}
        for name, ref in c.args:
            if ref[0] == "out":
                args[name], said[name] = results[ref[1]], words[ref[1]]
            elif ref[0] == "plus":
                delta = rng.randint(1, 9)
                args[name], said[name] = int(results[ref[1]]) + delta, f"its current value plus {delta}"
            elif tool.template == "find":
                record = rng.choice(sorted(state[tool.table].values(), key=repr))
                args[name] = record[tool.reads[0].split(".")[1]]
                said[name] = str(args[name])
            else:
                args[name] = _fresh(spec, tool, name, ref[1], rng, state)
                said[name] = str(args[name])
                if ask and may_ask and not intent and TEMPLATES[tool.template].writes:
                    intent[name] = args[name]
                    said[name] = f"the {name} I have in mind (ask me)"
        return args, said

    def run(c: Call, i: int, speak: bool = True, may_ask: bool = True) -> bool:
        tool = spec.tool(c.tool)
        bound = bind(c, may_ask)
        if bound is None:
            return False
        args, said = bound
        before = copy.deepcopy(state)
        try:
            out = TEMPLATES[tool.template].call(spec, tool, state, args)
        except Exception:  # a drawn value the state refuses: redraw the task
            return False
        if TEMPLATES[tool.template].writes and state == before:
            return False  # a no-op write: skipping it would score the same
        results[i] = out
        table = spec.tables[tool.table]
        if tool.template == "find":
            f = tool.reads[0].split(".")[1]
            words[i] = f"the {table.singular} with {f} {said[tool.params[0].name]}"
        elif tool.template == "create":
            words[i] = f"the new {table.singular}"
        plan.append((tool.name, args))
        if speak and (text := phrase(spec, tool, said)):
            phrases.append(text)
        return True

    for i, node in enumerate(t.nodes):
        if isinstance(node, Call):
            nxt = t.nodes[i + 1] if i + 1 < len(t.nodes) else None
            read_for_branch = isinstance(nxt, Branch) and nxt.read == i
            if not run(node, i, speak=not read_for_branch and spec.tool(node.tool).template != "get"):
                return None
            continue
        value = int(results[node.read])
        read_node = t.nodes[node.read]
        assert isinstance(read_node, Call)  # a branch reads the result of a call before it
        read, read_args = spec.tool(read_node.tool), dict(read_node.args)
        key_node = t.nodes[read_args[read.params[0].name][1]]
        if isinstance(key_node, Call) and spec.tool(key_node.tool).template == "create":
            return None  # a record the task made holds known defaults: the read would be skippable
        # either side of the value, and inside the field's range: only reading tells which side
        pool = spec.pool(spec.tables[read.table].type_of(read.reads[0].split(".")[1]) or "int")
        low, high = (pool["min"], pool["max"]) if isinstance(pool, Mapping) else (-(10**9), 10**9)
        sides = [d for d in (-3, -2, -1, 1, 2, 3) if low < value + d <= high]
        if not sides:
            return None
        threshold = value + rng.choice(sides)
        subject = phrase(spec, read, {read.params[0].name: words[read_args[read.params[0].name][1]]})
        mark = len(phrases)
        taken = node.then if value < threshold else node.orelse
        other = node.orelse if taken is node.then else node.then
        if not run(taken, i, may_ask=False):  # an asked value in one side would show which runs
            return None
        taken_text = phrases.pop(mark)
        probe = copy.deepcopy(state)  # the other branch must also be a real change (on a copy)
        other_text = _dry_phrase(spec, other, results, words, rng, probe)
        if other_text is None:
            return None
        then_text, else_text = (taken_text, other_text) if taken is node.then else (other_text, taken_text)
        phrases.append(f"if {subject} is below {threshold}, {then_text}; otherwise {else_text}")
    golden = diff(world, state)
    if not golden or not phrases or (ask and not intent) or dangling(spec, state):
        return None
    prompt = "; then ".join(phrases)
    if intent:
        plan.insert(0, (ASK, {"question": f"What {' and '.join(intent)} do you want?"}))
    shape = f"ask>{t.shape}" if intent else t.shape
    return Concrete(prompt[0].upper() + prompt[1:] + ".", tuple(plan), golden, shape, intent)


def _fresh(spec: SynthSpec, tool: ToolDoc, name: str, semantic: str, rng: random.Random, state: World) -> Any:
    """A stated value; a new record's field that tools find records by gets one no record has."""
    if tool.template == "create" and (tool.table, name) in lookup_fields(spec):
        taken = {r.get(name) for r in state[tool.table].values()}
        pool = spec.pool(semantic)
        values = range(pool["min"], pool["max"] + 1) if isinstance(pool, Mapping) else pool
        free = [v for v in values if v not in taken]
        return rng.choice(free) if free else draw(spec, semantic, rng, state)
    return draw(spec, semantic, rng, state)


def _dry_phrase(
    spec: SynthSpec,
    c: Call,
    results: Mapping[int, Any],
    words: Mapping[int, str],
    rng: random.Random,
    state: World,
) -> str | None:
    """The words of a call the plan does not take (the untaken branch), checked to be a change."""
    tool = spec.tool(c.tool)
    args, said = {}, {}
    for name, ref in c.args:
        if ref[0] == "out":
            args[name], said[name] = results[ref[1]], words[ref[1]]
        else:
            args[name] = draw(spec, ref[1], rng, state)
            said[name] = str(args[name])
    before = copy.deepcopy(state)
    try:
        TEMPLATES[tool.template].call(spec, tool, state, args)
    except Exception:
        return None
    return phrase(spec, tool, said) if state != before else None
