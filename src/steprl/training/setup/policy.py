"""Build or load the policy: the embedded tiny model (SFT warm start, cached) or a pretrained model
(a HF directory, a .gguf file, gemma-3-270m: steprl/models/sources.py)."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from steprl.config import Config, ConfigError
from steprl.envs.base import Env, EnvTimeout
from steprl.envs.deadline import take_tasks
from steprl.envs.harness import RUN_ONLY
from steprl.envs.registry import get_spec
from steprl.errors import UserError
from steprl.models import qwen3_testbed, tiny
from steprl.models.sources import (
    DTYPES,
    cache_root,
    check_device_dtype,
    load_pretrained,
    read_chat_template,
)
from steprl.rollout.loop import Budgets
from steprl.training.setup import env_setup as setup
from steprl.training.setup import sft
from steprl.training.setup.pretrained_sft import warm_start
from steprl.training.setup.rollout_parts import context_rule
from steprl.types import Task

#: Bump when the SFT recipe or the tokenizer changes, so stale caches are not reused.
SFT_RECIPE_VERSION = 5  # 4: env text never holds control or call tokens (BAD-09); 5: keyed on code
#: Written last into a warm start's cache directory: what its key was made of. A directory
#: without it is not a warm start (a save that was cut short never is: it is renamed in whole).
WARM_START_KEY = "steprl-warm-start.json"


@dataclass
class Policy:
    model: Any  # a transformers causal LM
    tokenizer: Any
    source: str  # where the weights came from (cache dir, fresh SFT, HF dir)
    base_name: str = ""  # a pretrained base: what model.name loads it again (see models/sources.py)


@dataclass(frozen=True)
class WarmStart:
    """Where the tiny model's warm start for a config is cached, and what its key is made of."""

    path: Path  # <cache root>/tiny-<env>-<key>
    parts: dict[str, str]  # part -> its digest: recipe and config, env code, tasks

    def describe(self) -> str:
        return f"key {self.path.name.rsplit('-', 1)[-1]}: " + ", ".join(
            f"{k} {v}" for k, v in self.parts.items()
        )


def warm_start_cache(cfg: Config, run: setup.RunEnvs, tasks: list[Task]) -> WarmStart:
    """The cache of the warm start `cfg` asks for, keyed on everything the warm start depends
    on: the recipe and the config that shape it, the code of the env, its task generator and its
    strategies (`_code_digest`: an edited env, generator or strategy is a new warm start), and
    the demonstrations' tasks themselves (a generator whose output changed, or a task file's
    rows, however it changed)."""
    config = json.dumps(
        {
            "recipe": SFT_RECIPE_VERSION,
            # words only when set: a char-level warm start keeps the key it had before they existed
            "tiny": cfg.model.tiny.model_dump(exclude=set() if cfg.model.tiny.words else {"words"}),
            "sft": cfg.model.sft.model_dump(),
            "env": _env_key(cfg, run),
            "system_prompt": setup.system_prompt_mode(cfg),  # part of every demonstration's tokens
            "rollout": [cfg.rollout.context, cfg.rollout.keep_last_k, *setup.budgets(cfg)],  # shape demos
            "seed": cfg.run.seed,
            # the tiny model's chat template (model.chat_template) shapes every demonstration's ids
            **({"chat_template": _tiny_template(cfg)} if cfg.model.chat_template else {}),
        },
        sort_keys=True,
    )
    parts = {
        "config": _digest([config]),
        "env code": _code_digest(run.code()),
        f"{len(tasks)} tasks": _digest(repr(t) for t in tasks),
    }
    key = _digest(parts.values())
    one = run.envs[0].spec
    shown = one.name if not run.several and _names_itself(one) else run.name
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", shown)  # a family id, a list
    return WarmStart(cache_root(cfg.model.cache_dir) / f"tiny-{name}-{key}", parts)


def _env_key(cfg: Config, run: setup.RunEnvs) -> dict[str, Any]:
    """The env section as the warm start depends on it, without `env.plugins` (which modules
    register an env changes no demonstration) and with one env named by its spec's name when
    that name resolves to this very spec (an entry point, an import path to the object it loads
    and a plugin's registration of it are one warm start). A spec whose name means another
    object (an import path to a variant with other bound params) keeps the config's name. The
    task source is left out: it orders RL's tasks, not the demonstrations'."""
    env = cfg.env.model_dump()
    env.pop("plugins", None)
    # the order RL draws train tasks in changes no demonstration (they are the train split's
    # first tasks, `_demo_tasks`): every task source shares one warm start (as the defaults key it)
    env["source"], env["source_params"] = "auto", {}
    if not run.several and _names_itself(run.envs[0].spec):
        env["name"] = run.envs[0].spec.name
    # a harness env's demonstrations play the env it names, never the harness: which function
    # runs the RL episodes, and for how long, is no part of them
    for entry in [env, *env.get("mix", [])]:
        if entry.get("name") == "harness" and isinstance(entry.get("params"), dict):
            entry["params"] = {k: v for k, v in entry["params"].items() if k not in RUN_ONLY}
    return env


