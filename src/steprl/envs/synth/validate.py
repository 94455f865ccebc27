"""Validation before admission: a task is admitted only if its reference plan reaches the golden
state and no shortcut does.

Per task, each of `PROBES` must fail (outcome < 1):

* `do_nothing`: answers at once (also: a policy that answers without acting);
* `read_only`: calls every reading tool the plan calls, then answers: reading alone changes nothing;
* `read_free`: the plan's writes with no read at all: every record it names is given as the
  request names it (a find's value in place of the id it finds);
* `without_asking` (tasks whose request leaves a value to ask the user for): the whole plan
  with that value guessed: a task the user's answer does not decide must fail;
* `write_everything`: each of the plan's writes applied to every record its first record-typed
  parameter could name (an order placed for every customer): the collateral changes must cost
  the outcome;
* `drop_a_write`: the plan without one of its writes, each in turn: a write a later one undoes
  (overwritten, deleted) was not needed.

Over all tasks, the `random` and `do_nothing` strategies must succeed on under 1% (`report`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from steprl.envs.synth.env import DONE, do_nothing, make_env, random_policy_for, render_call
from steprl.envs.synth.plans import ASK
from steprl.envs.synth.spec import SynthSpec
from steprl.envs.synth.templates import TEMPLATES, default_value
from steprl.envs.synth.world import make_world
from steprl.envs.tool_env import ToolEnv
from steprl.types import Task

#: a probe: (spec, task) -> the actions it sends, in order (then it answers)
Probe = Callable[[SynthSpec, Task], list[str]]
#: a probe with several tries: (spec, task) -> each try's actions (it wins if one reaches the golden state)
Probes = Callable[[SynthSpec, Task], list[list[str]]]


def play_actions(env: ToolEnv, task: Task, actions: Sequence[str], max_turns: int) -> float:
    """The outcome of sending `actions` (then answering) in a fresh episode."""
    env.reset(task, 0)
    for action in [*actions, DONE][:max_turns]:
        t = env.step(action)
        if t.terminated or t.truncated:
            return float(t.info.get("reward_components", {}).get("outcome", t.reward))
    return 0.0


def play_policy(env: ToolEnv, task: Task, policy: Any, seed: int, max_turns: int) -> float:
    env.reset(task, seed)
    rng, history = random.Random(seed), list[tuple[str, str]]()
    for _ in range(max_turns):
        action = policy(task, history, rng)
        t = env.step(action)
        if t.terminated or t.truncated:
            return float(t.info.get("reward_components", {}).get("outcome", t.reward))
        history.append((action, t.observation))
    return 0.0


def _plan(task: Task) -> list[tuple[str, dict[str, Any]]]:
    return [(str(n), dict(a)) for n, a in task.params["plan"]]


def _is_write(spec: SynthSpec, name: str) -> bool:
    return name != ASK and TEMPLATES[spec.tool(name).template].writes


def probe_read_only(spec: SynthSpec, task: Task) -> list[str]:
    return [render_call(n, a) for n, a in _plan(task) if not _is_write(spec, n)]


def probe_read_free(spec: SynthSpec, task: Task) -> list[str]:
    plan = [(n, a) for n, a in _plan(task) if n != ASK]  # nor asking: a value left open is guessed
    intent = dict(task.params.get("intent") or {})
    stated: dict[str, Any] = {}  # a found id -> the value the request named it by
    world = make_world(spec, int(task.params["world_seed"]))
    for n, a in plan:  # replayed: a find may look up what an earlier call created
        doc = spec.tool(n)
        result = TEMPLATES[doc.template].call(spec, doc, world, a)
        if doc.template == "find":
            stated[result] = next(iter(a.values()))
    out = []
    for n, a in plan:
        if not _is_write(spec, n):
            continue
        args = {k: stated.get(v, v) if isinstance(v, str) else v for k, v in a.items()}
        guessed = {  # the value the request left open, guessed (other calls' values stay)
            k: default_value(spec, spec.tool(n).param(k).semantic) for k in intent if args.get(k) == intent[k]
        }
        out.append(render_call(n, args | guessed))
    return out


def probe_without_asking(spec: SynthSpec, task: Task) -> list[str]:
    """The whole plan, reads included, but the value the request left open guessed (the type's
    first value) instead of asked: a task the user's answer does not decide is refused."""
    intent = dict(task.params.get("intent") or {})
    if not intent:
        return []  # nothing to ask: the probe is do-nothing
    out = []
    for n, a in _plan(task):
        if n == ASK:
            continue
        guess = {
            k: default_value(spec, spec.tool(n).param(k).semantic) for k in intent if a.get(k) == intent[k]
        }
        out.append(render_call(n, a | guess))
    return out


