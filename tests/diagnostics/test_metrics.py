"""Hand-computed checks of steprl.diagnostics.metrics on a small synthetic batch."""

from __future__ import annotations

import math
from typing import Any

import pytest

from steprl.diagnostics.metrics import (
    env_metrics,
    is_success,
    mean_of,
    reward_component_means,
    rollout_metrics,
)
from steprl.types import NOT_TRAINABLE, EndReason, Step, Trajectory

PROMPT = (1, 2, 3, 4)  # every trajectory's first prompt: 4 tokens


def step(
    n_action: int,
    n_obs: int,
    kind: str | None = None,
    valid: bool | None = None,
    reward: float = 0.0,
    components: dict[str, float] | None = None,
) -> Step:
    info: dict[str, Any] = {}
    if kind is not None:
        info["action_kind"] = kind
    if valid is not None:
        info["tool_call_valid"] = valid
    if components is not None:
        info["reward_components"] = components
    return Step(
        prompt_ids=PROMPT,
        action_ids=tuple(range(10, 10 + n_action)),
        action_logprobs=tuple(-0.5 for _ in range(n_action)),
        observation_ids=tuple(range(50, 50 + n_obs)),
        reward=reward,
        policy_version=0,
        info=info,
    )


def traj(
    group: str,
    reward: float,
    steps: tuple[Step, ...],
    end: EndReason = EndReason.ANSWERED,
    env: str = "calc",
    info: dict[str, Any] | None = None,
) -> Trajectory:
    return Trajectory(
        task_id=f"task-{group}",
        group_id=group,
        env=env,
        steps=steps,
        outcome_reward=reward,
        end=end,
        info=info or {},
    )


def answer(n_action: int = 1) -> Step:
    return step(n_action, 0, kind="answer")


def batch() -> list[Trajectory]:
    """g1 rewards [1,0,0,1] (+ one infra failure), g2 rewards [1,1,1,1]."""
    return [
        traj("g1", 1.0, (step(2, 3, "tool_call", True), answer(1))),  # a1: 2 turns, 3 act, 3 obs, 1 call
        traj("g1", 0.0, (step(1, 2, "invalid"), answer(1))),  # a2: 2 turns, 2 act, 2 obs, 0 calls
        traj(  # a3: 2 turns, 4 act, 3 obs, 2 calls (1 valid)
            "g1",
            0.0,
            (step(3, 2, "tool_call", False), step(1, 1, "tool_call", True)),
            end=EndReason.TRUNCATED,
        ),
        traj("g1", 1.0, (step(2, 3, "tool_call", True), answer(1))),  # a4: like a1
        *[traj("g2", 1.0, (answer(1),)) for _ in range(4)],  # b1..b4: 1 turn, 1 act, 0 obs
        # an infra failure with an absurd reward: must not move any reward/episode/tool stat
        traj("g1", 5.0, (step(5, 0, "tool_call", True),), end=EndReason.INFRA_FAILED),
    ]


def test_rollout_metrics_hand_computed() -> None:
    m = rollout_metrics(batch())
    expected = {
        # 8 trainable rewards [1,0,0,1,1,1,1,1]
        "reward/mean": 0.75,
        "reward/std": math.sqrt(0.75 * 0.25),
        "reward/min": 0.0,
        "reward/max": 1.0,
        # g1 population std 0.5, g2 std 0
        "reward/group_std_mean": 0.25,
        "reward/zero_variance_group_frac": 0.5,
        "reward/tiny_std_group_frac": 0.0,  # g1 differs by 0.5, g2 not at all
        "groups/count": 2.0,
        "success/rate": 6 / 8,
        "episode/turns_mean": 12 / 8,
        "episode/turns_max": 2.0,
        "episode/action_tokens_mean": 16 / 8,
        "episode/observation_tokens_mean": 11 / 8,
        "episode/total_tokens_mean": (8 * 4 + 16 + 11) / 8,
        "tools/calls_total": 4.0,
        "tools/calls_per_traj": 4 / 8,
        "tools/call_rate": 3 / 8,
        "tools/valid_frac": 3 / 4,
        "tools/calls_per_success": 2 / 6,  # a1, a4 one call each; b1..b4 none
        "actions/invalid_frac": 1 / 12,
        "end/answered": 7.0,
        "end/truncated": 1.0,
        "end/policy_error": 0.0,
        "end/infra_failed": 1.0,
        "end/env_timeout": 0.0,
        "end_frac/answered": 7 / 9,
        "end_frac/truncated": 1 / 9,
        "end_frac/policy_error": 0.0,
        "end_frac/infra_failed": 1 / 9,
        "end_frac/env_timeout": 0.0,
        "traj/in": 9.0,
        "traj/out": 9.0,
        "traj/trainable": 8.0,
    }
    assert set(m) == set(expected)
    for key, value in expected.items():
        assert m[key] == pytest.approx(value), key


def test_every_end_reason_has_a_count_and_in_equals_out() -> None:
    ts = [traj("g", 0.0, (answer(),), end=reason) for reason in EndReason]
    m = rollout_metrics(ts)
    for reason in EndReason:
        assert m[f"end/{reason.value}"] == 1.0
    assert m["traj/in"] == m["traj/out"] == len(EndReason)
    assert m["traj/trainable"] == len(EndReason) - len(NOT_TRAINABLE)


