"""Loss masks: no observation or prompt token ever carries loss weight; context rules."""

import pytest

from steprl.envs.registry import make_tasks
from steprl.rollout.chat import PlainFormat
from steprl.rollout.context import CONTEXT_RULES, AppendOnly, DropOldObservations, KeepLastK, StripThinking
from steprl.rollout.views import packed_view, per_step_view
from steprl.types import EndReason


def _expert_traj(expert_episode, rule=AppendOnly()):
    task = next(make_tasks("calculator", "train", 5, min_calls=3, max_calls=3))
    return expert_episode("calculator", task, rule)


def test_packed_view_masks_exactly_the_action_tokens(tokenizer, expert_episode):
    traj = _expert_traj(expert_episode)
    assert traj.end is EndReason.ANSWERED and len(traj.steps) == 4
    s = packed_view(traj, 0)
    assert len(s.input_ids) == len(s.loss_mask) == len(s.old_logprobs)
    # rebuild the expected mask from the steps
    pos = len(traj.steps[0].prompt_ids)
    expected = [0] * pos
    for st in traj.steps:
        expected += [1] * len(st.action_ids) + [0] * len(st.observation_ids)
    assert list(s.loss_mask) == expected[: len(s.input_ids)]
    # every masked-in token is an action token and no observation token is masked in
    obs_text = PlainFormat(tokenizer).decode(
        [t for t, m in zip(s.input_ids, s.loss_mask, strict=True) if m == 0]
    )
    act_text = PlainFormat(tokenizer).decode(
        [t for t, m in zip(s.input_ids, s.loss_mask, strict=True) if m == 1]
    )
    assert "<result>" in obs_text and "<result>" not in act_text
    assert act_text.count("<calc>") == 3 and "<answer>" in act_text


def test_per_step_view_masks_only_each_steps_action(expert_episode):
    traj = _expert_traj(expert_episode)
    rows = per_step_view(traj, 2)
    assert len(rows) == len(traj.steps)
    for row, st in zip(rows, traj.steps, strict=True):
        assert sum(row.loss_mask) == len(st.action_ids)
        assert row.input_ids[-len(st.action_ids) :] == st.action_ids
        assert row.traj_index == 2


def test_packed_view_refuses_non_append_only_context(expert_episode):
    traj = _expert_traj(expert_episode, rule=KeepLastK(1))
    with pytest.raises(ValueError, match="append_only"):
        packed_view(traj, 0)


def test_context_rules():
    init = (1, 2)
    hist = [((10,), (11,)), ((20,), (21,)), ((30,), (31,))]
    assert AppendOnly().next_prompt(init, hist) == (1, 2, 10, 11, 20, 21, 30, 31)
    assert KeepLastK(1).next_prompt(init, hist) == (1, 2, 30, 31)
    assert KeepLastK(0).next_prompt(init, hist) == (1, 2)
    assert DropOldObservations(1).next_prompt(init, hist) == (1, 2, 10, 20, 30, 31)
    assert set(CONTEXT_RULES) == {
        "append_only",
        "keep_last_k",
        "drop_old_observations",
        "keep_thinking",
        "strip_thinking",
    }


def test_strip_thinking_cuts_reasoning_before_the_last_user_turn():
    """Actions up to the last user turn lose everything through their last </think> (id 9) and
    the newline ids (7) after it; later actions, and actions without reasoning, are kept."""
    rule = StripThinking(close=(9,), blank=frozenset({7}))
    init = (1,)
    hist = [
        ((5, 6, 9, 7, 7, 40), (11,), False),  # reasoning, then a call; a tool result follows
        ((5, 9, 41), (12,), True),  # reasoning, then an answer; a user turn follows
        ((5, 9, 7, 42), (13,), False),  # after the last user turn: kept whole
    ]
    assert rule.next_prompt(init, hist) == (1, 40, 11, 41, 12, 5, 9, 7, 42, 13)
    assert rule.next_prompt(init, hist[:1]) == (1, 5, 6, 9, 7, 7, 40, 11)  # no user turn yet
    assert StripThinking((9,), frozenset()).next_prompt(init, [((3, 4), (5,), True)]) == (1, 3, 4, 5)


def test_no_observation_token_carries_weight_on_sampled_rollouts(sample_rollouts):
    """On real engine rollouts (random tiny model: lots of error observations), the masks hold."""
    for t in sample_rollouts(AppendOnly(), n_tasks=4, max_tokens_per_turn=12):
        s = packed_view(t, 0)
        n_obs_in_view = sum(len(st.observation_ids) for st in t.steps[:-1])
        assert s.loss_mask.count(1) == t.num_action_tokens
        assert s.loss_mask.count(0) == len(t.steps[0].prompt_ids) + n_obs_in_view
