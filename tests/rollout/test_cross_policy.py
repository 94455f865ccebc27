"""Cross-policy sampling (`engines/snapshots.py`): the per-turn version draw, what each
token records, K=1 (and an all-current draw) changing nothing, and the config's refusals."""

from __future__ import annotations

import asyncio
import copy
from itertools import islice

import pytest
import torch

from steprl.config import ConfigError, load_config
from steprl.engines.base import SamplingParams
from steprl.engines.hf import CurrentPolicy, HFEngine
from steprl.engines.snapshots import CrossPolicy, draw_lags
from steprl.envs.registry import make_env, make_tasks
from steprl.rollout.chat import PlainFormat
from steprl.rollout.context import AppendOnly
from steprl.rollout.loop import Budgets, RolloutSetup, rollout_groups


def test_the_draw_is_a_function_of_the_seed_and_follows_the_probabilities():
    policy = CrossPolicy((0.5, 0.3, 0.2))
    seeds = list(range(20000))
    lags = draw_lags(policy, 7, seeds)
    assert lags == draw_lags(policy, 7, seeds) and lags[::-1] == draw_lags(policy, 7, seeds[::-1])
    assert [draw_lags(policy, 7, [s])[0] for s in seeds[:50]] == lags[:50]  # alone or batched
    for lag, p in enumerate(policy.probs):
        assert abs(lags.count(lag) / len(seeds) - p) < 0.015
    assert draw_lags(CrossPolicy((0.0, 1.0, 0.0)), 7, seeds[:100]) == [1] * 100
    assert draw_lags(policy, 8, seeds[:200]) != lags[:200]  # the engine seed enters


def _weights(model, k):
    """Version k's weights: the model nudged k times."""
    new = copy.deepcopy(model)
    with torch.no_grad():
        for i, p in enumerate(new.parameters()):
            p.add_(0.3 * k * torch.randn(p.shape, generator=torch.Generator().manual_seed(i + 100 * k)))
    return new


def _rollouts(engine, tokenizer, n_tasks=4, group_size=3):
    setup = RolloutSetup(
        lambda t: make_env("calculator"),
        engine,
        PlainFormat(tokenizer),
        AppendOnly(),
        SamplingParams(temperature=1.0),
        Budgets(max_turns=3, max_tokens_per_turn=12),
    )
    tasks = list(islice(make_tasks("calculator", "train", 2), n_tasks))
    groups = asyncio.run(rollout_groups(tasks, group_size, setup, seed=1))
    return [t for g in groups for t in g.trajectories]


def _engine(model, tokenizer, cross_policy=None):
    return HFEngine(
        copy.deepcopy(model),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        seed=3,
        cross_policy=cross_policy,
    )


@pytest.fixture(scope="module")
def versions(small_model):
    return [small_model, _weights(small_model, 1), _weights(small_model, 2)]


@torch.no_grad()
def _logprobs(model, prompt, action):
    ids = torch.tensor([[*prompt, *action]])
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    return [float(logp[len(prompt) - 1 + i, tok]) for i, tok in enumerate(action)]


def test_each_token_records_the_snapshot_that_sampled_it_and_that_snapshots_logprob(tokenizer, versions):
    engine = _engine(versions[0], tokenizer, CrossPolicy((0.4, 0.3, 0.3)))
    for v in (1, 2):
        engine.update_weights(versions[v].state_dict(), version=v)
    trajectories = _rollouts(engine, tokenizer)
    seen = set()
    for t in trajectories:
        for s in t.steps:
            (v,) = set(s.token_versions)  # one version per turn (none changes mid-turn here)
            seen.add(v)
            expected = _logprobs(versions[v], s.prompt_ids, s.action_ids)
            assert max(abs(a - b) for a, b in zip(s.action_logprobs, expected, strict=True)) < 1e-4
    assert seen == {0, 1, 2}
    # evaluation: the current weights only
    current = _rollouts(CurrentPolicy(engine), tokenizer, n_tasks=2)
    assert {v for t in current for v in t.token_versions} == {2}


def test_k1_and_an_all_current_draw_change_nothing(tokenizer, versions):
    def run(cross_policy):
        engine = _engine(versions[0], tokenizer, cross_policy)
        for v in (1, 2):
            engine.update_weights(versions[v].state_dict(), version=v)
        return _rollouts(engine, tokenizer, n_tasks=2)

    plain = run(None)
    assert run(CrossPolicy((1.0,))) == plain
    assert run(CrossPolicy((1.0, 0.0, 0.0))) == plain


def test_snapshots_round_trip_through_their_state(tokenizer, versions):
    engine = _engine(versions[0], tokenizer, CrossPolicy((0.2, 0.4, 0.4)))
    for v in (1, 2):
        engine.update_weights(versions[v].state_dict(), version=v)
    state = engine.snapshot_state()
    assert state["version"] == 2 and state["versions"] == [1, 0]
    other = _engine(versions[0], tokenizer, CrossPolicy((0.2, 0.4, 0.4)))
    other.load_snapshots(state)
    other.update_weights(versions[2].state_dict(), version=2)  # a resume's push: same version
    assert _rollouts(other, tokenizer, n_tasks=2) == _rollouts(engine, tokenizer, n_tasks=2)


DECOUPLED = ["algorithm.policy_loss=decoupled_ppo", "algorithm.loss_params={}"]


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["rollout.cross_policy={snapshots: 3}"], "rollout.cross_policy: algorithm.policy_loss=ppo_clip"),
        ([*DECOUPLED, "rollout.cross_policy={snapshots: 3, probs: [0.5, 0.5]}"], "rollout.cross_policy"),
        ([*DECOUPLED, "rollout.cross_policy={snapshots: 2, probs: [0.7, 0.7]}"], "rollout.cross_policy"),
        (
            [*DECOUPLED, "rollout.cross_policy={snapshots: 2, current_prob: 1.5}"],
            "rollout.cross_policy.current_prob",
        ),
    ],
)
def test_bad_cross_policy_configs_name_the_key(overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config("configs/calculator_tiny.yaml", overrides)
    assert words in str(err.value)
    ok = load_config(
        "configs/calculator_tiny.yaml",
        [*DECOUPLED, "rollout.cross_policy={snapshots: 3, current_prob: 0.5}"],
    )
    assert ok.rollout.cross_policy is not None and ok.rollout.cross_policy.resolved() == (0.5, 0.25, 0.25)
