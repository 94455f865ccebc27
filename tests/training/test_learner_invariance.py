"""Learner invariants: micro-batching changes memory, never the update; ratio is 1 on-policy."""

import copy
import functools

import pytest
import torch

from steprl.algorithms import POLICY_LOSSES
from steprl.training.learn.batching import collate, token_budget_batches
from steprl.training.learn.learner import LocalLearner


def _learner(model, aggregation, micro, loss="ppo_clip", **kw):
    spec = POLICY_LOSSES[loss]
    return LocalLearner(
        copy.deepcopy(model),
        policy_loss=functools.partial(spec.fn),
        needs_proximal=spec.needs_proximal,
        aggregation=aggregation,
        loss_scale_factor=50.0,
        lr=1e-2,
        weight_decay=0.0,
        betas=(0.9, 0.99),
        grad_clip=1e9,
        micro_batch_size=micro,
        pad_id=0,
        temperature=1.0,
        **kw,
    )


def _grads(learner, rows, micro):
    """Accumulated gradients of one mini-batch (all rows), micro-batched `micro` rows at a time."""
    learner.micro_batch_size = micro
    n_tokens = float(sum(sum(r.loss_mask) for r in rows))
    n_seqs = float(sum(1 for r in rows if any(r.loss_mask)))
    prox = learner._row_stats(rows)["logp"] if learner.needs_proximal else None
    learner.optimizer.zero_grad(set_to_none=True)
    for m0 in range(0, len(rows), micro):
        idx = list(range(m0, min(m0 + micro, len(rows))))
        batch = collate([rows[i] for i in idx], 0)
        learner._backward(batch, idx, prox, None, None, n_tokens, n_seqs)
    return {n: p.grad.clone() for n, p in learner.model.named_parameters()}


@pytest.mark.parametrize(
    "aggregation", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_micro_batches_1x8_equal_8x1(small_model, advantage_rows, aggregation):
    rows = advantage_rows
    learner = _learner(small_model, aggregation, 8)
    one_by_eight = _grads(learner, rows, 1)
    eight_by_one = _grads(learner, rows, 8)
    for name, g in one_by_eight.items():
        assert torch.allclose(g, eight_by_one[name], atol=1e-6, rtol=1e-4), name
    assert any(g.abs().sum() > 0 for g in one_by_eight.values())


def test_on_policy_ratio_is_one_and_decoupled_equals_ppo(small_model, advantage_rows):
    rows = advantage_rows
    ppo = _grads(_learner(small_model, "token-mean", 8, "ppo_clip"), rows, 8)
    decoupled = _grads(_learner(small_model, "token-mean", 8, "decoupled_ppo"), rows, 8)
    for name, g in ppo.items():
        assert torch.allclose(g, decoupled[name], atol=1e-6, rtol=1e-4), name
    stats = _learner(small_model, "token-mean", 8).update(
        rows, epochs=1, mini_batches=1, generator=torch.Generator().manual_seed(1)
    )
    assert stats["actor/clip_frac"] == 0.0  # one mini-batch on fresh rollouts: ratio is exactly 1
    assert stats["actor/engine_logprob_diff_max"] < 1e-4


def test_a_token_budget_splits_micro_batches_within_it():
    lengths = [5, 9, 3, 20, 4, 4]
    cut = token_budget_batches(lengths, list(range(6)), rows=8, tokens=18)
    assert cut == [[0], [1], [2], [3], [4, 5]] or all(
        len(mb) * max(lengths[i] for i in mb) <= 18 or len(mb) == 1 for mb in cut
    )
    assert [i for mb in cut for i in mb] == list(range(6))  # every row once, in order
    assert all(len(mb) * max(lengths[i] for i in mb) <= 18 for mb in cut if len(mb) > 1)
    assert [3] in cut  # longer than the budget: alone
    assert token_budget_batches(lengths, list(range(6)), rows=2, tokens=10_000) == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize("setting", [{"max_tokens": 40}, {"activation_checkpointing": True}])
def test_a_token_budget_and_activation_checkpointing_change_memory_not_the_update(
    small_model, advantage_rows, setting
):
    def updated(**kw):
        learner = _learner(small_model, "token-mean", 8, **kw)
        grads = {}
        step = learner.optimizer.step

        def keep_grads(*a, **k):  # the step's gradients, as the optimizer gets them
            grads.update({n: p.grad.clone() for n, p in learner.model.named_parameters()})
            return step(*a, **k)

        learner.optimizer.step = keep_grads
        stats = learner.update(
            advantage_rows, epochs=1, mini_batches=1, generator=torch.Generator().manual_seed(3)
        )
        return learner, grads, stats

    _, plain, plain_stats = updated()
    other, grads, stats = updated(**setting)
    if "activation_checkpointing" in setting:
        assert other.model.is_activation_checkpointing
    else:
        lengths = [len(r.input_ids) for r in advantage_rows]
        assert len(other._micro_batches(advantage_rows, list(range(len(lengths))))) > 1  # the budget cuts
    assert plain.keys() == grads.keys() and plain
    for name, g in plain.items():
        assert torch.allclose(g, grads[name], atol=1e-6, rtol=1e-4), (
            name,
            float((g - grads[name]).abs().max()),
        )
    assert abs(plain_stats["actor/pg_loss"] - stats["actor/pg_loss"]) < 1e-6
