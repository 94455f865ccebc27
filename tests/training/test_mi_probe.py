"""The MI probe (training/loop/mi_probe.py) on the small random model: which rows it scores, that each
score is the teacher-forced log-prob of the action under the prompt, and that it leaves the model,
its mode and every RNG as it found them."""

import copy
import math
import random

import pytest
import torch

from steprl.training.learn.batching import token_logprobs
from steprl.training.loop.mi_probe import mi_probe, probe_groups, score_matrix
from steprl.types import EndReason, Step, Trajectory
from tiny_runs import make_learner

KEYS = {"health/mi", "health/mi_retrieval_acc", "health/mi_retrieval_gap", "health/mi_chance"}
KEYS |= {"health/mi_prompts", "time/health_mi_probe_s"}


def _learner(model, temperature=1.0, pack=False):
    return make_learner(copy.deepcopy(model), micro_batch_size=5, temperature=temperature, pack=pack)


def _traj(group, prompt, action):
    step = Step(tuple(prompt), tuple(action), (0.0,) * len(action), (), 0.0, 0)
    return Trajectory(f"task-{group}", f"g-{group}", "calculator", (step,), 0.0, EndReason.ANSWERED)


def _ids(g, n):
    return torch.randint(4, 60, (n,), generator=g).tolist()


def _rollouts(groups, per_group, *, shared_actions=False, seed=0):
    """`groups` groups of `per_group` one-step trajectories: distinct random prompts (lengths 3..6)
    and random actions (lengths 1..4); `shared_actions`: every group samples the same actions."""
    g = torch.Generator().manual_seed(seed)
    actions = [_ids(g, 1 + a % 4) for a in range(per_group)]
    out = []
    for i in range(groups):
        prompt = _ids(g, 3 + i % 4)
        for a in range(per_group):
            out.append(_traj(i, prompt, actions[a] if shared_actions else _ids(g, 1 + (a + i) % 4)))
    return out


def test_keys_chance_range_determinism_rng_and_mode(small_model):
    learner = _learner(small_model)
    learner.model.train()
    trajs = _rollouts(5, 3)
    rng = torch.get_rng_state(), random.getstate()
    first = mi_probe(learner, trajs, prompts=4, samples=2)
    second = mi_probe(learner, trajs, prompts=4, samples=2)
    assert set(first) == KEYS
    assert first["health/mi_prompts"] == 4 and first["health/mi_chance"] == 0.25
    assert 0.0 <= first["health/mi_retrieval_acc"] <= 1.0
    assert first["health/mi_retrieval_gap"] == first["health/mi_retrieval_acc"] - 0.25
    assert -math.inf < first["health/mi"] <= math.log(4) + 1e-12
    first.pop("time/health_mi_probe_s"), second.pop("time/health_mi_probe_s")
    assert first == second  # bit-equal
    assert torch.equal(torch.get_rng_state(), rng[0]) and random.getstate() == rng[1]
    assert learner.model.training and all(m.training for m in learner.model.modules())
    learner.model.eval()
    mi_probe(learner, trajs, prompts=4, samples=2)
    assert not any(m.training for m in learner.model.modules())


@pytest.mark.parametrize("temperature,pack", [(1.0, False), (0.7, True)])
def test_each_score_is_the_teacher_forced_logprob_of_the_action(small_model, temperature, pack):
    learner = _learner(small_model, temperature, pack)
    groups = probe_groups(_rollouts(3, 2, seed=1), 3, 2)
    s = score_matrix(learner, groups)
    assert s.shape == (3, 3, 2)
    model = learner.model.eval()
    for j, i, k in [(0, 0, 0), (2, 1, 1), (1, 2, 0)]:
        prompt, action = groups[j][0], groups[i][1][k]
        ids = torch.tensor([prompt + action])
        with torch.no_grad():
            lp, _ = token_logprobs(model, ids, torch.ones_like(ids), temperature)
        want = float(lp[0, len(prompt) - 1 :].double().sum())
        assert s[j, i, k].item() == pytest.approx(want, abs=1e-5)


def test_the_same_actions_under_every_prompt_retrieve_at_chance(small_model):
    """Actions copied across prompts: a reasoning's scores depend on its copy only, so all N copies
    pick the same best prompt and exactly one is right (accuracy 1/N), and MI <= 0 (a mean of logs
    is at most the log of the mean)."""
    out = mi_probe(_learner(small_model), _rollouts(4, 3, shared_actions=True), prompts=4, samples=3)
    assert out["health/mi_retrieval_acc"] == 0.25 and out["health/mi_retrieval_gap"] == 0.0
    assert out["health/mi"] <= 1e-12


def test_which_groups_are_picked():
    g = torch.Generator().manual_seed(3)
    short = [_traj(0, [5, 6], _ids(g, 2))]  # one trajectory: too few
    empty = [_traj(1, [7, 8], [])] * 2  # first actions without tokens do not count
    twin = [_traj(2, [9, 10], _ids(g, 2)) for _ in range(2)]
    same_prompt = [_traj(3, [9, 10], _ids(g, 2)) for _ in range(2)]  # twin's prompt again
    picked = [_traj(4, [11], _ids(g, 1)) for _ in range(3)]
    groups = probe_groups(short + empty + twin + same_prompt + picked, prompts=8, samples=2)
    assert [p for p, _ in groups] == [(9, 10), (11,)]
    assert groups[1][1] == [picked[0].steps[0].action_ids, picked[1].steps[0].action_ids]
    assert probe_groups(twin + same_prompt + picked, prompts=1, samples=2) == groups[:1]


def test_fewer_than_two_usable_groups_give_nothing(small_model):
    learner = _learner(small_model)
    assert mi_probe(learner, _rollouts(1, 4), prompts=8, samples=4) == {}
    assert mi_probe(learner, _rollouts(3, 2), prompts=8, samples=4) == {}
    assert mi_probe(learner, [], prompts=8, samples=4) == {}


def test_lora_goes_through_learner_model_and_its_dropout_is_off(small_model):
    pytest.importorskip("peft")
    from types import SimpleNamespace

    from steprl.training.learn.lora import apply_lora

    spec = SimpleNamespace(r=4, alpha=8.0, dropout=0.5, target_modules=["q_proj", "v_proj"])
    lora = _learner(apply_lora(copy.deepcopy(small_model), spec))
    trajs = _rollouts(3, 2, seed=2)
    fresh = mi_probe(lora, trajs, prompts=3, samples=2)  # B = 0: the base model's numbers
    base = mi_probe(_learner(small_model), trajs, prompts=3, samples=2)
    assert fresh["health/mi"] == pytest.approx(base["health/mi"], abs=1e-5)
    with torch.no_grad():  # nonzero adapters: now dropout in them would change the scores
        g = torch.Generator().manual_seed(4)
        for p in lora.model.parameters():
            if p.requires_grad:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    lora.model.train()
    in_train = mi_probe(lora, trajs, prompts=3, samples=2)
    assert lora.model.training
    lora.model.eval()
    in_eval = mi_probe(lora, trajs, prompts=3, samples=2)
    assert in_train["health/mi"] == in_eval["health/mi"] != fresh["health/mi"]