def _names_itself(spec: Any) -> bool:
    try:
        return get_spec(spec.name) is spec
    except UserError:  # its name is registered nowhere
        return False


def _digest(texts: Iterable[str]) -> str:
    h = hashlib.sha256()
    for text in texts:
        h.update(text.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _code_digest(objs: Iterable[object]) -> str:
    """A digest of the source files that define `objs` (classes, functions, partials, callable
    instances: the file of each one's class or function). Something without a source file (a
    built-in) counts by its qualified name."""
    objs, files = list(objs), set()
    # a wrapper's own file and that of the code it runs (`code_of`: a harness env's factory and
    # tasks run the played env's)
    for obj in [*objs, *(o.code_of for o in objs if hasattr(o, "code_of"))]:
        fn = getattr(obj, "func", obj)  # functools.partial
        if not (inspect.isclass(fn) or inspect.isfunction(fn) or inspect.ismethod(fn)):
            fn = type(fn)  # a callable instance: its class holds the code
        try:
            files.add(inspect.getsourcefile(fn) or "")
        except TypeError:  # built-in
            files.add(f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)}")
    texts = []
    for f in sorted(files):
        try:
            texts.append(Path(f).read_text(encoding="utf-8", errors="replace"))
        except OSError:
            texts.append(f)
    return _digest(texts)


def load_policy(
    cfg: Config,
    log: Callable[[str], None] = print,
    make_env: Callable[[Task], Env] | None = None,
    run: setup.RunEnvs | None = None,
) -> Policy:
    """The policy `model.name` and `model.init` ask for. A fresh SFT warm start plays its
    demonstrations on the run's envs `run` (default: resolved from `cfg`), made by `make_env`
    (the run's env pool: any backend)."""
    check_device_dtype(cfg.model.device, cfg.model.dtype)  # one line, before any work
    run = run if run is not None else setup.run_envs(cfg)
    if cfg.model.name == qwen3_testbed.NAME:  # real Qwen3 tokenizer + template, random small model
        tok = qwen3_testbed.load_tokenizer()
        qwen: Any = qwen3_testbed.build_model(tok, seed=cfg.run.seed).to(DTYPES[cfg.model.dtype])
        return warm_start(
            Policy(qwen, tok, "Qwen3 test bed (random init)", qwen3_testbed.NAME), cfg, log, make_env, run
        )
    if cfg.model.name != "tiny":
        m = cfg.model
        if m.engine_dtype not in ("auto", m.dtype):  # the engine's copy must fit the device too
            check_device_dtype(m.device, m.engine_dtype)
        loaded = load_pretrained(
            m.name,
            dtype=m.dtype,
            device=m.device,
            cache_dir=m.cache_dir,
            chat_template=m.chat_template,
            log=log,
        )
        policy = Policy(loaded.model, loaded.tokenizer, loaded.source, loaded.base_name)
        return warm_start(policy, cfg, log, make_env, run)  # LoRA (model.lora), SFT (model.init: sft)

    if cfg.model.init != "sft":
        return Policy(*_random_tiny(cfg), "random init")

    s = cfg.model.sft
    strategies = run.strategies()
    tasks = _demo_tasks(cfg, run)  # part of the cache key: asked for before a cache is reused
    warm = warm_start_cache(cfg, run, tasks)
    cache = warm.path
    if (cache / WARM_START_KEY).exists():
        log(f"SFT warm start: reusing {cache} ({warm.describe()})")
        cached: Any = LlamaForCausalLM.from_pretrained(cache, dtype=torch.float32)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(cache)
        tokenizer.chat_template = _tiny_template(cfg)  # the key holds it: the same text
        return Policy(cached, tokenizer, f"cached SFT ({cache})")
    log(f"SFT warm start: none cached for {warm.describe()}; building {cache}")

    model, tokenizer = _random_tiny(cfg)
    if make_env is None:
        raise ValueError("the SFT warm start plays demonstrations: pass make_env (an EnvPool's make_env)")
    unknown = sorted({s.skill_strategy, *s.strategies} - set(strategies))
    if unknown:  # checked before any work: the mixture phase would fail only after the skills phase
        raise ConfigError(
            f"model.sft.strategies / model.sft.skill_strategy name {unknown}, which env {run.name!r} "
            f"does not offer; its strategies: {sorted(strategies)} (e.g. --set "
            "'model.sft.strategies={expert: 0.3, random: 0.7}')"
        )
    fmt = setup.prompt_format(cfg, tokenizer)

    words = f", {len(cfg.model.tiny.words)} words" if cfg.model.tiny.words else ""
    log(f"SFT warm start of the tiny policy {cfg.model.tiny.spec_fields()}{words}")
    for phase, weights, steps, lr in (
        ("skills", {s.skill_strategy: 1.0}, s.skill_steps, s.lr),
        ("mixture", dict(s.strategies), s.steps, s.mix_lr),
    ):
        if steps == 0:
            continue
        t0 = time.perf_counter()
        phase_demos = sft.make_demos(
            tasks,
            strategies=strategies,
            weights=weights,
            make_env=make_env,
            fmt=fmt,
            seed=s.seed + len(phase),
            rule=context_rule(cfg, fmt),
            budgets=Budgets(*setup.budgets(cfg)),  # the demos fit what RL will show the model
            log=log,
        )
        log(
            f" phase {phase}: {len(phase_demos)} demonstrations {weights} "
            f"({time.perf_counter() - t0:.1f}s); {steps} steps of {s.batch_size}"
        )
        sft.sft_train(
            model,
            phase_demos,
            steps=steps,
            batch_size=s.batch_size,
            lr=lr,
            seed=s.seed,
            pad_id=tokenizer.pad_token_id,
            log=log,
        )
    _publish(warm, model, tokenizer, log)
    # the run goes on with the policy as the cache holds it (the same weights, bit for bit): a
    # model that was just trained carries state that Ray cannot pickle (rollout workers), and a
    # fresh and a cached warm start are then the same object to everything downstream
    reloaded: Any = LlamaForCausalLM.from_pretrained(cache, dtype=torch.float32)
    return Policy(reloaded, tokenizer, f"fresh SFT (cached to {cache})")


