"""Build or load the policy: the embedded tiny model (SFT warm start, cached) or a local HF model."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast

from steprl.config import Config
from steprl.envs.registry import get_spec
from steprl.models import tiny
from steprl.rollout.chat import PlainFormat
from steprl.training import sft

#: Bump when the SFT recipe or the tokenizer changes, so stale caches are not reused.
SFT_RECIPE_VERSION = 2


@dataclass
class Policy:
    model: Any  # a transformers causal LM
    tokenizer: Any
    source: str  # where the weights came from (cache dir, fresh SFT, HF dir)


def sft_cache_dir(cfg: Config) -> Path:
    key = json.dumps(
        {
            "recipe": SFT_RECIPE_VERSION,
            "tiny": cfg.model.tiny.model_dump(),
            "sft": cfg.model.sft.model_dump(),
            "env": cfg.env.model_dump(),
            "seed": cfg.run.seed,
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(cfg.model.cache_dir) / f"tiny-{cfg.env.name}-{digest}"


def load_policy(cfg: Config, log: Callable[[str], None] = print) -> Policy:
    if cfg.model.name != "tiny":
        path = Path(cfg.model.name)
        if not path.exists():
            raise FileNotFoundError(
                f"model.name={cfg.model.name!r} is neither 'tiny' nor a local directory; weights cannot "
                "be downloaded at run time here, so point model.name at a saved Hugging Face model."
            )
        model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return Policy(model, AutoTokenizer.from_pretrained(path), str(path))

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
    env_spec = get_spec(cfg.env.name)
    fmt = PlainFormat(tokenizer)
    tasks = list(islice(env_spec.tasks("train", s.seed, **cfg.env.task_params), s.num_episodes))

    def demos(weights: dict[str, float], seed: int) -> list[sft.Demo]:
        return sft.make_demos(
            make_env=lambda task: env_spec.factory(**cfg.env.params),
            tasks=tasks,
            strategies=env_spec.strategies,
            weights=weights,
            fmt=fmt,
            seed=seed,
        )

    log(f"SFT warm start of the tiny policy {asdict(spec)}")
    for phase, weights, steps, lr in (
        ("skills", {s.skill_strategy: 1.0}, s.skill_steps, s.lr),
        ("mixture", dict(s.strategies), s.steps, s.mix_lr),
    ):
        if steps == 0:
            continue
        t0 = time.perf_counter()
        phase_demos = demos(weights, s.seed + len(phase))
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
    return Policy(model, tokenizer, f"fresh SFT (cached to {cache})")
