"""Every entry of `CRITICS` passes `check_critic` on real rollouts' rows."""

from __future__ import annotations

import copy

import pytest

from steprl.training.learn.critic import CRITICS, CriticArgs, ValueHead, check_critic
from tiny_runs import make_learner


@pytest.mark.parametrize("name", sorted(CRITICS))
def test_every_critic_passes_check_critic(name, small_model, advantage_rows):
    policy = copy.deepcopy(small_model)
    head = ValueHead(int(policy.config.hidden_size)) if CRITICS[name].shares_head else None
    learner = make_learner(policy, value_head=head)  # a shared critic's values are its head's
    args = CriticArgs(policy, learner, lr=1e-3, value_clip=0.5, grad_clip=1.0, micro_batch_size=4, pad_id=0)
    check_critic(CRITICS[name].make(args), advantage_rows)
