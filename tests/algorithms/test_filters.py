"""Group filters and overlong shaping: vectors, ties, empty batches, zero-std batches."""

import pytest
import torch

from steprl.algorithms.filters import (
    dapo_keep,
    group_reward_std,
    loop_abs_adv_keep,
    overlong_shaping,
    ragen2_top_p_keep,
    starpo_s_keep,
)


def _t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


# ---------------------------------------------------------------------------- group_reward_std


def test_group_reward_std_values_and_degenerate_groups():
    groups = [_t(1, 0, 0, 1), _t(0.1, 0.1, 0.1), _t(3), _t()]
    unbiased = group_reward_std(groups)
    assert unbiased.dtype == torch.float32 and unbiased.shape == (4,)
    assert unbiased[0].item() == pytest.approx(0.57735, abs=1e-5)
    assert unbiased[1:].tolist() == [0.0, 0.0, 0.0]  # all-equal, singleton, empty: 0, never NaN
    assert group_reward_std(groups, unbiased=False)[0].item() == pytest.approx(0.5)
    assert group_reward_std([]).shape == (0,)


def test_tensor_input_must_be_two_dimensional():
    assert group_reward_std(torch.tensor([[1.0, 0.0], [2.0, 2.0]])).tolist() == pytest.approx(
        [0.70711, 0.0], abs=1e-5
    )
    with pytest.raises(ValueError, match="must be \\(G, K\\)"):
        dapo_keep(torch.tensor([1.0, 0.0]))


def test_non_finite_reward_raises():
    with pytest.raises(ValueError, match="non-finite"):
        dapo_keep([_t(1, float("nan"))])
    with pytest.raises(ValueError, match="non-finite"):
        starpo_s_keep([_t(1, float("inf"))])


# ---------------------------------------------------------------------------- DAPO


def test_dapo_keep_vector():
    kept = dapo_keep([_t(1, 0, 1), _t(1, 1, 1), _t(0.5), _t(0, 0)])
    assert kept.dtype == torch.long and kept.tolist() == [0, 2]


def test_dapo_equal_floats_are_zero_std_despite_rounding():
    assert dapo_keep([_t(0.1, 0.1, 0.1), _t(0.7, 0.7)]).tolist() == []


def test_dapo_empty_and_all_zero_std():
    assert dapo_keep([]).tolist() == [] and dapo_keep([]).dtype == torch.long
    assert dapo_keep(torch.ones(4, 8)).tolist() == []
    assert dapo_keep(torch.zeros(0, 8)).tolist() == []
    assert dapo_keep([_t()]).tolist() == []  # a group with no rollouts is dropped


# ---------------------------------------------------------------------------- StarPO-S


def _eight_groups():
    # stds (unbiased): 0, .7071, 0, 1.4142, .7071, 0, 2.1213, 0
    return torch.tensor([[0, 0], [0, 1], [1, 1], [0, 2], [1, 0], [2, 2], [3, 0], [5, 5]], dtype=torch.float32)


def test_starpo_s_keeps_top_quarter_by_std():
    assert starpo_s_keep(_eight_groups(), 0.25).tolist() == [3, 6]
    assert starpo_s_keep(_eight_groups(), 0.25, mode="std_rev").tolist() == [0, 2]


def test_starpo_s_ties_go_to_the_lower_index():
    # 3 groups kept of 8 (floor(0.375 * 8) = 3): 6, 3, then the tie 1 vs 4 -> 1
    assert starpo_s_keep(_eight_groups(), 0.375).tolist() == [1, 3, 6]


def test_starpo_s_ratio_edges():
    groups = _eight_groups()
    assert starpo_s_keep(groups, 1.0).tolist() == list(range(8))
    assert starpo_s_keep(groups, 0.01).tolist() == [6]  # floor(0.08) = 0 -> at least one group
    assert starpo_s_keep(torch.rand(10, 4), 0.3).numel() == 3  # 0.3 * 10 = 3.0000000000000004
    assert starpo_s_keep(torch.rand(100, 4), 0.29).numel() == 29  # 0.29 * 100 = 28.999999999999996
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="ratio"):
            starpo_s_keep(groups, bad)
    with pytest.raises(ValueError, match="mode"):
        starpo_s_keep(groups, 0.25, mode="var")


def test_starpo_s_empty_and_all_zero_std():
    assert starpo_s_keep([], 0.25).tolist() == []
    # zero-std groups are not removed: an all-flat batch keeps the first k groups
    assert starpo_s_keep(torch.ones(8, 4), 0.25).tolist() == [0, 1]


