"""Prefix-tree rows (training/learn/packing.py) against the per-step rows they replace.

The per-step rows are the reference: for every history-editing context rule, and for a group's
shared prompt, the packed trees must give the same log-probs (1e-5, fp32) and the same
gradients (1e-5 relative), on fewer tokens.
"""

import copy

import pytest
import torch

from steprl.rollout.context import DropOldObservations, KeepLastK, StripThinking
from steprl.rollout.views import Sample, packed_view, per_step_view
from steprl.training.learn.batching import batch_hidden, collate, logprobs_at
from steprl.training.learn.learner import LocalLearner
from steprl.training.learn.packing import pack


def _with_advantages(samples):
    out = []
    for k, s in enumerate(samples):
        adv = tuple(((k % 5) - 2) * 0.3 * m for m in s.loss_mask)
        out.append(Sample(s.input_ids, s.loss_mask, s.old_logprobs, s.traj_index, s.token_step, adv))
    return out


def _learner(model, pad_id, loss="ppo_clip", *, pack, lr=1e-2):
    """A learner over `model` with the plain defaults: only the loss, lr and packing vary here."""
    from steprl.algorithms import POLICY_LOSSES

    spec = POLICY_LOSSES[loss]
    return LocalLearner(
        model,
        policy_loss=spec.fn,
        needs_proximal=spec.needs_proximal,
        aggregation="token-mean",
        loss_scale_factor=None,
        lr=lr,
        weight_decay=0.0,
        betas=(0.9, 0.99),
        grad_clip=1.0,
        micro_batch_size=64,
        pad_id=pad_id,
        temperature=1.0,
        pack=pack,
    )


def _logp_and_grads(model, samples, pad_id, pack_rows):
    model.zero_grad(set_to_none=True)
    b = collate(samples, pad_id, pack=pack_rows)
    hidden = batch_hidden(model, b)
    logp, _ = logprobs_at(model, hidden, b.input_ids, b.loss_mask, 1.0, pred=b.pred)
    (logp * b.advantages).sum().backward()
    per_sample = [lp * m for lp, m in zip(b.per_sample(logp.detach()), b.layout.trained, strict=True)]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return b, per_sample, grads


def _compare(model, samples, pad_id):
    plain, lp0, g0 = _logp_and_grads(model, samples, pad_id, False)
    packed, lp1, g1 = _logp_and_grads(model, samples, pad_id, True)
    assert packed.trees is not None, "these rows share prefixes: they must be packed"
    assert max(float((a - b).abs().max()) for a, b in zip(lp0, lp1, strict=True)) < 1e-5
    for name, g in g0.items():
        assert float((g - g1[name]).norm()) <= 1e-5 * float(g.norm()) + 1e-12, name
    return sum(len(s.input_ids) for s in samples), int((packed.input_ids != pad_id).sum())


@pytest.mark.parametrize(
    "rule", [DropOldObservations(1), KeepLastK(1), StripThinking((15,), frozenset({10}))], ids=repr
)
def test_per_step_rows_packed_into_trees_give_the_same_logprobs_and_gradients(
    tokenizer, small_model, sample_rollouts, rule, monkeypatch
):
    # exactness does not depend on the saving: pack even where the default would not bother
    monkeypatch.setattr("steprl.training.learn.batching.PACK_WHEN_NODES_BELOW", 1.01)
    trajs = sample_rollouts(rule, engine_seed=5, n_tasks=4, group_size=3)
    assert sum(len(t.steps) > 2 for t in trajs) >= 2, "want trajectories of several turns"
    samples = _with_advantages([s for i, t in enumerate(trajs) for s in per_step_view(t, i)])
    model = copy.deepcopy(small_model).train()  # never the session's own model
    rows, nodes = _compare(model, samples, tokenizer.pad_token_id)
    assert nodes < rows  # (at 8 turns, benchmarks/packed_rows.py: several times fewer)


def test_a_groups_shared_prompt_is_computed_once(tokenizer, small_model, sample_rollouts, monkeypatch):
    from steprl.rollout.context import AppendOnly

    monkeypatch.setattr("steprl.training.learn.batching.PACK_WHEN_NODES_BELOW", 1.01)

    trajs = sample_rollouts(AppendOnly(), engine_seed=2, n_tasks=3, group_size=4, max_tokens_per_turn=6)
    samples = _with_advantages([packed_view(t, i) for i, t in enumerate(trajs)])
    trees, where = pack(samples)
    assert len(trees) == 3  # one tree per task's group
    _compare(copy.deepcopy(small_model).train(), samples, tokenizer.pad_token_id)


def test_a_trained_token_is_never_shared_by_two_rows():
    # two identical rows: the same prompt and the same sampled tokens, two loss terms
    s = Sample((1, 5, 6, 7), (0, 0, 1, 1), (0.0, 0.0, -1.0, -2.0), 0, advantages=(0.0, 0.0, 1.0, 1.0))
    trees, _ = pack([s, s])
    (tree,) = trees
    assert tree.ids == [1, 5, 6, 7, 6, 7]  # the prompt once, each row's action its own branch
    assert sum(tree.trained) == 4


def test_learner_update_is_the_same_packed_or_not(tokenizer, small_model, sample_rollouts, monkeypatch):
    import copy

    monkeypatch.setattr("steprl.training.learn.batching.PACK_WHEN_NODES_BELOW", 1.01)

    trajs = sample_rollouts(DropOldObservations(1), engine_seed=5, n_tasks=3, group_size=3)
    samples = _with_advantages([s for i, t in enumerate(trajs) for s in per_step_view(t, i)])
    runs = []
    for pack_rows in (False, True):
        learner = _learner(copy.deepcopy(small_model).train(), tokenizer.pad_token_id, pack=pack_rows)
        stats = learner.update(samples, epochs=1, mini_batches=2, generator=torch.Generator().manual_seed(0))
        assert stats["actor/engine_logprob_diff_max"] < 1e-4
        runs.append(stats)
    # the same loss, entropy and pre-clip gradient norms (Adam's first step would amplify 1e-9
    # gradient noise into lr-sized parameter moves, so parameters are no test of this)
    for key in (
        "actor/pg_loss",
        "actor/entropy",
        "actor/approx_kl",
        "actor/grad_norm",
        "actor/grad_norm_max",
    ):
        assert abs(runs[0][key] - runs[1][key]) <= 1e-5 * (1 + abs(runs[0][key])), key


def test_one_optimizer_step_needs_no_proximal_pass(tokenizer, small_model, sample_rollouts, monkeypatch):
    trajs = sample_rollouts(DropOldObservations(1), engine_seed=5, n_tasks=2, group_size=2)
    samples = _with_advantages([s for i, t in enumerate(trajs) for s in per_step_view(t, i)])
    calls = []
    for mini_batches in (1, 2):
        learner = _learner(
            copy.deepcopy(small_model).train(), tokenizer.pad_token_id, "decoupled_ppo", pack=True, lr=1e-3
        )

        def counted(*a, real=learner._row_stats, n=mini_batches, **k):
            calls.append(n)
            return real(*a, **k)

        monkeypatch.setattr(learner, "_row_stats", counted)
        stats = learner.update(samples, epochs=1, mini_batches=mini_batches, generator=torch.Generator())
        assert torch.isfinite(torch.tensor(stats["actor/pg_loss"]))
    # one step: the proximal policy is the step's own weights (its log-probs, detached); two
    # steps: the second needs the weights before the first, so they are computed up front
    assert calls == [2]
