"""The algorithm options run together in the real trainer: names and parameters from the config
reach the estimator, loss, filter and regularisers, the critic is trained, skipped steps are clean.

Tiny model and budgets: this checks wiring (names, critic plumbing, skipped steps), not learning,
in a few runs rather than one per name. Each registered estimator, loss and filter keeps its
contract in tests/algorithms/test_registry_contracts.py (no model: milliseconds). Learning per
estimator is measured by benchmarks/algorithms.py.
"""

import itertools
import math

import pytest

from steprl.algorithms.losses import adaptive_kl_beta
from steprl.config import ConfigError, load_config
from steprl.training.loop.trainer import train
from tiny_runs import QUIET, small_config

pytestmark = pytest.mark.e2e

# three tasks a step (12 trajectories), shorter turns, no evaluation
TINY = [
    *QUIET,
    "rollout.tasks_per_step=3",
    "rollout.max_tokens_per_turn=20",
    "trainer.eval_tasks=4",
    "trainer.eval_every=0",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sft-cache")


def _run(tmp_path, cache_dir, extra):
    cfg = small_config(tmp_path, "combo", [*TINY, *extra], cache_dir=cache_dir)
    result = train(cfg, log=lambda s: None)
    for m in result.history:
        # regenerations (DAPO dynamic sampling) roll out extra groups of 3 tasks x 4
        assert m["traj/in"] == m["traj/out"] == 12 * (1 + m["filter/regenerations"])
        for key, value in m.items():
            assert not math.isnan(value), key
    return result


# Two runs carry every option at once: one with a critic (the GAE family's plumbing: values from
# a shared critic, step values, a critic loss) and one group-based on step rows. What each
# estimator, loss and filter computes is checked without a model, over every registry entry, in
# tests/algorithms/test_registry_contracts.py; the aggregations through the learner in
# tests/training/test_learner_invariance.py; a separate critic (gae) in tests/training/test_resume.py.
CRITIC_RUN = [
    "algorithm.advantage=step_gae",
    "algorithm.advantage_params={gamma: 1.0, lam: 0.95}",
    "algorithm.critic=shared",
    "algorithm.policy_loss=decoupled_ppo",
    "algorithm.loss_params={behav_cap: 5.0, clip_low: 0.2, clip_high: 0.28, dual_clip_c: 3.0}",
    "algorithm.aggregation=seq-mean-token-sum-norm",
    "algorithm.loss_scale_factor=40",
    "algorithm.kl_coef=0.01",
    "algorithm.kl_kind=k3",
    "algorithm.entropy_coef=0.001",
    "algorithm.overlong={max_len: 30, cache_len: 10, penalty: 1.0}",
    "algorithm.group_filter=starpo_s",  # keeps at least one group: every step updates
    "algorithm.filter_params={ratio: 0.5}",
]
GROUP_RUN = [
    "algorithm.advantage=gigpo",
    "algorithm.advantage_params={gamma: 0.95}",
    "rollout.context=keep_last_k",  # one row per step; GiGPO's anchors from real observations
    "algorithm.policy_loss=loop_clip",
    "algorithm.loss_params={eps: 0.1}",
    "algorithm.min_abs_advantage=0.01",
    "algorithm.aggregation=seq-mean-token-mean",
    "algorithm.group_filter=dapo",
    "algorithm.filter_regenerations=2",
    "algorithm.task_normalize=true",
    "algorithm.empg={k: 1.0, k_f: 1.0, zeta: 0.1}",
    "algorithm.kl_coef=0.05",
    "algorithm.kl_in=reward",
    "algorithm.kl_kind=k1",
]


def test_a_critic_run_with_every_loss_option_trains(tmp_path, cache_dir):
    history = _run(tmp_path, cache_dir, CRITIC_RUN).history
    assert all(math.isfinite(m["critic/value_loss"]) for m in history)  # the shared critic trained
    assert all(m["actor/optimizer_steps"] > 0 for m in history)
    assert history[-1]["policy/version"] >= 1


def test_a_group_run_on_step_rows_with_every_shaping_option_trains(tmp_path, cache_dir):
    history = _run(tmp_path, cache_dir, GROUP_RUN).history
    assert "critic/value_loss" not in history[-1]  # no critic for a critic-free estimator


def test_empty_batch_after_filtering_skips_the_step(tmp_path, cache_dir):
    # Greedy sampling makes every rollout of a task identical: every group has zero reward
    # variance, DAPO keeps none even after regenerating, and the step must be skipped cleanly.
    greedy_dapo = ["rollout.temperature=0", "algorithm.group_filter=dapo", "algorithm.filter_regenerations=1"]
    result = _run(tmp_path, cache_dir, greedy_dapo)
    for m in result.history:
        assert m["filter/skipped_step"] == 1.0 and m["filter/regenerations"] == 1.0
        assert m["train/rows"] == 0 and m["actor/optimizer_steps"] == 0
    assert result.history[-1]["policy/version"] == 0  # no update was pushed


def test_the_adaptive_kl_coefficient_follows_its_controller(tmp_path, cache_dir):
    """KL in the reward with kl_ctrl=adaptive: each step's coefficient is the last one moved by
    the observed KL (verl AdaptiveKLController); with kl_ctrl=fixed it stays kl_coef."""
    kl = ["algorithm.kl_coef=0.01", "algorithm.kl_in=reward", "trainer.total_steps=3"]
    adaptive = ["algorithm.kl_ctrl=adaptive", "algorithm.kl_target=0.001", "algorithm.kl_horizon=100"]
    history = _run(tmp_path, cache_dir, [*kl, *adaptive]).history
    assert history[0]["actor/reward_kl_coef"] == 0.01
    for before, after in itertools.pairwise(history):
        expected = adaptive_kl_beta(
            before["actor/reward_kl_coef"], before["actor/reward_kl"], 0.001, int(before["train/rows"]), 100
        )
        assert after["actor/reward_kl_coef"] == pytest.approx(expected, rel=1e-12)
    assert len({m["actor/reward_kl_coef"] for m in history}) == 3  # it moved every step
    fixed = _run(tmp_path / "fixed", cache_dir, kl).history
    assert [m["actor/reward_kl_coef"] for m in fixed] == [0.01] * 3


def test_bad_algorithm_params_name_the_allowed_keys():
    with pytest.raises(ConfigError, match="allowed keys"):
        load_config(None, ["algorithm.advantage=gigpo", "algorithm.advantage_params={gama: 0.9}"])
    with pytest.raises(ConfigError, match="critic"):
        load_config(None, ["algorithm.advantage=gae", "algorithm.advantage_params={}"])
    with pytest.raises(ConfigError, match="loss_scale_factor"):
        load_config(None, ["algorithm.aggregation=seq-mean-token-sum-norm"])
    with pytest.raises(ConfigError, match="kl_in=reward"):
        load_config(None, ["algorithm.kl_ctrl=adaptive", "algorithm.kl_coef=0.001"])  # KL in the loss
    with pytest.raises(ConfigError, match="kl_ctrl"):
        load_config(None, ["algorithm.kl_ctrl=pid"])
