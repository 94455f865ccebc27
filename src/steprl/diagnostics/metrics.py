"""Rollout metrics: pure functions from trajectories to flat `{"namespace/name": float}` dicts.

Why flat dicts with slash keys: every sink (JSONL, TensorBoard, W&B) and every plot reads them
without knowing what produced them, and TensorBoard groups charts by the part before the slash.

Conventions shared by every function here:

* **Infra failures are counted, never scored.** An `infra_failed` trajectory ended because a tool
  or server broke, not because of anything the policy did; scoring it as reward 0 would teach the
  policy (and the person reading the curve) something false. So it appears in `end/*` and `traj/*`
  and is excluded from every reward, success, episode and tool statistic.
* **No NaN, ever.** A statistic with nothing to average over (empty input, no successful
  trajectory, no tool call) is 0.0, and every key is always present, so curves do not break and
  monitors never compare against NaN. Where 0.0 would be ambiguous, a count is logged next to it
  (`traj/trainable`, `tools/calls_total`) so a reader can tell "none" from "zero".
* **Population statistics** (ddof = 0): a group of G rollouts *is* the population the advantage
  is normalised over (GRPO divides by the in-group std), so the diagnostic matches what the
  learner sees.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence

from steprl.types import NOT_TRAINABLE, EndReason, Trajectory

#: Rewards closer than this count as equal when deciding that a group has zero variance.
ZERO_VARIANCE_TOL = 1e-8
TINY_STD = 0.05  # a group whose rewards differ by less (a small per-call cost, rounding) is near-flat


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else 0.0


def _pstd(values: Sequence[float]) -> float:
    """Population standard deviation (ddof = 0); 0.0 for fewer than two values."""
    if len(values) < 2:
        return 0.0
    mu = _mean(values)
    return math.sqrt(math.fsum((v - mu) ** 2 for v in values) / len(values))


def _end_reason(traj: Trajectory) -> EndReason:
    try:
        return EndReason(traj.end)
    except ValueError:
        allowed = ", ".join(r.value for r in EndReason)
        raise ValueError(
            f"Trajectory {traj.task_id!r} has end={traj.end!r}; it must be one of: {allowed}. "
            "Set `end` with the EndReason enum where the trajectory is built (the agent loop)."
        ) from None


def is_success(traj: Trajectory, threshold: float = 1.0) -> bool:
    """Did the episode succeed?

    The env's own verdict wins: `traj.info["success"]` when present (an env with shaped or
    partial rewards knows better than a threshold). Otherwise `outcome_reward >= threshold`,
    which with the default 1.0 means "got the full reward" for 0/1-reward envs.
    """
    if "success" in traj.info:
        return bool(traj.info["success"])
    return traj.outcome_reward >= threshold


def tool_calls(traj: Trajectory) -> int:
    """Number of steps whose action was a tool call (`step.info["action_kind"] == "tool_call"`)."""
    return sum(1 for s in traj.steps if s.info.get("action_kind") == "tool_call")


def valid_tool_calls(traj: Trajectory) -> int:
    """Number of tool-call steps the env marked `tool_call_valid` (parsed and accepted)."""
    return sum(
        1
        for s in traj.steps
        if s.info.get("action_kind") == "tool_call" and bool(s.info.get("tool_call_valid", False))
    )


def total_tokens(traj: Trajectory) -> int:
    """Length of the whole transcript: the first prompt, then every action and observation.

    This is the context an append-only agent ends with; it ignores re-rendering by other
    context rules on purpose, so the number is comparable across context rules.
    """
    first_prompt = len(traj.steps[0].prompt_ids) if traj.steps else 0
    return first_prompt + traj.num_action_tokens + traj.num_observation_tokens


def rollout_metrics(
    trajectories: Sequence[Trajectory], *, success_threshold: float = 1.0
) -> dict[str, float]:
    """Reward, success, episode-shape, tool-use and end-reason metrics for one batch of rollouts.

    Groups are formed from `Trajectory.group_id` (all rollouts of one task share it). Only
    trainable trajectories (not `infra_failed` / `env_timeout`) enter the reward / success / episode / tool
    statistics; `end/*` and `traj/*` count all of them, and `traj/in == traj/out` always.

    Keys (all always present):
      reward/{mean,std,min,max}     over trainable trajectories' `outcome_reward` (population std)
      reward/group_std_mean         mean over groups of the in-group population std of rewards;
                                    a group with one trainable rollout has std 0
      reward/zero_variance_group_frac  share of groups (with >= 1 trainable rollout) whose rewards
                                    are all equal: groups that give GRPO-style advantages no signal
      reward/tiny_std_group_frac    share of groups whose rewards differ but whose std is under
                                    TINY_STD: what dividing by the group's std blows up into
                                    unit-size advantages (a cost of 0.01 becomes "call less")
      groups/count                  number of such groups
      success/rate                  share of trainable trajectories for which `is_success` holds
      episode/{turns,action_tokens,observation_tokens,total_tokens}_mean, episode/turns_max
      tools/calls_total, tools/calls_per_traj, tools/call_rate (share with >= 1 call),
      tools/valid_frac              valid calls / calls; 0.0 when there were no calls (read it
                                    with tools/calls_total)
      tools/calls_per_success       mean tool calls over successful trajectories; 0.0 if none
      actions/invalid_frac          share of steps with `action_kind == "invalid"`
      end/<reason>                  count, for every EndReason; end_frac/<reason> the share
      traj/in, traj/out, traj/trainable
    """
    trainable = [t for t in trajectories if _end_reason(t) not in NOT_TRAINABLE]
    rewards = [t.outcome_reward for t in trainable]

    by_group: dict[str, list[float]] = defaultdict(list)
    for t in trainable:
        by_group[t.group_id].append(t.outcome_reward)
    group_stds = [_pstd(rs) for rs in by_group.values()]
    zero_var = [max(rs) - min(rs) <= ZERO_VARIANCE_TOL for rs in by_group.values()]
    tiny = [not z and sd < TINY_STD for z, sd in zip(zero_var, group_stds, strict=True)]

    successes = [t for t in trainable if is_success(t, success_threshold)]
    calls = [tool_calls(t) for t in trainable]
    n_calls = sum(calls)
    n_valid = sum(valid_tool_calls(t) for t in trainable)
    all_steps = [s for t in trainable for s in t.steps]
    n_invalid = sum(1 for s in all_steps if s.info.get("action_kind") == "invalid")

    m: dict[str, float] = {
        "reward/mean": _mean(rewards),
        "reward/std": _pstd(rewards),
        "reward/min": min(rewards, default=0.0),
        "reward/max": max(rewards, default=0.0),
        "reward/group_std_mean": _mean(group_stds),
        "reward/zero_variance_group_frac": _mean([float(z) for z in zero_var]),
        "reward/tiny_std_group_frac": _mean([float(t) for t in tiny]),
        "groups/count": float(len(by_group)),
        "success/rate": len(successes) / len(trainable) if trainable else 0.0,
        "episode/turns_mean": _mean([float(len(t.steps)) for t in trainable]),
        "episode/turns_max": float(max((len(t.steps) for t in trainable), default=0)),
        "episode/action_tokens_mean": _mean([float(t.num_action_tokens) for t in trainable]),
        "episode/observation_tokens_mean": _mean([float(t.num_observation_tokens) for t in trainable]),
        "episode/total_tokens_mean": _mean([float(total_tokens(t)) for t in trainable]),
        "tools/calls_total": float(n_calls),
        "tools/calls_per_traj": _mean([float(c) for c in calls]),
        "tools/call_rate": _mean([float(c > 0) for c in calls]),
        "tools/valid_frac": n_valid / n_calls if n_calls else 0.0,
        "tools/calls_per_success": _mean([float(tool_calls(t)) for t in successes]),
        "actions/invalid_frac": n_invalid / len(all_steps) if all_steps else 0.0,
    }

    counts = {reason: 0 for reason in EndReason}
    for t in trajectories:
        counts[_end_reason(t)] += 1
    n_in = len(trajectories)
    for reason, count in counts.items():
        m[f"end/{reason.value}"] = float(count)
        m[f"end_frac/{reason.value}"] = count / n_in if n_in else 0.0
    m["traj/in"] = float(n_in)
    m["traj/out"] = float(sum(counts.values()))
    m["traj/trainable"] = float(len(trainable))
    return m


def reward_component_means(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Mean per trajectory of each reward component, as `reward_component/<name>`.

    Each trajectory's component total is the sum over its steps of
    `step.info["reward_components"][name]`; the mean is over all trainable trajectories, a
    trajectory that never received a component contributing 0 (so the component means add up
    to `reward/mean` when the components sum to the step rewards). Empty input -> `{}`.
    """
    trainable = [t for t in trajectories if _end_reason(t) not in NOT_TRAINABLE]
    totals: dict[str, float] = defaultdict(float)
    for t in trainable:
        for s in t.steps:
            components = s.info.get("reward_components", {})
            if not isinstance(components, Mapping):
                raise TypeError(
                    f"Trajectory {t.task_id!r}: step.info['reward_components'] is "
                    f"{type(components).__name__}; the env must put a mapping name -> float there."
                )
            for name, value in components.items():
                totals[name] += float(value)
    return {f"reward_component/{name}": total / len(trainable) for name, total in sorted(totals.items())}