def test_infra_failed_only_is_counted_but_not_scored() -> None:
    m = rollout_metrics([traj("g", 3.0, (answer(),), end=EndReason.INFRA_FAILED)])
    assert m["end/infra_failed"] == 1.0
    assert m["traj/in"] == m["traj/out"] == 1.0
    assert m["traj/trainable"] == 0.0
    assert m["reward/mean"] == 0.0 and m["success/rate"] == 0.0 and m["groups/count"] == 0.0


def test_empty_input_gives_zeros_and_same_keys() -> None:
    m = rollout_metrics([])
    assert set(m) == set(rollout_metrics(batch()))
    assert all(v == 0.0 for v in m.values())
    assert reward_component_means([]) == {}
    assert env_metrics([]) == {}
    assert mean_of([]) == {}


def test_no_tool_calls_gives_zero_valid_frac_not_nan() -> None:
    m = rollout_metrics([traj("g", 0.0, (answer(),))])
    assert m["tools/valid_frac"] == 0.0 and m["tools/calls_total"] == 0.0
    assert m["tools/calls_per_success"] == 0.0  # no success either
    assert not any(math.isnan(v) for v in m.values())


def test_success_prefers_env_verdict_then_threshold() -> None:
    told_success = traj("g", 0.0, (answer(),), info={"success": True})
    told_failure = traj("g", 1.0, (answer(),), info={"success": False})
    partial = traj("g", 0.6, (answer(),))
    assert is_success(told_success) and not is_success(told_failure)
    assert not is_success(partial) and is_success(partial, threshold=0.5)
    assert rollout_metrics([told_success, told_failure, partial])["success/rate"] == pytest.approx(1 / 3)
    assert rollout_metrics([partial], success_threshold=0.5)["success/rate"] == 1.0


def test_singleton_group_has_zero_variance() -> None:
    m = rollout_metrics([traj("a", 1.0, (answer(),)), traj("b", 0.0, (answer(),)), traj("b", 1.0, ())])
    assert m["reward/zero_variance_group_frac"] == 0.5  # group a (one rollout) is zero-variance
    assert m["reward/group_std_mean"] == pytest.approx((0.0 + 0.5) / 2)
    assert m["episode/total_tokens_mean"] == pytest.approx((5 + 5 + 0) / 3)  # a step-less traj has 0


def test_unknown_end_reason_says_how_to_fix() -> None:
    bad = traj("g", 0.0, (answer(),), end="gave_up")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="answered, truncated, policy_error, infra_failed"):
        rollout_metrics([bad])


def test_reward_component_means_sum_per_traj_then_average_over_trainable() -> None:
    ts = [
        traj(
            "g",
            1.2,
            (
                step(1, 1, "tool_call", True, components={"format": 0.1}),
                step(1, 0, "answer", components={"format": 0.1, "correct": 1.0}),
            ),
        ),
        traj("g", 0.0, (step(1, 0, "answer", components={"format": 0.0}),)),
        traj("g", 9.0, (step(1, 0, components={"correct": 9.0}),), end=EndReason.INFRA_FAILED),
    ]
    assert reward_component_means(ts) == pytest.approx(
        {"reward_component/correct": 0.5, "reward_component/format": 0.1}
    )


def test_reward_components_must_be_a_mapping() -> None:
    bad = traj("g", 0.0, (Step((1,), (2,), (-0.1,), (), 0.0, 0, {"reward_components": 1.0}),))
    with pytest.raises(TypeError, match="mapping name -> float"):
        reward_component_means([bad])


def test_env_metrics_split_by_env() -> None:
    ts = [
        traj("g", 1.0, (answer(),), env="calc"),
        traj("g", 0.0, (answer(),), env="calc"),
        traj("h", 1.0, (answer(),), env="search"),
        traj("h", 1.0, (answer(),), env="search", end=EndReason.INFRA_FAILED),
        traj("k", 1.0, (answer(),), env="broken", end=EndReason.INFRA_FAILED),
    ]
    assert env_metrics(ts) == {
        "env/broken/count": 0.0,
        "env/broken/reward_mean": 0.0,
        "env/broken/success_rate": 0.0,
        "env/broken/tool_call_rate": 0.0,
        "env/calc/count": 2.0,
        "env/calc/reward_mean": 0.5,
        "env/calc/success_rate": 0.5,
        "env/calc/tool_call_rate": 0.0,
        "env/search/count": 1.0,
        "env/search/reward_mean": 1.0,
        "env/search/success_rate": 1.0,
        "env/search/tool_call_rate": 0.0,
    }


def test_mean_of_averages_each_key_over_dicts_that_have_it() -> None:
    out = mean_of([{"loss": 1.0, "grad_norm": 2.0}, {"loss": 3.0}, {"loss": 5.0, "grad_norm": 4.0}])
    assert out == {"loss": 3.0, "grad_norm": 3.0}
    assert math.isnan(mean_of([{"g": float("nan")}, {"g": 1.0}])["g"])  # NaN is a signal, kept


def test_tiny_std_groups_are_those_that_differ_by_a_hair():
    from steprl.types import EndReason, Trajectory

    def traj(group: str, reward: float) -> Trajectory:
        return Trajectory("t", group, "calculator", (), reward, EndReason.ANSWERED)

    batch = [traj("a", 1.0), traj("a", 0.99), traj("b", 1.0), traj("b", 1.0), traj("c", 1.0), traj("c", 0.0)]
    assert rollout_metrics(batch)["reward/tiny_std_group_frac"] == pytest.approx(1 / 3)
