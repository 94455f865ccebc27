"""The warm start of a pretrained model (`model.name` other than tiny): LoRA adapters when
`model.lora` is set, then, with `model.init: sft`, supervised steps on the env's expert
demonstrations, played through the agent loop in the run's prompt format (chat template and all).

The tiny model's two-phase recipe (skills, then a deliberately imperfect mixture) exists because
it starts from random weights; a pretrained model gets the skills phase only: `model.sft`'s
`skill_strategy`, `num_episodes`, `skill_steps`, `batch_size` and `lr`. Not cached: the adapters
of a short warm start are cheap to retrain and depend on the base.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from itertools import islice
from typing import Any

from steprl.config import Config, ConfigError
from steprl.envs.base import Env
from steprl.rollout.loop import Budgets
from steprl.training.learn.lora import apply_lora, is_peft
from steprl.training.setup import env_setup as setup
from steprl.training.setup import sft
from steprl.training.setup.rollout_parts import context_rule
from steprl.types import Task


def warm_start(
    policy: Any,
    cfg: Config,
    log: Callable[[str], None],
    make_env: Callable[[Task], Env] | None,
    run: setup.RunEnvs,
) -> Any:
    """`policy` (a `training.setup.policy.Policy` of a pretrained model) with LoRA applied and, for
    `model.init: sft`, trained on expert demonstrations."""
    model = policy.model
    if cfg.model.lora is not None and not is_peft(model):
        model = apply_lora(model, cfg.model.lora, log)
    if cfg.model.init != "sft":
        return replace(policy, model=model)
    if make_env is None:
        raise ValueError("the SFT warm start plays demonstrations: pass make_env (an EnvPool's make_env)")
    s = cfg.model.sft
    strategies = run.strategies()
    if s.skill_strategy not in strategies:
        raise ConfigError(
            f"model.sft.skill_strategy={s.skill_strategy!r} is not a strategy of env {run.name!r}; its "
            f"strategies: {sorted(strategies)} (or set model.init=pretrained to skip the warm start)"
        )
    fmt = setup.prompt_format(cfg, policy.tokenizer)
    setup.check_prompt_format(fmt, cfg, log)  # a template the run would refuse: before the work
    tasks = list(islice(run.demo_tasks(s.seed)(), s.num_episodes * len(run.envs)))
    t0 = time.perf_counter()
    demos = sft.make_demos(
        tasks,
        strategies=strategies,
        weights={s.skill_strategy: 1.0},
        make_env=make_env,
        fmt=fmt,
        seed=s.seed,
        rule=context_rule(cfg, fmt),
        budgets=Budgets(*setup.budgets(cfg)),
        log=log,
    )
    log(
        f"SFT warm start of {cfg.model.name}: {len(demos)} {s.skill_strategy} demonstrations "
        f"({time.perf_counter() - t0:.1f}s); {s.skill_steps} steps of {s.batch_size}"
    )
    # on the run's device: a 270M model's SFT on a GPU's host CPU takes hours (the learner would
    # move it there only after the warm start)
    model = model.to(cfg.model.device)
    sft.sft_train(
        model,
        demos,
        steps=s.skill_steps,
        batch_size=s.batch_size,
        lr=s.lr,
        seed=s.seed,
        pad_id=policy.tokenizer.pad_token_id,
        log=log,
    )
    return replace(policy, model=model, source=f"{policy.source} + SFT warm start")