def env_metrics(trajectories: Sequence[Trajectory], *, success_threshold: float = 1.0) -> dict[str, float]:
    """Per-env reward mean, success rate, tool-call rate and count, as
    `env/<env>/{reward_mean,success_rate,tool_call_rate,count}`.

    For multi-task runs: one env improving can hide another collapsing in the batch mean (or
    the policy quietly no longer calling one env's tool). Infra failures are excluded (an env
    with only infra failures reports count 0).
    """
    by_env: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        bucket = by_env[t.env]  # create the key even for an env that only failed
        if _end_reason(t) not in NOT_TRAINABLE:
            bucket.append(t)
    m: dict[str, float] = {}
    for env, ts in sorted(by_env.items()):
        m[f"env/{env}/reward_mean"] = _mean([t.outcome_reward for t in ts])
        m[f"env/{env}/success_rate"] = _mean([float(is_success(t, success_threshold)) for t in ts])
        m[f"env/{env}/tool_call_rate"] = _mean([float(tool_calls(t) > 0) for t in ts])
        m[f"env/{env}/count"] = float(len(ts))
    return m


def mean_of(dicts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Average per key over several metric dicts (e.g. the learner's per-micro-batch stats).

    A key missing from some dicts is averaged over the dicts that have it. A NaN value is kept
    (a NaN gradient norm is a signal to see, not to smooth away). Empty input -> `{}`.
    """
    sums: dict[str, list[float]] = defaultdict(list)
    for d in dicts:
        for key, value in d.items():
            sums[key].append(float(value))
    return {key: _mean(values) for key, values in sums.items()}


def template_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """How often a harness that re-templates the conversation text every turn would have fed the
    model different ids than the exact ones (chat formats; `info["template_match"]`, set by the
    agent loop for multi-turn append-only episodes). Non-canonical sampled tokenizations and
    templates that rewrite history both count.

      rollout/template_checked        trajectories compared
      rollout/template_mismatch_rate  share of them whose whole render differed (0.0 when none)
    """
    checked = [t.info["template_match"] for t in trajectories if "template_match" in t.info]
    bad = sum(1 for ok in checked if not ok)
    return {
        "rollout/template_checked": float(len(checked)),
        "rollout/template_mismatch_rate": bad / len(checked) if checked else 0.0,
    }


def gateway_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """A harness env's calls through the gateway (`info["gateway_*"]`, set per episode by
    `gateway/harness_runner.py`); none when no trajectory came through it.

      gateway/calls              model calls recorded
      gateway/exact_token_share  share of sampled tokens whose context was the session's exact ids
      gateway/branch_rate        branches per call after a session's first
      gateway/provenance_errors  calls failed because ids and log-probs did not match
    """
    through = [t.info for t in trajectories if "gateway_calls" in t.info]
    if not through:
        return {}
    calls = sum(int(i["gateway_calls"]) for i in through)
    tokens = sum(int(i["gateway_tokens"]) for i in through)
    later = sum(max(int(i["gateway_calls"]) - 1, 0) for i in through)
    return {
        "gateway/calls": float(calls),
        "gateway/exact_token_share": sum(int(i["gateway_exact_tokens"]) for i in through) / tokens
        if tokens
        else 1.0,
        "gateway/branch_rate": sum(int(i["gateway_branches"]) for i in through) / later if later else 0.0,
        "gateway/provenance_errors": float(sum(int(i["gateway_provenance_errors"]) for i in through)),
    }