def probe_write_everything(spec: SynthSpec, task: Task) -> list[str]:
    world = make_world(spec, int(task.params["world_seed"]))
    out = []
    for n, a in _plan(task):
        if not _is_write(spec, n):
            continue
        doc = spec.tool(n)
        owner = spec.key_types()  # vary the first parameter that names a record (its own or another's)
        keyed = [p for p in doc.params if p.semantic in owner]
        if not keyed:
            out.append(render_call(n, a))
            continue
        for key in sorted(world[owner[keyed[0].semantic]]):
            out.append(render_call(n, {**a, keyed[0].name: key}))
    return out


def probe_drop_a_write(spec: SynthSpec, task: Task) -> list[list[str]]:
    """The plan without one of its writes, each in turn: a write a later one undoes (overwritten,
    deleted) is one the request did not need, and the task is refused."""
    plan = _plan(task)
    writes = [i for i, (n, _) in enumerate(plan) if _is_write(spec, n)]
    return [[render_call(n, a) for j, (n, a) in enumerate(plan) if j != i] for i in writes]


def _one(probe: Probe) -> Probes:
    return lambda spec, task: [probe(spec, task)]


PROBES: dict[str, Probes] = {
    "do_nothing": _one(lambda spec, task: []),
    "read_only": _one(probe_read_only),
    "read_free": _one(probe_read_free),
    "write_everything": _one(probe_write_everything),
    "without_asking": _one(probe_without_asking),
    "drop_a_write": probe_drop_a_write,
}


@dataclass(frozen=True)
class Verdict:
    reference: float  # the reference plan's outcome (must be 1)
    probes_won: tuple[str, ...]  # the probes that reached the golden state (must be none)

    @property
    def admitted(self) -> bool:
        return self.reference == 1.0 and not self.probes_won


def validate(spec: SynthSpec, env: ToolEnv, task: Task) -> Verdict:
    turns = 10_000  # probes are not policies under a turn cap: every action they send is played
    reference = play_actions(env, task, [render_call(n, a) for n, a in _plan(task)], turns)
    won = tuple(
        name
        for name, probe in PROBES.items()
        if any(play_actions(env, task, tries, turns) >= 1.0 for tries in probe(spec, task))
    )
    return Verdict(reference, won)


def baseline_rates(
    spec: SynthSpec, tasks: Sequence[Task], seeds: int = 4, tick: Callable[[str], None] | None = None
) -> dict[str, float]:
    """The share of episodes the random and do-nothing strategies solve (each task x `seeds`);
    `tick` hears how far it got, episode by episode (`package.Ticker`)."""
    env = make_env(spec, honest_user=True)
    policies = {"random": random_policy_for(spec), "do_nothing": do_nothing}
    out: dict[str, float] = {}
    total, done = len(policies) * len(tasks) * seeds, 0
    for name, policy in policies.items():
        wins = []
        for t in tasks:
            for s in range(seeds):
                wins.append(play_policy(env, t, policy, s, spec.max_turns) >= 1.0)
                done += 1
                if tick is not None:
                    tick(f"{spec.name}: the random and do-nothing baselines, {done} of {total} episodes")
        out[name] = sum(wins) / max(1, len(wins))
    return out
