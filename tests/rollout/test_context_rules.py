"""Every entry of `CONTEXT_RULES` trains exactly on the prompts it built (`check_context_rule`),
on real rollouts of a random policy (tool calls, malformed actions, several turns)."""

from __future__ import annotations

import dataclasses

import pytest

from steprl.rollout.chat import PlainFormat
from steprl.rollout.context import CONTEXT_RULES, DropOldObservations
from steprl.rollout.views import check_context_rule


@pytest.mark.parametrize("name", sorted(CONTEXT_RULES))
def test_every_context_rule_trains_on_the_prompts_it_built(name, tokenizer, sample_rollouts):
    rule = CONTEXT_RULES[name](1, PlainFormat(tokenizer))
    trajectories = sample_rollouts(rule, n_tasks=3, group_size=2)
    assert any(len(t.steps) > 2 for t in trajectories)  # a window of 1 cuts something
    assert check_context_rule(rule, trajectories) >= len(trajectories)


def test_a_rule_that_claims_to_extend_and_does_not_is_caught(sample_rollouts):
    liar = dataclasses.replace(DropOldObservations(1), append_only=True)
    trajectories = sample_rollouts(DropOldObservations(1), n_tasks=3, group_size=2)
    with pytest.raises(AssertionError, match="did not extend"):
        check_context_rule(liar, trajectories)
