"""Sample episodes for the dashboards: which few of a step's episodes to show, and as what text.

TensorBoard (`sinks.TensorBoardSink`) and Weights & Biases (`wandb_sink.WandbSink`) both show a
handful of a step's episodes as text next to the curves, so a person sees what the numbers are
about (a policy that stopped probing shows it in its actions long before the success curve
moves). The Parquet trajectories stay the complete record; these are a glance.

A sink that takes episodes has `log_episodes(step, trajectories, advantages)`; the trainer hands
every step's episodes to `log_episodes(sink, ...)` here, which reaches such sinks inside a
`MultiSink` and skips the others (JSONL), so `MetricsSink` stays the one protocol a sink needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from steprl.types import Trajectory

#: per trajectory (parallel to the step's trajectories): its advantages per turn and action
#: token, None for one not trained on (the contract of `TrajectoryWriter.write`)
StepAdvantages = Sequence[Sequence[Sequence[float]] | None]
Decode = Callable[[Sequence[int]], str]


@runtime_checkable
class EpisodeSink(Protocol):
    def log_episodes(
        self, step: int, trajectories: Sequence[Trajectory], advantages: StepAdvantages | None = None
    ) -> None: ...


def log_episodes(
    sink: Any, step: int, trajectories: Sequence[Trajectory], advantages: StepAdvantages | None = None
) -> None:
    """Hand a step's episodes to `sink`, or to each sink of a `MultiSink` that takes them."""
    for s in getattr(sink, "sinks", (sink,)):
        if isinstance(s, EpisodeSink):
            s.log_episodes(step, trajectories, advantages)


def due(step: int, every: int) -> bool:
    """A sample-episode step: every `every` steps (0: never); step 0 (the warm start's
    evaluation) has no training episodes."""
    return every > 0 and step > 0 and step % every == 0


def pick(trajectories: Sequence[Trajectory], n: int) -> list[Trajectory]:
    """Up to `n` episodes, one per task first (a group's episodes share a prompt: several of one
    task say less than one each of several), in rollout order: the same run picks the same."""
    seen: set[str] = set()
    first: list[Trajectory] = []
    rest: list[Trajectory] = []
    for t in trajectories:
        (rest if t.group_id in seen else first).append(t)
        seen.add(t.group_id)
    return [*first, *rest][:n]


def header(step: int, t: Trajectory) -> str:
    return (
        f"step {step} · env {t.env} · task {t.task_id} · reward {t.outcome_reward:g} · "
        f"end {t.end} · {len(t.steps)} turns"
    )


def transcript(t: Trajectory, decode: Decode) -> str:
    """The episode after its prompt, turn by turn: each action (the model's tokens) and the
    observation that answered it (the env's), marked."""
    parts = []
    for i, s in enumerate(t.steps, start=1):
        parts.append(f"[turn {i} action · reward {s.reward:g}]\n{decode(s.action_ids)}")
        if s.observation_ids:
            parts.append(f"[turn {i} observation]\n{decode(s.observation_ids)}")
    return "\n".join(parts)


def prompt_text(t: Trajectory, decode: Decode) -> str:
    return decode(t.steps[0].prompt_ids) if t.steps else ""


def as_markdown(step: int, t: Trajectory, decode: Decode) -> str:
    """One episode for TensorBoard's text tab (Markdown): the header, then prompt and transcript
    as code blocks, so the model's text is shown as written, not rendered."""
    fence = "```"
    body = f"{prompt_text(t, decode)}\n{transcript(t, decode)}".replace(fence, "` ` `")
    return f"**{header(step, t)}**\n\n{fence}\n{body}\n{fence}"


def flat_advantages(advantages: StepAdvantages | None) -> list[float]:
    """Every trained action token's advantage in the step (the episodes not trained on have none)."""
    if advantages is None:
        return []
    return [float(a) for episode in advantages if episode is not None for turn in episode for a in turn]
