"""Cross-policy sampling on a Ray rollout worker: the worker's snapshots rotate with each
`sync_weights` exactly as the in-process engine's do (bit-identical rollouts), a rebuilt worker
replays them, and a resume's snapshots (`load_snapshots`) reach the workers."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
from itertools import islice

import pytest
import ray
import torch

from steprl.engines.base import SamplingParams
from steprl.engines.hf import EngineSettings, HFEngine
from steprl.engines.snapshots import CrossPolicy
from steprl.envs.registry import make_env, make_tasks
from steprl.rollout.chat import PlainFormat
from steprl.rollout.context import AppendOnly
from steprl.rollout.loop import Budgets, RolloutSetup, rollout_groups
from steprl.rollout.ray_workers import RayRolloutPool, WorkerEnvs

SETTINGS = EngineSettings(seed=5, cross_policy=CrossPolicy((0.4, 0.3, 0.3)))
PIECES = (
    PlainFormat,
    AppendOnly(),
    SamplingParams(temperature=1.0),
    Budgets(max_turns=2, max_tokens_per_turn=10),
)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def _nudged(model, k):
    new = copy.deepcopy(model)
    with torch.no_grad():
        for i, p in enumerate(new.parameters()):
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i + 100 * k)))
    return new


def _pool(model, tokenizer):
    fmt, rule, sampling, budgets = PIECES
    return RayRolloutPool(
        model,
        fmt(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        num_workers=1,
        envs=WorkerEnvs("calculator"),
        rule=rule,
        sampling=sampling,
        budgets=budgets,
        engine_settings=SETTINGS,
        torch_threads=torch.get_num_threads(),  # the same bits as in-process
        cpus_per_worker=1.0,
    )


def test_a_ray_worker_holds_the_same_snapshots_as_in_process_and_after_a_rebuild(tokenizer, small_model):
    tasks = list(islice(make_tasks("calculator", "train", 1), 3))
    updates = [_nudged(small_model, k).state_dict() for k in (1, 2, 3)]
    fmt, rule, sampling, budgets = PIECES
    engine = HFEngine.with_settings(
        copy.deepcopy(small_model),
        SETTINGS,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    for v, sd in enumerate(updates, start=1):
        engine.update_weights(sd, version=v)
    setup = RolloutSetup(lambda t: make_env("calculator"), engine, fmt(tokenizer), rule, sampling, budgets)
    reference = asyncio.run(rollout_groups(tasks, 2, setup, seed=3))
    assert len({v for g in reference for t in g.trajectories for v in t.token_versions}) > 1

    pool = _pool(small_model, tokenizer)
    try:
        for v, sd in enumerate(updates, start=1):
            pool.sync_weights(sd, version=v)
        assert pool.rollout_groups(tasks, 2, seed=3) == reference
        os.kill(pool.worker_pids()[0], signal.SIGKILL)
        pool.rollout_groups(tasks, 2, seed=3)  # infra_failed; the worker is rebuilt
        assert pool.replaced and pool.rollout_groups(tasks, 2, seed=3) == reference
    finally:
        pool.close()

    resumed = _pool(small_model, tokenizer)  # a resume: the checkpoint's snapshots, then the weights
    try:
        resumed.load_snapshots(engine.snapshot_state())
        resumed.sync_weights(updates[-1], version=3)
        assert resumed.rollout_groups(tasks, 2, seed=3) == reference
    finally:
        resumed.close()
