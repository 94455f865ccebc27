"""What the gateway records of a harness's calls: sessions of samples of turns, exact ids only.

A harness (OpenAI Agents SDK, LangGraph, a script with the `openai` client) sends whole message
lists and never sees token ids. Each call's messages are rendered with the model's chat template
(`Gateway.render`); the session then decides where the call belongs:

* **append**: the rendered prompt starts with the session's last prompt + completion ids, as
  sampled: the harness kept the history as the model wrote it. The call is the next turn of the
  same sample (one packed trajectory): the ids between the last completion and the new prompt's
  end are the env's message (tool results, the user's turn), never trained on.
* **branch**: it does not (the harness re-serialised tool arguments, dropped reasoning, edited or
  truncated the history). The call starts a new sample of its own, whose prompt is the render,
  and the branch is counted: no trained token is ever a re-tokenisation of the model's text.

Every completion's ids and log-probs come from one engine call and have equal lengths
(`check_provenance`); anything else fails the call loudly and is counted, never padded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from steprl.engines.base import Generation


class ProvenanceError(RuntimeError):
    """A completion whose ids and log-probs cannot be trained on as they are (never padded)."""


def check_provenance(gen: Generation) -> None:
    """The ids and log-probs of one engine call: equal lengths, finite, at least one token."""
    if len(gen.token_ids) != len(gen.logprobs):
        raise ProvenanceError(
            f"the engine returned {len(gen.token_ids)} ids and {len(gen.logprobs)} log-probs for one call; "
            "refusing to record (padding would train on made-up log-probs)"
        )
    if not gen.token_ids:
        raise ProvenanceError("the engine returned no tokens; nothing to record")
    if any(not math.isfinite(lp) or lp > 0.0 for lp in gen.logprobs):  # NaN, -inf, or a probability above 1
        raise ProvenanceError(
            "the engine returned a log-prob that is not finite or above 0; refusing to record"
        )


@dataclass(frozen=True)
class Turn:
    """One engine call as trained: the exact prompt ids, the sampled ids and their log-probs."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    version: int  # the policy version when the call started
    finish_reason: str
    appended: bool  # extended the sample's previous turn (False: the sample's first turn)
    versions: tuple[int, ...] = ()  # each token's version, when weights changed mid-call (as `Generation`)
    call: int = 0  # the call's number in its session (1, 2, ...): the order the harness made them


@dataclass
class Sample:
    """Turns whose prompts each extend the previous prompt + completion: one packed trajectory."""

    turns: list[Turn] = field(default_factory=list)

    @property
    def ids(self) -> tuple[int, ...]:
        """The whole sequence so far: the last prompt and its completion."""
        last = self.turns[-1]
        return last.prompt_ids + last.completion_ids


@dataclass
class Session:
    """One harness episode's calls (keyed by a header or the API key)."""

    key: str
    samples: list[Sample] = field(default_factory=list)
    branches: int = 0
    refused: str = ""  # a call was refused: "turns" or "tokens", the budget it had spent (`Limits`)
    provenance_errors: int = 0  # calls failed for ids and log-probs that do not match

    def place(self, prompt_ids: Sequence[int]) -> tuple[Sample, bool]:
        """(the sample a call with `prompt_ids` continues, whether it appends to it); a new
        sample (a branch, unless it is the session's first call) when none extends exactly."""
        prompt = tuple(prompt_ids)
        # the longest sample the prompt extends (a retried turn may have left a shorter one that
        # the prompt also extends); equal ids are an exact context too (a completion continued)
        fits = [s for s in self.samples if len(prompt) >= len(s.ids) and prompt[: len(s.ids)] == s.ids]
        if fits:
            return max(fits, key=lambda s: len(s.ids)), True
        sample = Sample()
        if self.samples:
            self.branches += 1
        self.samples.append(sample)
        return sample, False


@dataclass
class GatewayStats:
    """Counters behind the `gateway/*` metrics."""

    calls: int = 0
    later_turns: int = 0  # calls after a session's first
    branches: int = 0
    provenance_errors: int = 0
    tokens: int = 0  # completion tokens recorded
    exact_tokens: int = 0  # of those, sampled on a context that is the session's exact ids

    def record(self, turn: Turn, first_of_session: bool, branched: bool) -> None:
        self.calls += 1
        self.later_turns += not first_of_session
        self.branches += branched
        self.tokens += len(turn.completion_ids)
        self.exact_tokens += len(turn.completion_ids) if not branched else 0

    def metrics(self) -> dict[str, float]:
        return {
            "gateway/calls": float(self.calls),
            "gateway/exact_token_share": self.exact_tokens / self.tokens if self.tokens else 1.0,
            "gateway/branch_rate": self.branches / self.later_turns if self.later_turns else 0.0,
            "gateway/provenance_errors": float(self.provenance_errors),
        }
