"""Core records that move through steprl: tasks in, trajectories out.

Everything downstream of the agent loop reads these frozen records; nothing re-tokenizes text.
A `Step` holds the exact token ids the policy conditioned on and sampled, so the learner can
recompute log-probs on precisely what the engine saw.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any

_EMPTY: Mapping[str, Any] = MappingProxyType({})


class EndReason(StrEnum):
    """How a trajectory ended. A type, never a convention (cf. Gymnasium terminated/truncated)."""

    ANSWERED = "answered"  # the episode reached a terminal state (right or wrong answer)
    TRUNCATED = "truncated"  # turn / token / time budget ran out; not the policy's fault
    POLICY_ERROR = "policy_error"  # too many invalid actions (each one was shown to the model)
    INFRA_FAILED = "infra_failed"  # env/tool/server failure: excluded from the loss, counted
    ENV_TIMEOUT = "env_timeout"  # an env call passed its deadline: excluded from the loss, counted


#: End reasons that are the infrastructure's fault: counted, never trained on, never scored.
NOT_TRAINABLE = frozenset({EndReason.INFRA_FAILED, EndReason.ENV_TIMEOUT})


@dataclass(frozen=True)
class Task:
    """One unit of work: data only (id, prompt, which env, its params, seed, reference answer)."""

    id: str
    prompt: str
    env: str
    seed: int = 0
    answer: str | None = None
    params: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)


@dataclass(frozen=True)
class Step:
    """One policy action and the environment's answer to it, as exact token ids.

    `action_logprobs[i]` is the behaviour policy's log-prob of `action_ids[i]` under the
    temperature-scaled, untruncated distribution (what the learner recomputes).
    """

    prompt_ids: tuple[int, ...]  # exactly what the model conditioned on
    action_ids: tuple[int, ...]  # exactly what it sampled (including the stop tag, if any)
    action_logprobs: tuple[float, ...]
    observation_ids: tuple[int, ...]  # env feedback, tokenized once, never trained on
    reward: float  # step reward (sum of the components in info["reward_components"])
    policy_version: int  # the engine's version when the turn started
    info: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    #: the policy version that sampled each action token; () = all `policy_version`. A partial
    #: rollout (asynchronous training) gets new weights between decode steps, mid-turn.
    action_versions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.action_ids) != len(self.action_logprobs):
            raise ValueError(
                f"Step has {len(self.action_ids)} action tokens but {len(self.action_logprobs)} "
                "log-probs; the engine must return one log-prob per sampled token."
            )
        if self.action_versions and len(self.action_versions) != len(self.action_ids):
            raise ValueError(
                f"Step has {len(self.action_ids)} action tokens but {len(self.action_versions)} "
                "token versions; give one per token or none."
            )

    @property
    def token_versions(self) -> tuple[int, ...]:
        """The policy version of every action token."""
        return self.action_versions or (self.policy_version,) * len(self.action_ids)


@dataclass(frozen=True)
class Trajectory:
    """A whole episode: the steps, the outcome, and why it ended."""

    task_id: str
    group_id: str
    env: str
    steps: tuple[Step, ...]
    outcome_reward: float  # the episode's scalar return (sum of step rewards)
    end: EndReason
    info: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)

    @property
    def trainable(self) -> bool:
        """Infra failures and env timeouts never become training samples (they would look like
        reward 0 and teach the policy that a broken server is its fault)."""
        return self.end not in NOT_TRAINABLE

    @property
    def num_action_tokens(self) -> int:
        return sum(len(s.action_ids) for s in self.steps)

    @property
    def num_observation_tokens(self) -> int:
        return sum(len(s.observation_ids) for s in self.steps)

    @property
    def token_versions(self) -> tuple[int, ...]:
        """The policy version of every action token, in order."""
        return tuple(v for s in self.steps for v in s.token_versions)


@dataclass(frozen=True)
class Group:
    """All rollouts of one task: the unit over which group-relative advantages are computed."""

    task: Task
    trajectories: tuple[Trajectory, ...]
