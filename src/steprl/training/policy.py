"""Build or load the policy: the embedded tiny model (SFT warm start, cached) or a pretrained model
(a HF directory, a .gguf file, gemma-3-270m: steprl/models/sources.py)."""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from steprl.config import Config, ConfigError
from steprl.envs.base import Env
from steprl.models import qwen3_testbed, tiny
from steprl.models.sources import DTYPES, check_device_dtype, load_pretrained
from steprl.rollout.context import CONTEXT_RULES
from steprl.rollout.loop import Budgets
from steprl.training import env_setup as setup
from steprl.training import sft
from steprl.training.pretrained_sft import warm_start
from steprl.types import Task

#: Bump when the SFT recipe or the tokenizer changes, so stale caches are not reused.
SFT_RECIPE_VERSION = 4  # 4: env text never holds control or call tokens (BAD-09)


@dataclass
class Policy:
    model: Any  # a transformers causal LM
    tokenizer: Any
    source: str  # where the weights came from (cache dir, fresh SFT, HF dir)
    base_name: str = ""  # a pretrained base: what model.name loads it again (see models/sources.py)


def sft_cache_dir(cfg: Config) -> Path:
    key = json.dumps(
        {
            "recipe": SFT_RECIPE_VERSION,
            "tiny": cfg.model.tiny.model_dump(),
            "sft": cfg.model.sft.model_dump(),
            "env": cfg.env.model_dump(),
            "system_prompt": setup.system_prompt_mode(cfg),  # part of every demonstration's tokens
            "rollout": [cfg.rollout.context, cfg.rollout.keep_last_k, *setup.budgets(cfg)],  # shape demos
            "task_file": _file_version(cfg.env.task_file.path) if cfg.env.task_file else None,
            "seed": cfg.run.seed,
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", cfg.env.name)  # an import path or a family id
    return Path(cfg.model.cache_dir) / f"tiny-{name}-{digest}"


def _file_version(path: str) -> list[object]:
    """Size and mtime of a task file: an edited file gets a fresh warm start, not a stale cache."""
    try:
        st = Path(path).stat()
    except OSError:
        return [path]  # missing: the task loader says so, with the path
    return [str(Path(path).resolve()), st.st_size, st.st_mtime_ns]


def load_policy(
    cfg: Config, log: Callable[[str], None] = print, make_env: Callable[[Task], Env] | None = None
) -> Policy:
    """The policy `model.name` and `model.init` ask for. A fresh SFT warm start plays its
    demonstrations on envs from `make_env` (the run's env pool: any backend)."""
    check_device_dtype(cfg.model.device, cfg.model.dtype)  # one line, before any work
    if cfg.model.name == qwen3_testbed.NAME:  # real Qwen3 tokenizer + template, random small model
        tok = qwen3_testbed.load_tokenizer()
        qwen: Any = qwen3_testbed.build_model(tok, seed=cfg.run.seed).to(DTYPES[cfg.model.dtype])
        return warm_start(
            Policy(qwen, tok, "Qwen3 test bed (random init)", qwen3_testbed.NAME), cfg, log, make_env
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
        return warm_start(policy, cfg, log, make_env)  # LoRA (model.lora), SFT (model.init: sft)

    cache = sft_cache_dir(cfg)
    if cfg.model.init == "sft" and (cache / "config.json").exists():
        cached: Any = LlamaForCausalLM.from_pretrained(cache, dtype=torch.float32)
        return Policy(cached, PreTrainedTokenizerFast.from_pretrained(cache), f"cached SFT ({cache})")

    tokenizer = tiny.build_tokenizer()
    spec = tiny.TinyModelSpec(**cfg.model.tiny.model_dump())
    model = tiny.build_model(
        len(tokenizer),
        spec,
        seed=cfg.run.seed,
        pad_id=tokenizer.pad_token_id,
        bos_id=tokenizer.bos_token_id,
        eos_id=tokenizer.eos_token_id,
    )
    if cfg.model.init != "sft":
        return Policy(model, tokenizer, "random init")

    s = cfg.model.sft
    if make_env is None:
        raise ValueError("the SFT warm start plays demonstrations: pass make_env (an EnvPool's make_env)")
    env_spec = setup.env_spec(cfg)
    unknown = sorted({s.skill_strategy, *s.strategies} - set(env_spec.strategies))
    if unknown:  # checked before any work: the mixture phase would fail only after the skills phase
        raise ConfigError(
            f"model.sft.strategies / model.sft.skill_strategy name {unknown}, which env {env_spec.name!r} "
            f"does not offer; its strategies: {sorted(env_spec.strategies)} (e.g. --set "
            "'model.sft.strategies={expert: 0.3, random: 0.7}')"
        )
    fmt = setup.prompt_format(cfg, tokenizer)
    tasks = list(islice(env_spec.tasks("train", s.seed, **cfg.env.task_params), s.num_episodes))

    log(f"SFT warm start of the tiny policy {asdict(spec)}")
    for phase, weights, steps, lr in (
        ("skills", {s.skill_strategy: 1.0}, s.skill_steps, s.lr),
        ("mixture", dict(s.strategies), s.steps, s.mix_lr),
    ):
        if steps == 0:
            continue
        t0 = time.perf_counter()
        phase_demos = sft.make_demos(
            tasks,
            strategies=env_spec.strategies,
            weights=weights,
            make_env=make_env,
            fmt=fmt,
            seed=s.seed + len(phase),
            rule=CONTEXT_RULES[cfg.rollout.context](cfg.rollout.keep_last_k, fmt),
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
    cache.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(cache)
    tokenizer.save_pretrained(cache)
    # the run goes on with the policy as the cache holds it (the same weights, bit for bit): a
    # model that was just trained carries state that Ray cannot pickle (rollout workers), and a
    # fresh and a cached warm start are then the same object to everything downstream
    reloaded: Any = LlamaForCausalLM.from_pretrained(cache, dtype=torch.float32)
    return Policy(reloaded, tokenizer, f"fresh SFT (cached to {cache})")
