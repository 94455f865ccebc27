"""`steprl synth SPEC.yaml -o DIR`: generate, validate and write an env package; load one back.

A package is a directory that is also a Python package:

* ``spec.yaml``: the tool documentation it was made from (a copy);
* ``tasks.jsonl``: the admitted tasks, one JSON object per line (id, prompt, split, shape,
  world seed, reference plan, golden diff);
* ``synth_report.json``: what generation measured (tasks made, validated, admitted, each probe's
  wins, the random and do-nothing success rates, the shapes held out, seconds taken);
* ``__init__.py``: ``SPEC = load_package(__file__)``, so ``env.name: DIR:SPEC`` loads it from
  the directory above it, and so does ``env: {name: synth, params: {path: DIR}}`` from anywhere.

Held-out shapes: `tasks.holdout_shapes` of the admitted tasks' DAG shapes (drawn with
`tasks.seed`) are eval-only; every other shape's tasks are train tasks. The eval split is
therefore shapes the policy never trained on.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from steprl.envs.spec import EnvSpec
from steprl.envs.synth.env import env_spec, make_env
from steprl.envs.synth.plans import instantiate, random_template
from steprl.envs.synth.spec import SynthSpec, SynthSpecError, read_yaml
from steprl.envs.synth.templates import load_raw, parse_spec
from steprl.envs.synth.validate import PROBES, baseline_rates, validate
from steprl.envs.synth.world import decode_diff, encode_diff
from steprl.envs.synth.writer import Writer, check_written, write_tools
from steprl.types import Task


@dataclass(frozen=True)
class SynthReport:
    spec: str
    generated: int  # distinct tasks instantiated
    validated: int  # reference plan reached the golden state
    admitted: int  # validated and no probe won
    probe_wins: dict[str, int]
    random_success: float
    do_nothing_success: float
    shapes_train: int
    shapes_eval: int
    train_tasks: int
    eval_tasks: int
    seconds: float

    @property
    def validated_share(self) -> float:
        return self.validated / max(1, self.generated)


def _task(spec: SynthSpec, i: int | str, world_seed: int, c: Any) -> Task:
    return Task(
        id=f"{spec.name}-{i}",
        prompt=c.prompt,
        env=spec.name,
        seed=world_seed,
        params={
            "world_seed": world_seed,
            "plan": [[n, a] for n, a in c.plan],
            "golden": encode_diff(c.golden),
            "shape": c.shape,
            "intent": dict(c.intent),
        },
    )


def _held_out(spec: SynthSpec, shapes: list[str], tasks: list[Task]) -> set[str]:
    """`tasks.holdout_shapes` of the shapes, drawn with `tasks.seed`; with
    `tasks.holdout_tools_seen`, only shapes whose every tool a train shape of no more calls
    still calls (taken in the seeded order, each kept only if every held shape stays covered)."""
    rng = random.Random(f"holdout:{spec.tasks.seed}")
    n = max(1, math.ceil(spec.tasks.holdout_shapes * len(shapes)))
    if not spec.tasks.holdout_tools_seen:
        return set(rng.sample(shapes, n))
    tools: dict[str, set[str]] = {}
    calls: dict[str, int] = {}
    for t in tasks:
        tools.setdefault(t.params["shape"], set()).update(name for name, _ in t.params["plan"])
        calls[t.params["shape"]] = len(t.params["plan"])

    def covered(shape: str, held: set[str]) -> bool:
        # by train shapes of no more calls: a run that trains on short plans only (a small
        # model's `max_calls`) has seen every tool of the short shapes it is tested on
        short = [s for s in shapes if s not in held and calls[s] <= calls[shape]]
        return tools[shape] <= set().union(*(tools[s] for s in short))

    held: set[str] = set()
    for shape in rng.sample(shapes, len(shapes)):
        if len(held) == n:
            break
        trial = held | {shape}
        if all(covered(s, trial) for s in trial):
            held = trial
    return held


def fresh_tasks(spec: SynthSpec, held: frozenset[str], seed: int) -> Iterator[Task]:
    """New admitted train tasks forever (new worlds, no held-out shape), a pure function of the
    spec and `seed`: what a synthesized env's train split serves after its fixed tasks, and
    what the `admission` task source draws from when it asks for more."""
    rng = random.Random(f"fresh:{spec.name}:{spec.tasks.seed}:{seed}")
    env = make_env(spec, honest_user=True)
    made = misses = 0
    while misses < 10_000:
        template = random_template(spec, rng)
        world_seed = rng.randrange(1_000_000)
        ask = rng.random() < spec.tasks.ask_user
        c = None if template is None else instantiate(spec, template, world_seed, rng, ask)
        if c is None or c.shape in held:
            misses += 1
            continue
        task = _task(spec, f"s{seed}-{made}", world_seed, c)
        made += 1
        if validate(spec, env, task).admitted:
            misses = 0
            yield Task(task.id, task.prompt, task.env, task.seed, None, {**task.params, "split": "train"})
    raise SynthSpecError(f"{spec.source}: 10000 attempts in a row made no new train task")


def synthesize(spec: SynthSpec) -> tuple[list[Task], SynthReport]:
    """`tasks.count` admitted tasks (fewer if the spec cannot give that many distinct ones)."""
    started = time.perf_counter()
    rng = random.Random(f"synth:{spec.name}:{spec.tasks.seed}")
    env = make_env(spec, honest_user=True)
    seen: set[str] = set()
    admitted: list[Task] = []
    generated = validated = 0
    wins: Counter[str] = Counter()
    for attempt in range(spec.tasks.count * 30):
        if len(admitted) >= spec.tasks.count:
            break
        template = random_template(spec, rng)
        if template is None:
            continue
        world_seed = rng.randrange(1_000_000)
        c = instantiate(spec, template, world_seed, rng, rng.random() < spec.tasks.ask_user)
        if c is None or c.prompt in seen:
            continue
        seen.add(c.prompt)
        generated += 1
        task = _task(spec, attempt, world_seed, c)
        verdict = validate(spec, env, task)
        validated += verdict.reference == 1.0
        wins.update(verdict.probes_won)
        if verdict.admitted:
            admitted.append(task)
    if not admitted:
        raise SynthSpecError(
            f"{spec.source}: no task could be made and validated; do the tools write anything?"
        )
    shapes = sorted({t.params["shape"] for t in admitted})
    held = _held_out(spec, shapes, admitted)
    if len(held) == len(shapes):
        raise SynthSpecError(
            f"{spec.source}: only {len(shapes)} task shape(s); add tools or raise tasks.max_writes"
        )
    tasks = [
        Task(
            t.id,
            t.prompt,
            t.env,
            t.seed,
            t.answer,
            {**t.params, "split": "eval" if t.params["shape"] in held else "train"},
        )
        for t in admitted
    ]
    rates = baseline_rates(spec, tasks)
    report = SynthReport(
        spec=spec.source,
        generated=generated,
        validated=validated,
        admitted=len(tasks),
        probe_wins={name: wins.get(name, 0) for name in PROBES},
        random_success=rates["random"],
        do_nothing_success=rates["do_nothing"],
        shapes_train=len(shapes) - len(held),
        shapes_eval=len(held),
        train_tasks=sum(t.params["split"] == "train" for t in tasks),
        eval_tasks=sum(t.params["split"] == "eval" for t in tasks),
        seconds=time.perf_counter() - started,
    )
    return tasks, report


_INIT = '''"""An env package `steprl synth` wrote (see synth_report.json); env.name: <dir>:SPEC loads it."""

from steprl.envs.synth.package import load_package

SPEC = load_package(__file__)
'''


def write_package(source: str | Path, out: str | Path, writer: Writer | None = None) -> SynthReport:
    """Synthesize from the YAML at `source` into the directory `out` (made; refused if it holds
    anything but a previous package); `writer` writes the code of `written` tools that have none."""
    source, out = Path(source), Path(out)
    given = read_yaml(source)
    raw = write_tools(load_raw(source), writer, str(source))
    spec = parse_spec(raw, str(source))
    check_written(spec)
    if out.exists() and any(out.iterdir()) and not (out / "synth_report.json").exists():
        raise SynthSpecError(
            f"{out}: exists and is not a package steprl synth wrote; pick an empty or new directory"
        )
    tasks, report = synthesize(spec)
    out.mkdir(parents=True, exist_ok=True)
    # as given, unless the MCP server's tool docs or the writer's code were merged in: the package
    # never needs either again
    merged = raw != given
    (out / "spec.yaml").write_text(yaml.safe_dump(raw, sort_keys=False) if merged else source.read_text())
    with (out / "tasks.jsonl").open("w") as f:
        for t in tasks:
            f.write(json.dumps({"id": t.id, "prompt": t.prompt, "seed": t.seed, **t.params}) + "\n")
    (out / "synth_report.json").write_text(
        json.dumps({**asdict(report), "validated_share": report.validated_share}, indent=2)
    )
    (out / "__init__.py").write_text(_INIT)
    return report


def read_tasks(path: Path, spec: SynthSpec) -> list[Task]:
    tasks = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
            decode_diff(row["golden"])
            params = {k: row[k] for k in ("world_seed", "plan", "golden", "shape", "split")}
            params["intent"] = dict(row.get("intent") or {})
            tasks.append(Task(str(row["id"]), str(row["prompt"]), spec.name, int(row["seed"]), None, params))
        except (ValueError, KeyError, TypeError) as exc:
            raise SynthSpecError(
                f"{path}:{n}: not a task row steprl synth writes ({type(exc).__name__}: {exc})"
            ) from None
    return tasks


def spec_from_yaml(path: str | Path, name: str | None = None, **overrides: Any) -> EnvSpec:
    """The `EnvSpec` of a tool-doc YAML, synthesized in this process (the same tasks each time);
    `overrides` replace keys of its `tasks:` section (e.g. ask_user, user_error_rate)."""
    raw = load_raw(path)
    spec = parse_spec(raw, str(path))
    check_written(spec)
    if overrides:
        spec = parse_spec({**raw, "tasks": {**(raw.get("tasks") or {}), **overrides}}, str(path))
    tasks, _ = synthesize(spec)
    return _env_spec(spec, tasks, name)


def _env_spec(spec: SynthSpec, tasks: list[Task], name: str | None) -> EnvSpec:
    held = frozenset(t.params["shape"] for t in tasks if t.params["split"] == "eval")
    return env_spec(spec, tasks, name, fresh=lambda seed: fresh_tasks(spec, held, seed))


def load_package(path: str | Path, name: str | None = None) -> EnvSpec:
    """The `EnvSpec` of a package directory (or of the `__init__.py` in it)."""
    d = Path(path)
    d = d.parent if d.is_file() else d
    if not (d / "spec.yaml").exists() or not (d / "tasks.jsonl").exists():
        raise SynthSpecError(
            f"{d}: not an env package (no spec.yaml and tasks.jsonl); make one with steprl synth"
        )
    spec = parse_spec(yaml.safe_load((d / "spec.yaml").read_text()), str(d / "spec.yaml"))
    return _env_spec(spec, read_tasks(d / "tasks.jsonl", spec), name)
