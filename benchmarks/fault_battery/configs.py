"""Bad configs (issue 44 items 3, 10-12): variants of the shipped default recipe (made tiny), each
given to `steprl train` as its YAML file: wrong types, negative and zero sizes, unknown keys, huge
values, paths to nowhere, import paths to things that are not classes (`os:system`), an unsafe
YAML tag, a YAML bomb, files that are not YAML or not UTF-8 or not files. Each is refused in one
line (exit 2) or, where it is a valid config after all, runs to its end; never a traceback, a
hang, memory, or a payload run on the host."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from .common import TINY, TINY_CONFIG, Ctx, Outcome, Probe, Verdict, defect, judge
from .synth import BOMB

Change = tuple[str, Any]  # a dotted key and its new value (DELETE: removed)
DELETE = object()


def base_config(ctx: Ctx) -> dict[str, Any]:
    """configs/calculator_tiny.yaml with the tiny shape written in, writing under ctx.tmp."""
    raw: dict[str, Any] = yaml.safe_load(TINY_CONFIG.read_text())
    for setting in [*TINY, f"run.output_dir={ctx.tmp / 'runs'}", f"model.cache_dir={ctx.tmp / 'cache'}"]:
        key, _, value = setting.partition("=")
        _put(raw, key, yaml.safe_load(value))
    return raw


def _put(raw: dict[str, Any], dotted: str, value: Any) -> None:
    *path, last = dotted.split(".")
    node = raw
    for part in path:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    if value is DELETE:
        node.pop(last, None)
    else:
        node[last] = value


def _train(ctx: Ctx, config: Path) -> Verdict:
    # 300 s: a deleted model section is the default model, a full warm start (146 s quiet)
    run = ctx.steprl(["train", str(config)], deadline=300, mem_cap_mb=2048)
    if ctx.marker.exists():
        return Verdict(Outcome.ESCAPED, f"loading the config touched {ctx.marker.name} on the host")
    return judge(run, (0, 2))


def mutated(*changes: Change) -> Callable[[Ctx], Verdict]:
    def probe(ctx: Ctx) -> Verdict:
        raw = base_config(ctx)
        for key, value in changes:
            _put(raw, key, value)
        path = ctx.tmp / "config.yaml"
        path.write_text(json.dumps(raw))  # JSON is YAML
        return _train(ctx, path)

    return probe


def written(text: Callable[[Ctx], str | bytes]) -> Callable[[Ctx], Verdict]:
    """A config file with exactly this text (or bytes)."""

    def probe(ctx: Ctx) -> Verdict:
        path = ctx.tmp / "config.yaml"
        body = text(ctx)
        path.write_bytes(body if isinstance(body, bytes) else body.encode())
        return _train(ctx, path)

    return probe


def _dump(ctx: Ctx) -> str:
    return yaml.safe_dump(base_config(ctx))


def _empty(ctx: Ctx) -> Verdict:
    """An empty file is every default: the default demo, a few minutes of warm start and RL, not
    a refusal. What must hold: it starts and shows progress, and a SIGTERM stops it in one line
    (a whole default run is past any probe's deadline)."""
    path = ctx.tmp / "config.yaml"
    path.write_text("")
    proc = ctx.start(["train", str(path)], mem_cap_mb=2048)
    if not proc.wait_for("sft step", 150):
        return judge(proc.wait(1), (0, 2))
    proc.signal(signal.SIGTERM)
    run = proc.wait(60)
    if ctx.marker.exists():
        return Verdict(Outcome.ESCAPED, f"loading the config touched {ctx.marker.name} on the host")
    if run.timed_out or run.rc in (0, 2):
        return judge(run, (0, 2))
    if run.rc not in (130, 143, -15) or "Traceback" in run.out:
        return defect(f"SIGTERM in the default run's warm start: exit {run.rc}: {run.last_line()}")
    return judge(run, (run.rc,), why="")


def _directory(ctx: Ctx) -> Verdict:
    (ctx.tmp / "dir.yaml").mkdir()
    return _train(ctx, ctx.tmp / "dir.yaml")


def _task_file(rows: list[dict[str, Any]], relative: bool) -> Callable[[Ctx], Verdict]:
    """A task file next to the config, named relative to it (`relative`) or by a path to nowhere."""

    def probe(ctx: Ctx) -> Verdict:
        sub = ctx.tmp / "conf"
        sub.mkdir()
        (sub / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        raw = base_config(ctx)
        raw["env"]["task_file"] = {"path": "tasks.jsonl" if relative else str(ctx.tmp / "nowhere.jsonl")}
        (sub / "config.yaml").write_text(json.dumps(raw))
        return _train(ctx, sub / "config.yaml")

    return probe


TRAIN_ONLY = [
    {"id": f"t{i}", "prompt": f"what is {i}+1?", "answer": str(i + 1), "split": "train"} for i in range(6)
]
BOTH = [{**r, "split": "eval" if i % 2 else "train"} for i, r in enumerate(TRAIN_ONLY)]
UNSAFE_TAG = "!!python/object/apply:os.system ['touch {marker}']"

#: (name, changes): one probe each
MUTATIONS: list[tuple[str, tuple[Change, ...]]] = [
    # wrong types
    ("run.seed: a string", (("run.seed", "zero"),)),
    ("run.overwrite: a string", (("run.overwrite", "maybe"),)),
    ("run.name: a list", (("run.name", ["a", "b"]),)),
    ("model.tiny.hidden_size: a float", (("model.tiny.hidden_size", 32.5),)),
    ("model.tiny: a list", (("model.tiny", [32, 1]),)),
    ("model.init: unknown", (("model.init", "magic"),)),
    ("env.params: a list", (("env.params", [1, 2]),)),
    ("rollout.group_size: a string", (("rollout.group_size", "two"),)),
    ("rollout.temperature: a string", (("rollout.temperature", "hot"),)),
    ("rollout.context: unknown", (("rollout.context", "everything"),)),
    ("algorithm.advantage_params: a string", (("algorithm.advantage_params", "scale"),)),
    ("algorithm.loss_params.clip_low: a list", (("algorithm.loss_params.clip_low", [0.2]),)),
    ("trainer.total_steps: a float", (("trainer.total_steps", 1.5),)),
    ("trainer.lr: a string", (("trainer.lr", "fast"),)),
    ("trainer.eval_every: a bool", (("trainer.eval_every", True),)),
    ("logging.progress: a number", (("logging.progress", 3),)),
    ("logging: a list", (("logging", ["tensorboard"]),)),
    ("health: a number", (("health", 7),)),
    # negative, zero, not a number
    ("run.seed: negative", (("run.seed", -1),)),
    ("model.tiny.num_layers: 0", (("model.tiny.num_layers", 0),)),
    ("model.tiny.num_heads: 3 (32 not divisible)", (("model.tiny.num_heads", 3),)),
    ("rollout.tasks_per_step: 0", (("rollout.tasks_per_step", 0),)),
    ("rollout.group_size: -2", (("rollout.group_size", -2),)),
    ("rollout.max_turns: 0", (("rollout.max_turns", 0),)),
    ("rollout.max_tokens_per_turn: -1", (("rollout.max_tokens_per_turn", -1),)),
    ("rollout.temperature: -1", (("rollout.temperature", -1.0),)),
    ("algorithm.loss_params.clip_low: -0.2", (("algorithm.loss_params.clip_low", -0.2),)),
    ("trainer.total_steps: -1", (("trainer.total_steps", -1),)),
    ("trainer.lr: 0", (("trainer.lr", 0),)),
    ("trainer.lr: NaN", (("trainer.lr", float("nan")),)),
    ("trainer.lr: inf", (("trainer.lr", float("inf")),)),
    ("trainer.mini_batches: 0", (("trainer.mini_batches", 0),)),
    ("trainer.mini_batches: 3 (4 trajectories)", (("trainer.mini_batches", 3),)),
    ("trainer.eval_tasks: 0", (("trainer.eval_tasks", 0),)),
    ("trainer.eval_temperature: -1", (("trainer.eval_temperature", -1.0),)),
    ("runtime.env_call_timeout_s: 0", (("runtime.env_call_timeout_s", 0),)),
    # unknown keys
    ("unknown top-level key", (("trainr", {"lr": 1}),)),
    ("unknown nested key", (("trainer.lrr", 1e-3),)),
    ("unknown key under model.tiny", (("model.tiny.width", 8),)),
    ("a section deleted (model)", (("model", DELETE),)),
    # huge values
    (
        "model.tiny.hidden_size: 10^6",
        (("model.tiny.hidden_size", 10**6), ("model.tiny.intermediate_size", 10**6)),
    ),
    ("model.tiny.num_layers: 10^5", (("model.tiny.num_layers", 10**5),)),
    ("rollout.group_size: 10^9", (("rollout.group_size", 10**9),)),
    ("rollout.tasks_per_step: 10^9", (("rollout.tasks_per_step", 10**9),)),
    ("rollout.max_tokens_per_turn: 10^12", (("rollout.max_tokens_per_turn", 10**12),)),
    ("rollout.max_turns: 10^9", (("rollout.max_turns", 10**9),)),
    ("trainer.eval_tasks: 10^9", (("trainer.eval_tasks", 10**9),)),
    ("run.seed: 2^70", (("run.seed", 2**70),)),
    ("trainer.lr: 1e308", (("trainer.lr", 1e308),)),
    ("run.name: 10k characters", (("run.name", "n" * 10_000),)),
    # paths to nowhere, paths out of place
    ("run.output_dir: under /proc", (("run.output_dir", "/proc/steprl-fault/runs"),)),
    ("run.name: ../ escapes output_dir", (("run.name", "../escape"),)),
    ("run.name: empty", (("run.name", ""),)),
    ("model.chat_template: missing file", (("model.chat_template", "/nowhere/template.jinja"),)),
    ("model.name: a missing directory", (("model.name", "/nowhere/model"), ("model.init", "pretrained"))),
    ("model.cache_dir: a file", (("model.cache_dir", "/etc/hostname"), ("model.init", "sft"))),
    ("env.task_file: missing", (("env.task_file", {"path": "/nowhere/tasks.jsonl"}),)),
    ("env.plugins: a missing module", (("env.plugins", ["no_such_module_xyz"]),)),
    # import paths to things that are not what they should be
    ("env.name: os:system", (("env.name", "os:system"),)),
    ("env.name: builtins:print", (("env.name", "builtins:print"),)),
    ("env.name: unknown", (("env.name", "no_such_env"),)),
    ("env.params: unknown param", (("env.params", {"no_such_param": 1}),)),
    ("algorithm.advantage: os:system", (("algorithm.advantage", "os:system"),)),
    ("algorithm.policy_loss: unknown", (("algorithm.policy_loss", "no_such_loss"),)),
    ("algorithm.step_reward.kind: os:system", (("algorithm.step_reward", {"kind": "os:system"}),)),
    ("env.source: os:system", (("env.source", "os:system"),)),
    (
        "health rule: unknown signal",
        (
            (
                "health",
                {"rules": [{"name": "r", "when": [{"signal": "x", "above": 1}], "actions": ["alert"]}]},
            ),
        ),
    ),
]

WHOLE_FILE: list[tuple[str, Callable[[Ctx], Verdict]]] = [
    ("YAML syntax error", written(lambda ctx: "run: {name: x\ntrainer: [\n")),
    ("an empty file: the defaults, SIGTERM ends it", _empty),
    ("a top-level list", written(lambda ctx: "- run\n- model\n")),
    ("not UTF-8", written(lambda ctx: _dump(ctx).encode() + b"# caf\xe9\n")),
    (
        "a YAML bomb in env.params",
        written(lambda ctx: BOMB + _dump(ctx).replace("params: {}", "params: {x: *i}")),
    ),
    (
        "an unsafe tag (os.system)",
        written(lambda ctx: _dump(ctx) + f"extra: {UNSAFE_TAG.format(marker=ctx.marker)}\n"),
    ),
    ("a duplicate key", written(lambda ctx: _dump(ctx) + "run: {name: twice}\n")),
    ("the config is a directory", _directory),
    ("a task file relative to the config", _task_file(BOTH, relative=True)),
    ("a task file with no eval split", _task_file(TRAIN_ONLY, relative=True)),
    ("a task file path to nowhere", _task_file(BOTH, relative=False)),
]

PROBES = [
    *(
        Probe("configs", name, "3" if "bomb" in name else "10-12", mutated(*changes))
        for name, changes in MUTATIONS
    ),
    *(Probe("configs", name, "3" if "bomb" in name else "10-12", fn) for name, fn in WHOLE_FILE),
]
