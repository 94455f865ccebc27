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

import contextlib
import json
import math
import os
import random
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from steprl.envs.spec import EnvSpec
from steprl.envs.synth.env import env_spec, make_env
from steprl.envs.synth.plans import instantiate, random_template
from steprl.envs.synth.spec import SynthSpec, SynthSpecError, read_yaml
from steprl.envs.synth.templates import check_opt_in, load_raw, parse_spec
from steprl.envs.synth.validate import PROBES, baseline_rates, validate
from steprl.envs.synth.world import decode_diff, encode_diff
from steprl.envs.synth.writer import Writer, check_written, write_tools
from steprl.types import Task

#: hears a line on how a long synthesis goes (the CLI prints it on stderr)
Progress = Callable[[str], None]
PROGRESS_EVERY_S = 3.0  # a synthesis quicker than this says nothing


class Ticker:
    """Passes a line on to `progress` at most every `PROGRESS_EVERY_S`."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress, self.last = progress, time.monotonic()

    def __call__(self, line: str) -> None:
        now = time.monotonic()
        if self.progress is not None and now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            self.progress(line)


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


def synthesize(spec: SynthSpec, progress: Progress | None = None) -> tuple[list[Task], SynthReport]:
    """`tasks.count` admitted tasks (fewer if the spec cannot give that many distinct ones);
    `progress` hears how it goes every `PROGRESS_EVERY_S`."""
    started = time.perf_counter()
    tick = Ticker(progress)
    rng = random.Random(f"synth:{spec.name}:{spec.tasks.seed}")
    env = make_env(spec, honest_user=True)
    seen: set[str] = set()
    admitted: list[Task] = []
    generated = validated = 0
    wins: Counter[str] = Counter()
    for attempt in range(spec.tasks.count * 30):
        if len(admitted) >= spec.tasks.count:
            break
        tick(
            f"{spec.name}: {len(admitted)} of {spec.tasks.count} tasks admitted so far "
            f"({generated} generated, {time.perf_counter() - started:.0f} s)"
        )
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
    rates = baseline_rates(spec, tasks, tick=tick)
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
# A package with written code: importing this file runs it (Python, on the host), so naming the
# directory in env.name is already trusting it; the tools' code itself still runs in the sandbox.
_INIT_WRITTEN = _INIT.replace("load_package(__file__)", "load_package(__file__, allow_written_code=True)")

#: what `write_package` writes into the package directory
PACKAGE_FILES = ("spec.yaml", "tasks.jsonl", "synth_report.json", "__init__.py")


def _check_out(out: Path) -> None:
    """`out` can take a package: a new or empty directory, or one holding a previous package
    whose files are plain files (a link there would have the package written through it)."""
    if out.exists() and not out.is_dir():
        raise SynthSpecError(f"{out}: exists and is not a directory; pick a new or empty directory for -o")
    if out.is_dir() and any(out.iterdir()) and not (out / "synth_report.json").is_file():
        raise SynthSpecError(
            f"{out}: exists and is not a package steprl synth wrote; pick an empty or new directory"
        )
    for name in PACKAGE_FILES:
        target = out / name
        if target.is_symlink() or (target.exists() and not target.is_file()):
            raise SynthSpecError(
                f"{target}: is a {'symbolic link' if target.is_symlink() else 'directory'}, not a file "
                "steprl synth wrote; remove it or pick a new directory for -o"
            )


def _new_file(out: Path, name: str, lines: Iterable[str]) -> Path:
    """A new file in `out` (O_EXCL, never an existing one or a link) holding `lines`, to be renamed
    over `out/name` (a rename replaces a link there, never its target)."""
    fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(lines)
    except BaseException:
        os.unlink(tmp)
        raise
    return Path(tmp)


def _write_all(out: Path, files: list[tuple[str, Iterable[str]]]) -> None:
    """Every file written in full before any is renamed into place: a full disk leaves `out` as it
    was (a directory this made, empty, is removed again), so the same command can run again."""
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    done: list[tuple[Path, str]] = []
    try:
        _check_out(out)  # again: what the synthesis gave time to change
        for name, lines in files:
            done.append((_new_file(out, name, lines), name))
        for tmp, name in done:
            os.replace(tmp, out / name)
    except BaseException:
        for tmp, _ in done:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        if made:
            with contextlib.suppress(OSError):
                out.rmdir()  # only if empty: nothing but what this made was there
        raise


def _carried_code(raw: Any) -> list[str]:
    tools = raw.get("tools") if isinstance(raw, Mapping) else None
    return [str(t.get("name")) for t in tools or () if isinstance(t, Mapping) and t.get("code")]


def write_package(
    source: str | Path,
    out: str | Path,
    writer: Writer | None = None,
    allow_written_code: bool = False,
    progress: Progress | None = None,
) -> SynthReport:
    """Synthesize from the YAML at `source` into the directory `out` (made; refused if it holds
    anything but a previous package); `writer` writes the code of `written` tools that have none
    (asking for a writer allows its code, which runs only in the sandbox); code the spec itself
    carries needs `allow_written_code`. `progress` hears how a long synthesis goes."""
    source, out = Path(source), Path(out)
    given = read_yaml(source)
    raw = load_raw(source)
    check_opt_in(_carried_code(raw), str(source), allow_written_code)
    _check_out(out)
    raw = write_tools(raw, writer, str(source))
    spec = parse_spec(raw, str(source), allow_written_code=True)  # the given code allowed above
    check_written(spec)
    tasks, report = synthesize(spec, progress)
    # as given, unless the MCP server's tool docs or the writer's code were merged in: the package
    # never needs either again
    text = yaml.safe_dump(raw, sort_keys=False) if raw != given else source.read_text(encoding="utf-8")
    summary = json.dumps({**asdict(report), "validated_share": report.validated_share}, indent=2)
    rows = (json.dumps({"id": t.id, "prompt": t.prompt, "seed": t.seed, **t.params}) + "\n" for t in tasks)
    try:
        init = _INIT_WRITTEN if _carried_code(raw) else _INIT
        files: list[tuple[str, Iterable[str]]] = [
            ("spec.yaml", [text]),
            ("tasks.jsonl", rows),
            ("synth_report.json", [summary]),
            ("__init__.py", [init]),
        ]
        _write_all(out, files)
    except OSError as exc:
        raise SynthSpecError(f"{out}: cannot write the package: {exc.strerror or exc}") from None
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


def spec_from_yaml(
    path: str | Path, name: str | None = None, allow_written_code: bool = False, **overrides: Any
) -> EnvSpec:
    """The `EnvSpec` of a tool-doc YAML, synthesized in this process (the same tasks each time);
    `overrides` replace keys of its `tasks:` section (e.g. ask_user, user_error_rate)."""
    raw = load_raw(path)
    spec = parse_spec(raw, str(path), allow_written_code)
    check_written(spec)
    if overrides:
        raw = {**raw, "tasks": {**(raw.get("tasks") or {}), **overrides}}
        spec = parse_spec(raw, str(path), allow_written_code)
    tasks, _ = synthesize(spec)
    return _env_spec(spec, tasks, name)


def _env_spec(spec: SynthSpec, tasks: list[Task], name: str | None) -> EnvSpec:
    held = frozenset(t.params["shape"] for t in tasks if t.params["split"] == "eval")
    return env_spec(spec, tasks, name, fresh=lambda seed: fresh_tasks(spec, held, seed))


def load_package(path: str | Path, name: str | None = None, allow_written_code: bool = False) -> EnvSpec:
    """The `EnvSpec` of a package directory (or of the `__init__.py` in it); a package whose
    spec.yaml carries written code needs `allow_written_code`."""
    d = Path(path)
    d = d.parent if d.is_file() else d
    if not (d / "spec.yaml").exists() or not (d / "tasks.jsonl").exists():
        raise SynthSpecError(
            f"{d}: not an env package (no spec.yaml and tasks.jsonl); make one with steprl synth"
        )
    spec = parse_spec(read_yaml(d / "spec.yaml"), str(d / "spec.yaml"), allow_written_code)
    return _env_spec(spec, read_tasks(d / "tasks.jsonl", spec), name)