# ---------------------------------------------------------------------------- RAGEN-2


def test_ragen2_linear_top_p_vector():
    scores = _t(0.5, 0.0, 0.3, 0.2)
    assert ragen2_top_p_keep(scores, 0.9).tolist() == [0, 2, 3]  # threshold .89
    assert ragen2_top_p_keep(scores, 0.8).tolist() == [0, 2]  # threshold .79
    assert ragen2_top_p_keep(scores, 0.5).tolist() == [0]  # threshold .49
    assert ragen2_top_p_keep(scores, 0.5, include_zero=True).tolist() == [0]


def test_ragen2_ties_and_filter_off():
    assert ragen2_top_p_keep(_t(0.3, 0.3, 0.4), 0.5).tolist() == [0, 2]
    assert ragen2_top_p_keep(_t(0.5, 0.0, 0.3), 1.0).tolist() == [0, 2]
    assert ragen2_top_p_keep(_t(0.5, 0.0, 0.3), 1.0, include_zero=True).tolist() == [0, 1, 2]


def test_ragen2_empty_cases():
    empty = ragen2_top_p_keep(torch.zeros(0))
    assert empty.dtype == torch.long and empty.tolist() == []
    assert ragen2_top_p_keep(torch.zeros(6)).tolist() == []
    assert ragen2_top_p_keep(torch.zeros(6), include_zero=True).tolist() == []  # threshold -eps
    assert ragen2_top_p_keep(_t(-1.0, -2.0), include_zero=True).tolist() == []  # non-positive only
    with pytest.raises(ValueError):
        ragen2_top_p_keep(_t(0.1), 0.0)
    with pytest.raises(ValueError, match="non-finite"):
        ragen2_top_p_keep(_t(0.1, float("nan")))


def test_ragen2_on_group_std_pipeline():
    std = group_reward_std(_eight_groups())
    kept = ragen2_top_p_keep(std, 0.9)
    # stds 2.12, 1.41, .71, .71 (sum 4.95, threshold 4.445): 2.12 + 1.41 + .71 = 4.24, + .71 -> all 4
    assert kept.tolist() == [1, 3, 4, 6]
    # p = .7: threshold 3.455; 2.12 + 1.41 = 3.54 reaches it
    assert ragen2_top_p_keep(std, 0.7).tolist() == [3, 6]


# ---------------------------------------------------------------------------- LOOP


def test_loop_abs_adv_keep():
    adv = _t(0.5, -0.005, 0.01, -0.01, 0.0, -2.0)
    assert loop_abs_adv_keep(adv).tolist() == [0, 2, 3, 5]  # inclusive at the threshold
    assert loop_abs_adv_keep(adv, threshold=0.0).tolist() == list(range(6))
    assert loop_abs_adv_keep(torch.zeros(0)).tolist() == []
    assert loop_abs_adv_keep(torch.zeros(5)).tolist() == []  # all zero-variance groups
    with pytest.raises(ValueError, match="\\(N,\\)"):
        loop_abs_adv_keep(torch.zeros(2, 3))
    with pytest.raises(ValueError):
        loop_abs_adv_keep(_t(float("nan")))


# ---------------------------------------------------------------------------- overlong shaping


def test_overlong_dapo_vector():
    lengths = torch.tensor([16000, 16384, 18432, 20480, 20481, 30000])
    out = overlong_shaping(lengths, max_len=20480, cache_len=4096)
    assert out.dtype == torch.float32
    assert out.tolist() == [0.0, 0.0, -0.5, -1.0, -1.0, -1.0]
    half = overlong_shaping(lengths, max_len=20480, cache_len=4096, penalty=0.5)
    assert half.tolist() == [0.0, 0.0, -0.25, -0.5, -0.5, -0.5]


def test_overlong_edges():
    assert overlong_shaping(torch.zeros(0, dtype=torch.long), max_len=10, cache_len=2).shape == (0,)
    assert overlong_shaping(torch.tensor([10, 11]), max_len=10, cache_len=0).tolist() == [0.0, -1.0]
    assert overlong_shaping(torch.tensor([10]), max_len=10, cache_len=10).tolist() == [-1.0]
    with pytest.raises(ValueError, match="cache_len"):
        overlong_shaping(torch.tensor([1]), max_len=10, cache_len=11)
    with pytest.raises(ValueError, match="penalty"):
        overlong_shaping(torch.tensor([1]), max_len=10, cache_len=2, penalty=-1.0)
