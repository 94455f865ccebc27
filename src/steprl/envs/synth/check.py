"""`check_tool`: holds a tool's template to its contract on generated worlds (the tests run it
over every tool of every shipped spec, which covers every entry of `TEMPLATES`)."""

from __future__ import annotations

import copy
import random

from steprl.envs.base import ToolError
from steprl.envs.synth.spec import SynthSpec, ToolDoc
from steprl.envs.synth.templates import TEMPLATES
from steprl.envs.synth.world import draw, make_world


def check_tool(spec: SynthSpec, tool: ToolDoc, worlds: int = 5) -> None:
    """Raises AssertionError naming the tool and what broke:

    * a reading template never changes the state, a writing one changes it (for some value),
      and only the table it declares;
    * a result of a record-typed kind names a record that exists after the call;
    * a call is a pure function of the state and the arguments (same state, same args: same
      result and same new state);
    * a record id that does not exist is a `ToolError` (the model's mistake), never a crash.
    """
    template = TEMPLATES[tool.template]
    owner = spec.key_types()
    changed_any = False
    for seed in range(worlds):
        rng = random.Random(seed)
        world = make_world(spec, seed)
        args = {}
        for p in tool.params:
            if tool.template == "find":
                record = rng.choice(sorted(world[tool.table].values(), key=repr))
                args[p.name] = record[tool.reads[0].split(".")[1]]
            else:
                args[p.name] = draw(spec, p.semantic, rng, world)
        before = copy.deepcopy(world)
        twin = copy.deepcopy(world)
        out = template.call(spec, tool, world, args)
        assert isinstance(out, str), f"{tool.name}: returned {type(out).__name__}, not str"
        assert template.call(spec, tool, twin, args) == out and twin == world, (
            f"{tool.name}: not deterministic"
        )
        others = {t: r for t, r in world.items() if t != tool.table}
        assert others == {t: r for t, r in before.items() if t != tool.table}, (
            f"{tool.name}: wrote another table"
        )
        if not template.writes:
            assert world == before, f"{tool.name}: a {tool.template} tool changed the state"
        fields = {w.partition(".")[2] for w in tool.writes}
        if "" not in fields:  # it declares fields: records stay, and only those fields change
            old, new = before[tool.table], world[tool.table]
            assert old.keys() == new.keys() and all(
                {f for f in old[k] if old[k][f] != new[k].get(f)} <= fields for k in old
            ), f"{tool.name}: changed more than it writes ({', '.join(tool.writes)})"
        changed_any |= world != before
        result = template.result_type(spec, tool)
        if result in owner:
            assert out in world[owner[result]], f"{tool.name}: returned {out!r}, no {result} record"
        keyed = [p for p in tool.params if p.semantic in owner]
        if keyed:
            try:
                template.call(spec, tool, copy.deepcopy(before), {**args, keyed[0].name: "Z000"})
            except ToolError:
                pass
            else:
                raise AssertionError(f"{tool.name}: a record id that does not exist was not a ToolError")
    assert changed_any or not template.writes, f"{tool.name}: a {tool.template} tool never changed the state"
