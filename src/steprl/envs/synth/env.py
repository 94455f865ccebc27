"""A synthesized env: the spec's tools over a world rebuilt from the task's seed, rewarded by
comparing the final state with the task's golden one.

The policy calls tools (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; a tool with
one string parameter also as `<name>value</name>`) and ends with `<answer>...</answer>`. The
outcome is 1 when the episode's changes to the state are exactly the golden ones: every
change the request asked for and no collateral change (AppWorld's rule); with
`tasks.partial_credit` it is the Jaccard overlap of changed cells instead (a collateral change
costs as much as a missed one). The answer's text is not read.

Strategies: `expert` plays the task's reference plan; `random` sends junk, broken calls and
random calls over the world's own values; `do_nothing` answers at once. The hack probes of
`validate.py` are policies too (`PROBES`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from steprl.envs.base import Tool, Transition
from steprl.envs.parsing import ToolCall
from steprl.envs.policy import Policy
from steprl.envs.rewards import step_rewards
from steprl.envs.spec import EnvSpec
from steprl.envs.synth.plans import ASK
from steprl.envs.synth.spec import SynthSpec, ToolDoc
from steprl.envs.synth.templates import TEMPLATES
from steprl.envs.synth.users import SimUser, scripted_reply, states_intent, user_from_params
from steprl.envs.synth.world import World, decode_diff, diff, diff_cells, make_world
from steprl.envs.tool_env import FunctionTool, ToolEnv, render_system_prompt
from steprl.types import Task

#: seed -> new train tasks forever (`package.fresh_tasks`)
Fresh = Callable[[int], Iterator[Task]]


def _named(t: Task, env: str) -> Task:
    return Task(t.id, t.prompt, env, t.seed, t.answer, t.params)


class Episode:
    """One episode's state: the world as it started and as the tools have changed it, and the
    simulated user (who errs, if `tasks.user_error_rate`, from the episode's seed)."""

    def __init__(self, spec: SynthSpec, task: Task, seed: int, honest: bool = False) -> None:
        self.start = make_world(spec, int(task.params["world_seed"]))
        self.world: World = copy.deepcopy(self.start)
        self.intent: dict[str, Any] = dict(task.params.get("intent") or {})
        rng = random.Random(f"user:{task.id}:{seed}")
        self.user_errs = not honest and rng.random() < spec.tasks.user_error_rate
        self.user_rng = rng


def score(spec: SynthSpec, episode: Episode, task: Task) -> float:
    made, golden = diff(episode.start, episode.world), decode_diff(task.params["golden"])
    if not spec.tasks.partial_credit:
        return 1.0 if made == golden else 0.0
    want, got = diff_cells(golden, episode.start), diff_cells(made, episode.start)
    return len(want & got) / max(1, len(want | got))


def _tool(spec: SynthSpec, doc: ToolDoc, episode: Callable[[], Episode]) -> Tool:
    template = TEMPLATES[doc.template]

    # the episode comes from `episode()`, not from a parameter named `state` (`ToolEnv`'s way):
    # a tool's own parameter may be called state
    def run(**args: Any) -> str:
        return template.call(spec, doc, episode().world, args)

    return FunctionTool(doc.name, doc.description, dict(doc.schema), run)


def instructions(spec: SynthSpec) -> str:
    return (
        f"{spec.description.strip()} Do what the request asks using the tools, changing nothing "
        "else, then answer done.".strip()
    )


_HINT = 'call <tool_call>{"name": ..., "arguments": {...}}</tool_call> or end: <answer>done</answer>'


ASK_SCHEMA = {"type": "object", "properties": {"question": {"type": "string"}}, "required": ["question"]}


class SynthEnv(ToolEnv):
    """`ToolEnv` whose `ask_user` calls the simulated user answers, as the user (`info["role"]`),
    from the task's hidden intent; a wrong answer is marked `info["user_error"]` (ERPO masks it)."""

    spec: SynthSpec

    user: SimUser | None = None  # None: the scripted user

    def episode_state(self) -> Episode:
        """The running episode (what `ToolEnv` passes as ``state=`` to a tool that asks for it)."""
        return self._state

    def _call(self, call: ToolCall) -> Transition:
        if call.name != ASK:
            return super()._call(call)
        episode: Episode = self._state
        intent = dict(episode.intent)
        if episode.user_errs:  # the user misremembers: any other value of the same kind
            for name, value in intent.items():
                doc = next(t for t in self.spec.tools for p in t.params if p.name == name)
                wrong = [v for v in _values(self.spec, doc.param(name).semantic) if v != value]
                intent[name] = episode.user_rng.choice(wrong) if wrong else value
        if self.user is None:
            reply = scripted_reply(intent)
        else:
            task = self._task
            reply = self.user.reply(
                task.prompt if task else "", str(call.arguments.get("question", "")), intent
            )
        # a user error: told a wrong value on purpose, or a reply that does not state the intent
        erred = bool(episode.intent) and (
            intent != episode.intent or not states_intent(reply, episode.intent)
        )
        t = self._transition(
            reply, step_rewards("tool_call", self.rewards), kind="tool_call", tool=ASK, valid=True
        )
        return dataclasses.replace(t, info={**t.info, "role": "user", "user_error": erred})


def _values(spec: SynthSpec, semantic: str) -> list[Any]:
    pool = spec.pool(semantic)
    return list(range(int(pool["min"]), int(pool["max"]) + 1)) if isinstance(pool, Mapping) else list(pool)


def make_env(spec: SynthSpec, honest_user: bool = False, user: SimUser | None = None) -> ToolEnv:
    """The env; `honest_user`: the simulated user never errs (validation); `user`: who answers
    `ask_user` (None: the scripted user)."""
    env: SynthEnv | None = None

    def episode() -> Episode:
        assert env is not None
        return env.episode_state()

    tools = [_tool(spec, t, episode) for t in spec.tools]
    if spec.tasks.ask_user > 0:
        tools.append(
            FunctionTool(ASK, "Ask the user about what the request leaves open.", ASK_SCHEMA, lambda **_: "")
        )
    env = SynthEnv(
        tools,
        lambda answer, task, state: score(spec, state, task),
        episode=lambda task, seed: Episode(spec, task, seed, honest_user),
        format_hint=_HINT,
    )
    env.spec, env.user = spec, user
    env.system_prompt = render_system_prompt(
        tools,
        env.syntax,
        instructions=instructions(spec),
        schemas=True,  # every tool, with its schema
    )
    return env


def render_call(name: str, args: Mapping[str, Any]) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': dict(args)})}</tool_call>"


DONE = "<answer>done</answer>"


_SAID = re.compile(r"[Tt]he (\w+) is (.+?)(?=; the \w+ is |\.$)")


def _as_type(text: str, like: Any) -> Any:
    """The user's words as a value of the type the plan's value has (bool, int or str)."""
    if isinstance(like, bool):
        return text == "True"
    if isinstance(like, int):
        return int(text) if text.lstrip("-").isdigit() else text
    return text


def expert(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """The reference plan, with what the user said in place of the intent it asked for (a user
    who erred makes the expert fail too: the user's error, marked on that step)."""
    plan = task.params["plan"]
    if len(history) >= len(plan):
        return DONE
    name, args = plan[len(history)]
    intent = task.params.get("intent") or {}
    if intent and history and plan[0][0] == ASK:
        told = {k: v.strip() for k, v in _SAID.findall(history[0][1])}
        for k, v in args.items():
            if k in intent and k in told and v == intent[k]:
                args = {**args, k: _as_type(told[k], v)}
    return render_call(name, args)


def do_nothing(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    return DONE


def random_policy_for(spec: SynthSpec) -> Policy:
    """Junk, broken calls, unknown tools and random calls with the world's own values."""

    def policy(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
        world = make_world(spec, int(task.params["world_seed"]))
        values = [k for t in world.values() for k in t] + [
            v for t in world.values() for r in t.values() for v in r.values()
        ]

        def call() -> str:
            doc = rng.choice(spec.tools)
            return render_call(doc.name, {p.name: rng.choice(values) for p in doc.params})

        options = (
            call,
            call,
            call,
            lambda: "".join(rng.choice('ab<>{}" :') for _ in range(rng.randint(0, 20))),
            lambda: '<tool_call>{"name": "drop_all", "arguments": {}}</tool_call>',
            lambda: "<tool_call>{not json</tool_call>",
            lambda: DONE,
        )
        return rng.choice(options)()

    return policy


def task_stream(spec: SynthSpec, tasks: Sequence[Task], fresh: Fresh | None = None) -> Any:
    """`EnvSpec.tasks`: eval, the fixed held-out tasks in a seeded order, cycled; train, the fixed
    train tasks in a seeded order, then `fresh(seed)`'s new ones forever (or the fixed ones
    cycled, without `fresh`)."""

    def make_tasks(split: str, seed: int, max_calls: int = 0) -> Iterator[Task]:
        """`max_calls` > 0 keeps the tasks whose reference plan has at most that many calls (a
        small model's context)."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")

        def fits(t: Task) -> bool:
            return max_calls <= 0 or len(t.params["plan"]) <= max_calls

        pool = [t for t in tasks if t.params.get("split") == split and fits(t)]
        if not pool:
            raise ValueError(f"{spec.name}: no {split} tasks (max_calls {max_calls}); synthesize more tasks")
        rng = random.Random(f"{spec.name}:{split}:{seed}")
        order = list(pool)
        rng.shuffle(order)
        yield from order
        if split == "train" and fresh is not None:
            yield from (t for t in fresh(seed) if fits(t))
            return
        while True:
            rng.shuffle(order)
            yield from order

    return make_tasks


def env_spec(
    spec: SynthSpec, tasks: Sequence[Task], name: str | None = None, fresh: Fresh | None = None
) -> EnvSpec:
    longest = max((len(t.params["plan"]) for t in tasks), default=1)
    named = name or spec.name

    synth = spec

    def factory(path: str = "", spec: str = "", user: Any = None, **tasks_keys: Any) -> ToolEnv:
        # the synth family's env.params (path or spec, and `tasks:` keys) built the spec; `user`
        # picks who answers ask_user
        return make_env(synth, user=user_from_params(user))

    return EnvSpec(
        name=named,
        factory=factory,
        tasks=task_stream(
            spec,
            [_named(t, named) for t in tasks],
            fresh and (lambda seed: (_named(t, named) for t in fresh(seed))),
        ),
        strategies={"expert": expert, "random": random_policy_for(spec), "do_nothing": do_nothing},
        max_turns=max(spec.max_turns, longest + 1),
        # the simulated user's errors fail the expert too: check-env counts its share of wins
        stochastic=spec.tasks.user_error_rate > 0,
        min_expert_success=1.0 if spec.tasks.user_error_rate == 0 else 0.6 * (1 - spec.tasks.user_error_rate),
        expert_seeds=1 if spec.tasks.user_error_rate == 0 else 4,
        description=spec.description or f"synthesized from {spec.source}",
    )
