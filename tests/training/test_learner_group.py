"""The learner on two FSDP2 ranks (Ray actors, gloo) equals the learner in one process: the same
rows, the same shuffle, the same log-probs, update stats and weights within 1e-5 relative; the
group passes `check_learner`; a dead rank is one line naming it."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from steprl.algorithms import POLICY_LOSSES
from steprl.training.learn.learner_protocol import check_learner
from tiny_runs import make_learner

pytestmark = pytest.mark.usefixtures("ray_local")


def _settings(**over):
    spec = POLICY_LOSSES.lookup("ppo_clip")
    return {
        "policy_loss": functools.partial(spec.fn),
        "needs_proximal": spec.needs_proximal,
        "aggregation": "token-mean",
        "loss_scale_factor": None,
        "lr": 1e-3,
        "weight_decay": 0.0,
        "betas": (0.9, 0.999),
        "grad_clip": 1.0,
        "micro_batch_size": 2,
        "pad_id": 0,
        "temperature": 1.0,
    } | over


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.fixture(scope="module")
def ray_local():
    import ray

    from steprl.hosting.ray_backend import ensure_ray

    ensure_ray(num_cpus=2)
    yield
    ray.shutdown()


def test_two_ranks_update_as_one_process_does(small_model, advantage_rows):
    from steprl.training.learn.learner_group import LearnerGroup

    one = make_learner(copy.deepcopy(small_model).train(), **_settings())
    group = LearnerGroup(copy.deepcopy(small_model).train(), _settings(), ranks=2, timeout_s=120)
    try:
        rows = advantage_rows
        a, b = (
            one.compute(rows, logprobs=True, entropies=True),
            group.compute(rows, logprobs=True, entropies=True),
        )
        worst = max(_rel(x, y) for x, y in zip(b.logprobs, a.logprobs, strict=True))
        g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        s1 = one.update(rows, epochs=2, mini_batches=2, generator=g1)
        s2 = group.update(rows, epochs=2, mini_batches=2, generator=g2)
        assert torch.equal(g1.get_state(), g2.get_state()), (
            "the controller's generator drew what one process draws"
        )
        assert set(s1) == set(s2)
        for k in s1:
            assert s2[k] == pytest.approx(s1[k], rel=1e-5, abs=1e-7), k
        w1, w2 = one.weights(1).full(), group.weights(1).full()
        gathered = group._all("gathering", "full_state")[0]  # torch's own full-state gather
        assert set(w2) == set(gathered) and all(torch.equal(w2[k], gathered[k]) for k in w2)
        assert set(w1) == set(w2)
        worst = max(worst, *(_rel(w2[k], w1[k]) for k in w1))
        print(f"largest relative difference (log-probs, weights after 4 optimizer steps): {worst:.2e}")
        assert worst < 1e-5
    finally:
        group.close()


def test_the_group_passes_check_learner(small_model, advantage_rows):
    from steprl.training.learn.learner_group import LearnerGroup

    check_learner(
        lambda: LearnerGroup(copy.deepcopy(small_model).train(), _settings(), ranks=2, timeout_s=120),
        advantage_rows,
    )
