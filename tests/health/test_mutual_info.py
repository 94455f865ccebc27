"""RAGEN-2's MI proxy and retrieval accuracy (health/mutual_info.py) on hand-made score tensors."""

import math

import pytest
import torch

from steprl.health.mutual_info import mi_from_scores


def test_hand_computed_two_prompts_one_sample():
    # s[j, i, 0]: reasoning i under prompt j
    s = torch.tensor([[-1.0, -3.0], [-2.0, -1.0]])[..., None]
    mi, acc = mi_from_scores(s)
    # per reasoning: s_ii - log((e^s_0i + e^s_1i) / 2) = log 2 - log(1 + e^-(gap))
    want = math.log(2) - 0.5 * (math.log(1 + math.exp(-1)) + math.log(1 + math.exp(-2)))
    assert mi == pytest.approx(want, abs=1e-12)
    assert acc == 1.0
    s[0, 1, 0] = -0.5  # reasoning 1 now scores better under prompt 0: retrieved wrong
    assert mi_from_scores(s)[1] == 0.5


def test_ragen_reference_vector():
    # mll-lab-nu/RAGEN docs/reference_mutual_information_metrics.md: rows (i, k), columns j
    rows = torch.tensor([[-1.0, -3.0], [-1.2, -2.5], [-3.0, -0.8], [-2.0, -1.0]])
    s = rows.view(2, 2, 2).permute(2, 0, 1)  # -> [j, i, k]
    mi, acc = mi_from_scores(s)
    assert mi == pytest.approx(0.4966, abs=1e-4)
    assert acc == 1.0


@pytest.mark.parametrize("n,k", [(2, 1), (5, 3), (16, 4)])
def test_input_independent_scores_give_zero_and_chance(n, k):
    per_reasoning = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
    s = per_reasoning.expand(n, n, k)  # every prompt scores a reasoning the same
    mi, acc = mi_from_scores(s)
    assert abs(mi) < 1e-12
    assert acc == pytest.approx(1.0 / n)  # ties go to prompt 0: only its reasonings count


@pytest.mark.parametrize("off", [-math.inf, -1e9])
def test_perfectly_dependent_scores_give_log_n_and_one(off):
    n, k = 4, 2
    s = torch.full((n, n, k), off)
    s[torch.arange(n), torch.arange(n)] = 0.0
    mi, acc = mi_from_scores(s)
    assert mi == pytest.approx(math.log(n), abs=1e-12)
    assert acc == 1.0


def test_relabelling_prompts_or_samples_changes_nothing():
    n, k = 6, 3
    s = torch.randn(n, n, k, generator=torch.Generator().manual_seed(1)) * 3
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(2))
    relabelled = s[perm][:, perm]  # prompt p becomes prompt perm^-1(p) on both axes
    shuffled = s[:, :, torch.tensor([2, 0, 1])]
    base = mi_from_scores(s)
    assert 0.0 < base[1] < 1.0  # a mixed case, so the check means something
    for other in (relabelled, shuffled):
        mi, acc = mi_from_scores(other)
        assert mi == pytest.approx(base[0], abs=1e-12)
        assert acc == pytest.approx(base[1], abs=1e-12)


def test_a_reasoning_impossible_under_every_prompt_counts_zero():
    s = torch.zeros(2, 2, 1)
    s[:, 1, 0] = -math.inf
    s[1, 0, 0] = -math.inf  # reasoning 0: only its own prompt explains it -> log 2
    mi, _ = mi_from_scores(s)
    assert mi == pytest.approx(math.log(2) / 2)


@pytest.mark.parametrize("shape", [(2, 3, 1), (2, 2), (0, 0, 1), (2, 2, 0)])
def test_bad_shapes_say_what_is_expected(shape):
    with pytest.raises(ValueError, match=r"\(N, N, K\)"):
        mi_from_scores(torch.zeros(shape))


def test_nan_is_refused():
    s = torch.zeros(2, 2, 1)
    s[0, 1, 0] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        mi_from_scores(s)