def _demo_tasks(cfg: Config, run: setup.RunEnvs) -> list[Task]:
    """The demonstrations' tasks: the first `model.sft.num_episodes` of the train split (several
    envs: of each, in turn), each within `runtime.env_call_timeout_s` (a generator that stops
    yielding is one line, not a hang)."""
    s, timeout = cfg.model.sft, cfg.runtime.env_call_timeout_s
    try:
        return take_tasks(run.demo_tasks(s.seed), s.num_episodes * len(run.envs), timeout, "the train split")
    except EnvTimeout as exc:
        raise UserError(
            f"env {run.name!r}: {exc} (runtime.env_call_timeout_s) while the SFT warm start gathers its "
            f"tasks; its task factory must yield train tasks promptly (steprl check-env)"
        ) from None


def _tiny_template(cfg: Config) -> str | None:
    """`model.chat_template`'s text for the tiny model (whose tokenizer has none of its own)."""
    return read_chat_template(cfg.model.chat_template) if cfg.model.chat_template else None


def _random_tiny(cfg: Config) -> tuple[Any, Any]:
    """The tiny model of `model.tiny`, randomly initialised from `run.seed`, and its tokenizer."""
    tokenizer = tiny.build_tokenizer(cfg.model.tiny.words)
    tokenizer.chat_template = _tiny_template(cfg)
    model = tiny.build_model(
        len(tokenizer),
        tiny.TinyModelSpec(**cfg.model.tiny.spec_fields()),
        seed=cfg.run.seed,
        pad_id=tokenizer.pad_token_id,
        bos_id=tokenizer.bos_token_id,
        eos_id=tokenizer.eos_token_id,
    )
    return model, tokenizer


def _publish(warm: WarmStart, model: Any, tokenizer: Any, log: Callable[[str], None]) -> None:
    """Save the warm start beside its cache directory, its key file last, and rename it into
    place: a killed save never leaves a directory that looks complete, and two runs that build
    the same key at once both end with one whole copy."""
    warm.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = warm.path.with_name(f".{warm.path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / WARM_START_KEY).write_text(json.dumps(warm.parts, indent=1) + "\n")
    if warm.path.exists() and not (warm.path / WARM_START_KEY).exists():
        shutil.rmtree(warm.path)  # not a warm start (no key file): nothing to keep
    try:
        os.rename(tmp, warm.path)
    except OSError:  # another process published this key meanwhile: the same warm start
        shutil.rmtree(tmp, ignore_errors=True)
        log(f"{warm.path} was written by another process meanwhile; using it")
