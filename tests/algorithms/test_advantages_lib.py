"""Hand-computed vectors, edge cases and invariants for the advantage library.

Vectors come from reference/algorithms.md (section cited per test) or are worked by hand in the
comments. Every zero-std / singleton / fully-masked / empty decision documented in
`steprl.algorithms.advantages` has a test here.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steprl.algorithms.advantages import (
    bi_level_gae,
    gae,
    grpo_env_std,
    loop,
    masked_whiten,
    normalize_by_task,
    reinforce_pp,
    reinforce_pp_baseline,
    rloo,
)
from steprl.algorithms.step_advantages import empg, gigpo, spread_steps, step_gae

FAST = settings(max_examples=60, deadline=None)
LONG = torch.long


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def no_nan(*xs: torch.Tensor) -> bool:
    return all(not torch.isnan(x).any() for x in xs)


# ---------------------------------------------------------------------------------------------
# masked_whiten (algorithms.md §0.4)
# ---------------------------------------------------------------------------------------------


def test_masked_whiten_vector_ignores_masked_entries():
    # valid [1, 2, 3]: mean 2, unbiased var 1 -> [-1, 0, 1]; the masked 99 is neither used nor kept
    out = masked_whiten(torch.tensor([[1.0, 2.0, 3.0, 99.0]]), torch.tensor([[1, 1, 1, 0]]))
    assert torch.allclose(out, torch.tensor([[-1.0, 0.0, 1.0, 0.0]]), atol=1e-6)
    assert out[0, 3] == 0


def test_masked_whiten_statistics_span_the_whole_batch():
    x = torch.tensor([[1.0, 1.0, 0.0], [5.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # valid [1, 1, 5]: mean 7/3, unbiased var ((4/3)^2*2 + (8/3)^2)/2 = 16/3
    std = math.sqrt(16 / 3)
    expected = torch.tensor([[-4 / 3 / std, -4 / 3 / std, 0.0], [8 / 3 / std, 0.0, 0.0]])
    assert torch.allclose(masked_whiten(x, m), expected, atol=1e-6)


def test_masked_whiten_shift_mean_false_keeps_the_mean():
    out = masked_whiten(torch.tensor([[1.0, 2.0, 3.0, 99.0]]), torch.tensor([[1, 1, 1, 0]]), shift_mean=False)
    assert torch.allclose(out, torch.tensor([[1.0, 2.0, 3.0, 0.0]]), atol=1e-6)


def test_masked_whiten_zero_and_one_valid_token_never_raise_never_nan():
    x = torch.tensor([[3.0, 4.0]])
    assert torch.equal(masked_whiten(x, torch.zeros(1, 2)), torch.zeros(1, 2))
    one = masked_whiten(x, torch.tensor([[0, 1]]))
    assert torch.equal(one, torch.zeros(1, 2))  # variance 0 for one entry -> centred value 0
    assert torch.equal(masked_whiten(x, torch.tensor([[0, 1]]), shift_mean=False), torch.tensor([[0.0, 4.0]]))


def test_masked_whiten_flat_is_exactly_zero_and_empty_is_empty():
    out = masked_whiten(torch.full((2, 3), 0.1), torch.ones(2, 3))
    assert torch.equal(out, torch.zeros(2, 3))
    empty = masked_whiten(torch.zeros(0, 5), torch.zeros(0, 5))
    assert empty.shape == (0, 5)


def test_masked_whiten_garbage_in_padding_does_not_leak():
    x = torch.tensor([[1.0, float("nan"), 3.0, float("inf")]])
    out = masked_whiten(x, torch.tensor([[1, 0, 1, 0]]))
    assert no_nan(out)
    assert torch.allclose(out, torch.tensor([[-1 / math.sqrt(2), 0.0, 1 / math.sqrt(2), 0.0]]), atol=1e-6)


@FAST
@given(
    st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=1, max_size=12),
    st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_masked_whiten_property_centred_and_finite(values, keep):
    x = torch.tensor(values)
    m = torch.tensor(keep[: len(values)])
    out = masked_whiten(x, m)
    assert torch.isfinite(out).all()
    assert torch.equal(out[~m], torch.zeros_like(out[~m]))
    if m.sum() >= 1:
        assert abs(float(out[m].mean())) < 1e-3


# ---------------------------------------------------------------------------------------------
# RLOO (§1.4) and LOOP (§2)
# ---------------------------------------------------------------------------------------------


def test_rloo_reference_vector():
    a = rloo(t(1.0, 0.0, 0.0, 1.0), torch.zeros(4, dtype=LONG))
    assert torch.allclose(a, t(2 / 3, -2 / 3, -2 / 3, 2 / 3), atol=1e-6)


def test_rloo_matches_leave_one_out_definition_across_unordered_groups():
    r = t(3.0, 1.0, 0.5, 2.0, 4.0)
    g = torch.tensor([9, 2, 9, 2, 9])
    a = rloo(r, g)
    for i in range(5):
        others = [float(r[j]) for j in range(5) if j != i and g[j] == g[i]]
        assert a[i].item() == pytest.approx(float(r[i]) - sum(others) / len(others), abs=1e-6)


def test_rloo_group_of_one_is_zero_and_flat_group_exactly_zero():
    assert torch.equal(rloo(t(0.7, 0.1), torch.tensor([0, 1])), torch.zeros(2))
    assert torch.equal(rloo(torch.full((5,), 0.1), torch.zeros(5, dtype=LONG)), torch.zeros(5))
    assert rloo(torch.zeros(0), torch.zeros(0, dtype=LONG)).shape == (0,)


@FAST
@given(st.lists(st.tuples(st.integers(0, 3), st.floats(-10, 10, width=32)), min_size=1, max_size=16))
def test_rloo_property_sums_to_zero_within_groups(items):
    g = torch.tensor([i for i, _ in items])
    r = torch.tensor([v for _, v in items])
    a = rloo(r, g)
    assert no_nan(a)
    for gid in g.unique():
        sel = g == gid
        if sel.sum() >= 2:
            assert abs(float(a[sel].sum())) < 1e-3
        else:
            assert float(a[sel]) == 0.0


def test_loop_baselines_and_std_scaling():
    r, g = t(1.0, 0.0, 0.0, 1.0), torch.zeros(4, dtype=LONG)
    assert torch.equal(loop(r, g), rloo(r, g))
    assert torch.allclose(loop(r, g, baseline="leave_none_out"), t(0.5, -0.5, -0.5, 0.5))
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert torch.allclose(
        loop(r, g, baseline="leave_none_out", scale_by_std=True), t(0.5, -0.5, -0.5, 0.5) / std, atol=1e-5
    )
    assert torch.allclose(loop(r, g, scale_by_std=True), t(2, -2, -2, 2) / 3 / std, atol=1e-5)


def test_loop_std_floor_is_max_not_plus():
    # std of [0, 1e-9] is ~7e-10 < 1e-7, so the divisor is exactly the floor 1e-7
    r = torch.tensor([0.0, 1e-9], dtype=torch.float64)
    a = loop(r, torch.zeros(2, dtype=LONG), baseline="leave_none_out", scale_by_std=True)
    assert torch.allclose(a, torch.tensor([-5e-10, 5e-10], dtype=torch.float64) / 1e-7)


def test_loop_edge_cases():
    one = loop(t(0.7), torch.tensor([0]), scale_by_std=True)
    assert torch.equal(one, torch.zeros(1))
    flat = loop(
        torch.full((4,), 0.3), torch.zeros(4, dtype=LONG), baseline="leave_none_out", scale_by_std=True
    )
    assert torch.equal(flat, torch.zeros(4))
    assert loop(torch.zeros(0), torch.zeros(0, dtype=LONG)).shape == (0,)
    with pytest.raises(ValueError, match="leave_one_out"):
        loop(t(1.0, 0.0), torch.zeros(2, dtype=LONG), baseline="mean")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# REINFORCE++ and its baseline variant (§1.5)
# ---------------------------------------------------------------------------------------------


def test_reinforce_pp_skips_observation_tokens_and_whitens_over_the_batch():
    r = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    m = torch.tensor([[1, 0, 1, 1]])
    adv, ret = reinforce_pp(r, m, gamma=0.5)
    # G over valid tokens t3=1, t2=0.5, (t1 observation: skipped, not a reset), t0=0.25
    assert torch.allclose(ret, torch.tensor([[0.25, 0.0, 0.5, 1.0]]))
    g = torch.tensor([0.25, 0.5, 1.0])
    w = (g - g.mean()) / g.std()
    assert torch.allclose(adv, torch.tensor([[w[0], 0.0, w[1], w[2]]]), atol=1e-5)


def test_reinforce_pp_fully_masked_row_and_empty():
    r = torch.tensor([[0.0, 1.0], [5.0, 5.0], [0.0, 2.0]])
    m = torch.tensor([[1, 1], [0, 0], [1, 1]])
    adv, ret = reinforce_pp(r, m)
    assert torch.equal(adv[1], torch.zeros(2)) and torch.equal(ret[1], torch.zeros(2))
    assert no_nan(adv, ret)
    adv0, ret0 = reinforce_pp(torch.zeros(0, 4), torch.zeros(0, 4))
    assert adv0.shape == ret0.shape == (0, 4)


def test_reinforce_pp_baseline_vector():
    rewards = t(1.0, 0.0, 3.0)
    groups = torch.tensor([0, 0, 1])  # the last row is a group of one: mean 0, a = R
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    adv = reinforce_pp_baseline(rewards, groups, mask)
    tokens = torch.tensor([0.5, 0.5, -0.5, 3.0, 3.0, 3.0])  # a_b tiled over each row's valid tokens
    w = (tokens - tokens.mean()) / tokens.std()
    expected = torch.tensor([[w[0], w[1], 0.0], [w[2], 0.0, 0.0], [w[3], w[4], w[5]]])
    assert torch.allclose(adv, expected, atol=1e-5)


def test_reinforce_pp_baseline_flat_and_empty():
    adv = reinforce_pp_baseline(torch.full((4,), 0.1), torch.tensor([0, 0, 1, 1]), torch.ones(4, 3))
    assert torch.equal(adv, torch.zeros(4, 3))
    assert reinforce_pp_baseline(torch.zeros(0), torch.zeros(0, dtype=LONG), torch.zeros(0, 3)).shape == (
        0,
        3,
    )


# ---------------------------------------------------------------------------------------------
# Token-level GAE (§1.6)
# ---------------------------------------------------------------------------------------------


def test_gae_hand_vector_with_an_observation_token():
    r = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.4, 7.0, 0.2]])  # the 7.0 sits on an observation token: never used
    m = torch.tensor([[1, 1, 0, 1]])
    adv, ret = gae(r, v, m, gamma=0.9, lam=0.8, whiten=False)
    # t3: 1 - 0.2 = 0.8; t1: 0.9*0.2 - 0.4 + 0.72*0.8 = 0.356; t0: 0.9*0.4 - 0.5 + 0.72*0.356 = 0.11632
    assert torch.allclose(adv, torch.tensor([[0.11632, 0.356, 0.0, 0.8]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.61632, 0.756, 0.0, 1.0]]), atol=1e-6)


def test_gae_whitening_uses_valid_tokens_and_returns_are_pre_whitening():
    r = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    v = torch.tensor([[0.1, 0.2, 0.3], [0.0, 0.5, 0.5]])
    m = torch.tensor([[1, 1, 0], [1, 1, 1]])
    raw, ret = gae(r, v, m, gamma=0.9, lam=0.95, whiten=False)
    adv, ret2 = gae(r, v, m, gamma=0.9, lam=0.95)
    assert torch.equal(ret, ret2)
    assert torch.allclose(ret, torch.where(m.bool(), raw + v, torch.zeros_like(v)))
    assert torch.allclose(adv, masked_whiten(raw, m))


def _delete_masked(row: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return row[keep.bool()].unsqueeze(0)


@FAST
@given(
    st.lists(st.tuples(st.booleans(), st.floats(-2, 2, width=32), st.floats(-2, 2, width=32)), max_size=14),
    st.floats(0.5, 1.0),
    st.floats(0.0, 1.0),
    st.booleans(),
)
def test_gae_masked_observations_equal_deleted_columns(cols, gamma, lam, whiten):
    """Required invariance: interleaved masked tokens change nothing on the action tokens."""
    if not cols:
        cols = [(True, 1.0, 0.0)]
    keep = torch.tensor([c[0] for c in cols])
    r = torch.tensor([[c[1] for c in cols]])
    v = torch.tensor([[c[2] for c in cols]])
    # garbage on observation tokens must not matter either
    r_obs = torch.where(keep, r, torch.full_like(r, 123.0))
    v_obs = torch.where(keep, v, torch.full_like(v, -55.0))
    adv, ret = gae(r_obs, v_obs, keep[None], gamma=gamma, lam=lam, whiten=whiten)
    adv_d, ret_d = gae(
        _delete_masked(r[0], keep),
        _delete_masked(v[0], keep),
        torch.ones(1, int(keep.sum())),
        gamma=gamma,
        lam=lam,
        whiten=whiten,
    )
    assert torch.allclose(adv[0][keep], adv_d[0], atol=1e-5)
    assert torch.allclose(ret[0][keep], ret_d[0], atol=1e-5)
    assert torch.equal(adv[0][~keep], torch.zeros(int((~keep).sum())))


@FAST
@given(st.lists(st.tuples(st.booleans(), st.floats(-3, 3, width=32)), min_size=1, max_size=12))
def test_gae_lam1_gamma1_zero_values_is_reward_to_go_over_valid_tokens(cols):
    keep = torch.tensor([[c[0] for c in cols]])
    r = torch.tensor([[c[1] for c in cols]])
    adv, ret = gae(r, torch.zeros_like(r), keep, whiten=False)
    valid_r = torch.where(keep, r, torch.zeros_like(r))
    to_go = valid_r.flip(1).cumsum(1).flip(1)
    expected = torch.where(keep, to_go, torch.zeros_like(r))
    assert torch.allclose(adv, expected, atol=1e-4)
    assert torch.allclose(ret, expected, atol=1e-4)


def test_gae_fully_masked_row_nan_padding_and_empty():
    r = torch.tensor([[0.0, 1.0], [float("nan"), float("nan")]])
    v = torch.tensor([[0.2, float("nan")], [float("nan"), 0.0]])
    m = torch.tensor([[1, 0], [0, 0]])
    adv, ret = gae(r, v, m)
    assert no_nan(adv, ret)
    assert torch.equal(adv[1], torch.zeros(2)) and torch.equal(ret[1], torch.zeros(2))
    adv0, ret0 = gae(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, 3))
    assert adv0.shape == ret0.shape == (0, 3)


# ---------------------------------------------------------------------------------------------
# StepPO step-level GAE (§7) and spread_steps
# ---------------------------------------------------------------------------------------------


def test_step_gae_whitens_once_per_step():
    # traj 0: steps r [0, 1] (third step missing); traj 1: r [0, 0, 0]. gamma = lam = 1, V = 0:
    # A = [[1, 1, -], [0, 0, 0]] -> 5 entries, mean 0.4, unbiased var 0.3
    r = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv, ret = step_gae(r, torch.zeros_like(r), m)
    s = math.sqrt(0.3)
    expected = torch.tensor([[0.6 / s, 0.6 / s, 0.0], [-0.4 / s, -0.4 / s, -0.4 / s]])
    assert torch.allclose(adv, expected, atol=1e-5)
    assert torch.equal(ret, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    # one entry per step: a token-level whitening of the spread values (3 tokens on step 0 of
    # traj 0) would give different numbers
    valid = adv[m.bool()]
    assert abs(float(valid.mean())) < 1e-6 and float(valid.std()) == pytest.approx(1.0, abs=1e-5)


def test_step_gae_hand_vector():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.3, 0.6, 0.8]])
    adv, ret = step_gae(r, v, torch.ones(1, 3), gamma=0.99, lam=0.9, whiten=False)
    # s2: 1 - 0.8 = 0.2; s1: 0.99*0.8 - 0.6 + 0.891*0.2 = 0.3702; s0: 0.99*0.6 - 0.3 + 0.891*0.3702
    a1 = 0.99 * 0.8 - 0.6 + 0.891 * 0.2
    a0 = 0.99 * 0.6 - 0.3 + 0.891 * a1
    assert torch.allclose(adv, torch.tensor([[a0, a1, 0.2]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[a0 + 0.3, a1 + 0.6, 1.0]]), atol=1e-6)


def test_step_gae_skips_missing_interior_steps():
    r = torch.tensor([[0.0, 9.0, 1.0]])
    v = torch.tensor([[0.3, 9.0, 0.8]])
    adv, _ = step_gae(r, v, torch.tensor([[1, 0, 1]]), gamma=0.9, lam=0.7, whiten=False)
    compact, _ = step_gae(
        torch.tensor([[0.0, 1.0]]),
        torch.tensor([[0.3, 0.8]]),
        torch.ones(1, 2),
        gamma=0.9,
        lam=0.7,
        whiten=False,
    )
    assert torch.allclose(adv[0, [0, 2]], compact[0]) and adv[0, 1] == 0


def test_step_gae_flat_and_empty():
    adv, ret = step_gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3))
    assert torch.equal(adv, torch.zeros(2, 3)) and torch.equal(ret, torch.zeros(2, 3))
    adv0, _ = step_gae(torch.zeros(0, 0), torch.zeros(0, 0), torch.zeros(0, 0))
    assert adv0.shape == (0, 0)


def test_spread_steps_one_row_per_step_and_packed_rows():
    table = torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]])
    token_step = torch.tensor([[-1, 0, 0, -1], [-1, 1, -1, -1], [-1, 2, 2, 2], [0, 0, -1, 1]])
    row_traj = torch.tensor([0, 0, 1, 1])
    out = spread_steps(table, token_step, row_traj)
    expected = torch.tensor(
        [[0.0, 1.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0], [0.0, 5.0, 5.0, 5.0], [3.0, 3.0, 0.0, 4.0]]
    )
    assert torch.equal(out, expected)


def test_spread_steps_edge_cases():
    assert torch.equal(
        spread_steps(torch.zeros(0, 0), torch.full((2, 3), -1), torch.tensor([0, 1])), torch.zeros(2, 3)
    )
    with pytest.raises(ValueError, match="token_step"):
        spread_steps(torch.zeros(1, 2), torch.tensor([[0, 2]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="row_traj"):
        spread_steps(torch.zeros(1, 2), torch.tensor([[0, 1]]), torch.tensor([1]))


# ---------------------------------------------------------------------------------------------
# RAGEN bi-level GAE (§1.6, last paragraph)
# ---------------------------------------------------------------------------------------------


def test_bi_level_gae_hand_vector():
    # two turns [a0 a1|] obs [a3 a4|]; turn rewards 0.5 and 1 on the end tokens
    r = torch.tensor([[0.0, 0.5, 0.0, 0.0, 1.0]])
    v = torch.tensor([[0.1, 0.2, 9.0, 0.3, 0.4]])
    m = torch.tensor([[1, 1, 0, 1, 1]])
    end = torch.tensor([[False, True, False, False, True]])
    adv, ret = bi_level_gae(r, v, m, end, gamma=0.9, lam=0.8, high_level_gamma=0.5, whiten=False)
    # turn level (gamma_hi 0.5): A2 = 1 - 0.4 = 0.6; A1 = 0.5 + 0.5*0.4 - 0.2 + 0.5*0.8*0.6 = 0.74
    # token level: t4 = 0.6, t3 = 0.9*0.4 - 0.3 + 0.72*0.6 = 0.492, t1 = 0.74,
    #              t0 = 0.9*0.2 - 0.1 + 0.72*0.74 = 0.6128
    assert torch.allclose(adv, torch.tensor([[0.6128, 0.74, 0.0, 0.492, 0.6]]), atol=1e-6)
    # returns at turn ends are the turn-level returns G_k = A_k + V(e_k): 0.94 and 1.0
    assert torch.allclose(ret, torch.tensor([[0.7128, 0.94, 0.0, 0.792, 1.0]]), atol=1e-6)


def test_bi_level_gae_one_token_turns_is_gae_with_high_level_gamma():
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    m = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 1, 0, 1, 1]])
    a, ret = bi_level_gae(r, v, m, m.bool(), gamma=0.3, lam=0.9, high_level_gamma=0.95)
    b, ret_b = gae(r, v, m, gamma=0.95, lam=0.9)
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(ret, ret_b, atol=1e-5)


def test_bi_level_gae_truncated_last_turn_and_masked_step_end():
    g = torch.Generator().manual_seed(1)
    r, v = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    m = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 0]])
    # no step_end at all (and one on a masked token, ignored): the last valid token closes the one
    # turn, which is then plain token-level GAE with `gamma`
    end = torch.tensor([[False, False, False, True, False], [False, False, False, False, True]])
    a, ret = bi_level_gae(r, v, m, end, gamma=0.9, lam=0.8, high_level_gamma=0.5, whiten=False)
    b, ret_b = gae(r, v, m, gamma=0.9, lam=0.8, whiten=False)
    assert torch.allclose(a, b, atol=1e-6) and torch.allclose(ret, ret_b, atol=1e-6)


def test_bi_level_gae_fully_masked_and_empty():
    adv, ret = bi_level_gae(
        torch.ones(2, 3),
        torch.ones(2, 3),
        torch.tensor([[1, 1, 0], [0, 0, 0]]),
        torch.zeros(2, 3, dtype=torch.bool),
    )
    assert torch.equal(adv[1], torch.zeros(3)) and torch.equal(ret[1], torch.zeros(3)) and no_nan(adv, ret)
    e = torch.zeros(0, 4)
    assert bi_level_gae(e, e, e, e.bool())[0].shape == (0, 4)


# ---------------------------------------------------------------------------------------------
# GiGPO (§4)
# ---------------------------------------------------------------------------------------------

# trajectory A: obs [s0, s1], r [0, 10]; trajectory B: obs [s0, s2, s3], r [0, 0, 0]; one task group
EP = t(10.0, 10.0, 0.0, 0.0, 0.0)
STEP_R = t(0.0, 10.0, 0.0, 0.0, 0.0)
GROUP = torch.zeros(5, dtype=LONG)
TRAJ = torch.tensor([0, 0, 1, 1, 1])
STEP = torch.tensor([0, 1, 0, 1, 2])
ANCHOR = ["s0", "s1", "s0", "s2", "s3"]


def test_gigpo_worked_example():
    a = gigpo(EP, STEP_R, GROUP, TRAJ, STEP, ANCHOR)
    assert torch.allclose(a, t(10.75, 6.0, -8.75, -4.0, -4.0), atol=1e-5)


def test_gigpo_cross_steps_mean_vs_per_trajectory_mean():
    cross = gigpo(EP, STEP_R, GROUP, TRAJ, STEP, ANCHOR, omega=0.0)
    assert torch.allclose(cross, t(6.0, 6.0, -4.0, -4.0, -4.0))  # mean over 5 rows = 4.0
    per_traj = gigpo(EP, STEP_R, GROUP, TRAJ, STEP, ANCHOR, omega=0.0, cross_steps=False)
    assert torch.allclose(per_traj, t(5.0, 5.0, -5.0, -5.0, -5.0))  # mean over 2 trajectories = 5


def test_gigpo_mean_std_norm():
    a = gigpo(EP, STEP_R, GROUP, TRAJ, STEP, ANCHOR, mode="mean_std_norm")
    ep_std = math.sqrt((2 * 36 + 3 * 16) / 4)  # rows [10, 10, 0, 0, 0], unbiased
    s0_std = math.sqrt(2 * 4.75**2)  # anchor group s0 = {9.5, 0}, unbiased
    ae_a, ae_b, as_ = 6 / (ep_std + 1e-6), -4 / (ep_std + 1e-6), 4.75 / (s0_std + 1e-6)
    assert torch.allclose(a, t(ae_a + as_, ae_a, ae_b - as_, ae_b, ae_b), atol=1e-5)


def test_gigpo_singletons_and_flat_groups():
    # task 7: one trajectory of two steps -> A^E = raw R (mean 0, F 1) whatever its length;
    # both anchors singletons -> A^S = 0. Task 8: all rewards 0.1 -> exactly 0 in both modes.
    ep = t(0.5, 0.5, 0.1, 0.1, 0.1)
    step_r = t(0.0, 0.5, 0.1, 0.1, 0.0)
    groups = torch.tensor([7, 7, 8, 8, 8])
    trajs = torch.tensor([0, 0, 1, 2, 2])
    steps = torch.tensor([0, 1, 0, 0, 1])
    keys = ["x", "y", "x", "x", "z"]  # "x" in task 7 and task 8 must NOT share an anchor group
    for mode in ("mean_norm", "mean_std_norm"):
        a = gigpo(ep, step_r, groups, trajs, steps, keys, mode=mode, omega=0.0)
        assert torch.equal(a, t(0.5, 0.5, 0.0, 0.0, 0.0))
        full = gigpo(ep, step_r, groups, trajs, steps, keys, mode=mode)
        assert torch.equal(full[:2], t(0.5, 0.5)) and no_nan(full)
    # task 8 anchor "x" = {traj 1 step 0: R=0.1, traj 2 step 0: R=0.1+0.95*0} -> flat-ish, exact 0
    assert torch.equal(gigpo(ep, step_r, groups, trajs, steps, keys)[2:], torch.zeros(3))


def test_gigpo_row_order_free_and_tuple_anchors():
    perm = torch.tensor([4, 2, 0, 3, 1])
    keys = [("obs", 0), ("obs", 1), ("obs", 0), ("obs", 2), ("obs", 3)]
    a = gigpo(EP, STEP_R, GROUP, TRAJ, STEP, keys)
    b = gigpo(EP[perm], STEP_R[perm], GROUP[perm], TRAJ[perm], STEP[perm], [keys[i] for i in perm])
    assert torch.allclose(a[perm], b)


def test_gigpo_step_gap_is_discounted_by_its_length():
    a = gigpo(
        t(10.0, 10.0, 0.0),
        t(0.0, 10.0, 0.0),
        torch.zeros(3, dtype=LONG),
        torch.tensor([0, 0, 1]),
        torch.tensor([0, 2, 0]),
        ["s", "u", "s"],
        omega=1.0,
    )
    # A's step 0 return = 0.95^2 * 10 = 9.025; anchor s = {9.025, 0}
    assert a[0].item() == pytest.approx((10 - 20 / 3) + 9.025 / 2, abs=1e-4)


def test_gigpo_similarity_mode():
    keys = ["you are in the kitchen. a fridge.", "you are in the kitchen. a fridge!", "a garden."]
    ep, step_r = t(1.0, 0.0, 0.0), t(1.0, 0.0, 0.0)
    groups, trajs, steps = torch.zeros(3, dtype=LONG), torch.tensor([0, 1, 2]), torch.zeros(3, dtype=LONG)
    exact = gigpo(ep, step_r, groups, trajs, steps, keys, omega=1.0) - gigpo(
        ep, step_r, groups, trajs, steps, keys, omega=0.0
    )
    assert torch.equal(exact, torch.zeros(3))  # all anchors distinct -> singletons
    sim = gigpo(ep, step_r, groups, trajs, steps, keys, similarity_thresh=0.95, omega=1.0)
    step_part = sim - gigpo(ep, step_r, groups, trajs, steps, keys, omega=0.0)
    assert torch.allclose(step_part, t(0.5, -0.5, 0.0))  # the first two strings cluster (ratio ~0.97)
    with pytest.raises(TypeError, match="strings"):
        gigpo(ep, step_r, groups, trajs, steps, [1, 2, 3], similarity_thresh=0.9)


def test_gigpo_errors_and_empty():
    with pytest.raises(TypeError, match="hashable"):
        gigpo(EP, STEP_R, GROUP, TRAJ, STEP, [[0], [1], [0], [2], [3]])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="step_index"):
        gigpo(EP, STEP_R, GROUP, TRAJ, torch.tensor([0, 0, 0, 1, 2]), ANCHOR)
    with pytest.raises(ValueError, match="same group_index"):
        gigpo(EP, STEP_R, torch.tensor([0, 1, 0, 0, 0]), TRAJ, STEP, ANCHOR)
    with pytest.raises(ValueError, match="mode"):
        gigpo(EP, STEP_R, GROUP, TRAJ, STEP, ANCHOR, mode="std")  # type: ignore[arg-type]
    z = torch.zeros(0, dtype=LONG)
    assert gigpo(torch.zeros(0), torch.zeros(0), z, z, z, []).shape == (0,)


# ---------------------------------------------------------------------------------------------
# AgentRL per-task normalisation (§5) and ERPO environment std (§6)
# ---------------------------------------------------------------------------------------------


def test_normalize_by_task_per_sample():
    a = normalize_by_task(t(1.0, 2.0, 3.0, 10.0, 10.0, 4.0), torch.tensor([0, 0, 0, 1, 1, 2]))
    # task 0: mean 2, std 1; task 1 flat -> 0; task 2 single entry -> 0
    assert torch.allclose(a, t(-1.0, 0.0, 1.0, 0.0, 0.0, 0.0), atol=1e-5)
    assert a[3] == 0 and a[5] == 0


def test_normalize_by_task_per_token_weighs_long_rows_more():
    adv = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    out = normalize_by_task(adv, torch.tensor([3, 3, 4]), mask)
    # task 3 tokens [1, 1, 1, 0]: mean 0.75, unbiased std 0.5 -> 0.5 and -1.5; task 4 flat -> 0
    expected = torch.tensor([[0.5, 0.5, 0.5], [-1.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.allclose(out, expected, atol=1e-5)


def test_normalize_by_task_empty_and_fully_masked():
    assert normalize_by_task(torch.zeros(0), torch.zeros(0, dtype=LONG)).shape == (0,)
    out = normalize_by_task(torch.ones(2, 2), torch.tensor([0, 1]), torch.zeros(2, 2))
    assert torch.equal(out, torch.zeros(2, 2))


def test_grpo_env_std_centres_by_task_and_scales_by_environment():
    r = t(1.0, 0.0, 1.0, 1.0, 3.0, 1.0)
    tasks = torch.tensor([0, 0, 1, 1, 2, 2])
    envs = torch.tensor([0, 0, 0, 0, 1, 1])
    a = grpo_env_std(r, tasks, envs)
    # env 0 rewards [1, 0, 1, 1]: unbiased std 0.5; task 0 centred ±0.5 -> ±1; task 1 flat -> 0
    # env 1 rewards [3, 1]: std sqrt(2); task 2 centred ±1 -> ±1/sqrt(2)
    s = 1 / (math.sqrt(2) + 1e-6)
    assert torch.allclose(a, t(1.0, -1.0, 0.0, 0.0, s, -s), atol=1e-5)
    assert a[2] == 0 and a[3] == 0


def test_grpo_env_std_singletons():
    # task 5 is a group of one in an env with spread: mean 0 -> R / std_env;
    # env 9 has a single rollout: F = 1 -> raw R (never R / eps)
    r = t(1.0, 0.0, 2.0, 0.7)
    a = grpo_env_std(r, torch.tensor([0, 0, 5, 6]), torch.tensor([1, 1, 1, 9]))
    env_std = float(t(1.0, 0.0, 2.0).std())
    assert a[2].item() == pytest.approx(2.0 / (env_std + 1e-6), rel=1e-5)
    assert a[3].item() == pytest.approx(0.7, rel=1e-6)
    flat_env = grpo_env_std(t(0.3, 0.3), torch.tensor([0, 1]), torch.tensor([0, 0]))
    assert torch.allclose(flat_env, t(0.3, 0.3))  # singletons in a flat env: F = 1
    assert grpo_env_std(torch.zeros(0), torch.zeros(0, dtype=LONG), torch.zeros(0, dtype=LONG)).shape == (0,)


# ---------------------------------------------------------------------------------------------
# EMPG (§12)
# ---------------------------------------------------------------------------------------------


def test_empg_hand_vector():
    adv = t(1.0, 1.0, -1.0)
    ent = t(0.0, 1.0, 2.0)
    out = empg(adv, ent, torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0]))
    hn = [0.0, 1 / (2 + 1e-8), 2 / (2 + 1e-8)]
    e = [math.exp(-h) for h in hn]
    g = [x / (sum(e) / 3) for x in e]
    # row 0 gets the bonus from its next step (row 1); row 1 is its trajectory's last step; row 2 alone
    expected = t(g[0] + 0.1 * math.exp(-hn[1]), g[1], -g[2])
    assert torch.allclose(out, expected, atol=1e-6)


def test_empg_flat_entropy_gap_and_order():
    # all entropies equal: g = 1, f = 1; step 0 of traj 4 takes its bonus from step 3 (the next present)
    out = empg(t(0.5, -0.5, 0.2), t(0.7, 0.7, 0.7), torch.tensor([4, 4, 5]), torch.tensor([3, 0, 0]))
    assert torch.allclose(out, t(0.5, -0.4, 0.2))
    assert no_nan(out)


def test_empg_scale_has_batch_mean_one_and_edge_cases():
    ent = t(0.1, 0.9, 0.4, 2.0)
    ones = empg(torch.ones(4), ent, torch.arange(4), torch.zeros(4, dtype=LONG), zeta=0.0)
    assert float(ones.mean()) == pytest.approx(1.0, abs=1e-6)
    z = torch.zeros(0, dtype=LONG)
    assert empg(torch.zeros(0), torch.zeros(0), z, z).shape == (0,)
    with pytest.raises(ValueError, match="step_index"):
        empg(torch.ones(2), torch.ones(2), torch.tensor([0, 0]), torch.tensor([1, 1]))
