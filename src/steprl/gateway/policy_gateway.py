"""`Gateway`: the policy behind an OpenAI-style chat call, recording exact training tokens.

Each call: the messages rendered with the model's chat template (`ChatFormat.render`, the tools
given to the template as the harness sent them), placed in its session (`Session.place`: append
or branch), sampled by the run's engine (`Engine.generate`: the same call the agent loop makes),
its provenance checked (`check_provenance`), recorded as a `Turn`, and its text returned in the
OpenAI shape (`openai_format.parse_reply`). Calls of one session run one at a time (a session is
one conversation); sessions run concurrently and the engine batches them.

Seeds: a request's `seed` if it has one, else one derived from the session key and the call's
number in it, so a harness replayed with the same keys samples the same tokens. A session
`open`ed with an episode seed (the harness env's episodes) draws call k's seed as the agent loop
draws turn k's (`seeds.turn_seed`), so a harness that sends what the loop would samples what the
loop would.

`Limits` (the harness env: the run's `rollout` section) hold every call to the run's sampling
(the temperature the learner recomputes log-probs at, whatever the request says) and budgets:
past `max_turns` calls, or with no room left in `max_total_tokens`, a call is refused
(`BudgetExceeded`, a 400) and the session says which budget (`Session.refused`). An episode's
session is `end`ed: calls that outlive the episode are refused (`SessionClosed`, a 400).

`context` (the model's positions) bounds every call: a prompt that does not fit, or a prompt +
`max_tokens` past it, is refused with both numbers (`ContextExceeded`, a 400) before the engine
sees it (the engine would sample past the positions it was trained on); without `max_tokens`
the completion gets what the context leaves.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from steprl.engines.base import Engine, SamplingParams
from steprl.gateway.openai_format import Reply, parse_reply
from steprl.gateway.sessions import GatewayStats, ProvenanceError, Sample, Session, Turn, check_provenance
from steprl.rollout import seeds
from steprl.rollout.chat_format import ChatFormat


@dataclass(frozen=True)
class Sampling:
    """What a request may set (the rest is the gateway's)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None  # None: the per-turn budget of `Limits`, else 256
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass(frozen=True)
class Limits:
    """What a harness env's run fixes for every call (its `rollout` section)."""

    temperature: float
    top_p: float
    max_turns: int  # calls per session
    max_tokens_per_turn: int
    max_total_tokens: int  # prompt + completion


class BudgetExceeded(ValueError):
    """A call past the session's turn budget, or with no room left for a completion."""


class SessionClosed(ValueError):
    """A call on a session whose episode is over (a harness's call that outlived its episode)."""


class ContextExceeded(ValueError):
    """A prompt, or a prompt + `max_tokens`, past the model's context (the message has the numbers)."""


def context_room(context: int, prompt_len: int, asked: int | None) -> int:
    """The tokens a completion may have after a `prompt_len` prompt; `ContextExceeded` when the
    prompt leaves none, or an explicit `asked` does not fit."""
    if prompt_len >= context:
        raise ContextExceeded(
            f"the prompt is {prompt_len} tokens, the model's context is {context} (prompt + completion); "
            "send shorter messages"
        )
    if asked is not None and prompt_len + asked > context:
        raise ContextExceeded(
            f"the prompt ({prompt_len} tokens) + max_tokens ({asked}) is {prompt_len + asked}, past the "
            f"model's context of {context} tokens; ask for at most {context - prompt_len}"
        )
    return context - prompt_len


def normalise(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates take them: `developer` is `system`, `content: null` (an
    assistant turn of tool calls only) is "", a list of text parts is their text joined; any
    other role or part (images) is a `ValueError` (a template would drop it in silence)."""
    out = []
    for i, m in enumerate(messages):
        role = {"developer": "system"}.get(str(m.get("role")), m.get("role"))  # OpenAI's newer name
        if role not in ("system", "user", "assistant", "tool"):
            raise ValueError(
                f"messages[{i}].role: one of system, developer, user, assistant, tool; got {role!r}"
            )
        content = m.get("content")
        if isinstance(content, list):
            kinds = {p.get("type") for p in content if isinstance(p, Mapping)} - {"text"}
            if kinds or not all(isinstance(p, Mapping) for p in content):
                raise ValueError(
                    f"messages[{i}].content: only text parts are supported, got {sorted(map(str, kinds))}"
                )
            content = "".join(str(p.get("text", "")) for p in content)
        out.append({**m, "role": role, "content": "" if content is None else content})
    return out


def _seed(key: str, n: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}:{n}".encode(), digest_size=8).digest(), "big") >> 1


class Gateway:
    def __init__(
        self,
        engine: Engine,
        fmt: ChatFormat,
        model_name: str,
        *,
        max_tokens_cap: int = 4096,
        max_sessions: int = 10_000,  # the oldest session is dropped past this (a server that runs long)
        context: int | None = None,  # the model's positions (prompt + completion); None: unchecked
    ) -> None:
        self.engine, self.fmt, self.model_name, self.context = engine, fmt, model_name, context
        self.max_tokens_cap, self.max_sessions = max_tokens_cap, max_sessions
        self.sessions: dict[str, Session] = {}
        self.stats = GatewayStats()
        self.limits: Limits | None = None
        self._locks: dict[str, asyncio.Lock] = {}
        self._calls: dict[str, int] = {}
        self._episode_seeds: dict[str, int] = {}
        self._closed: deque[str] = deque(maxlen=max_sessions)  # episodes over: later calls refused

    def open(self, key: str, episode_seed: int) -> None:
        """Start session `key` as an episode: call k draws `seeds.turn_seed(episode_seed, k)`. A
        key whose episode ended starts afresh: every evaluation runs the same tasks with the same
        seeds, hence the same keys (the ended episode's client is closed: none of its calls is left)."""
        if key in self._closed:
            self._closed.remove(key)
        self._episode_seeds[key] = episode_seed
        self.sessions.setdefault(key, Session(key))

    def render(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()
    ) -> tuple[int, ...]:
        """The prompt ids of a chat call: the template's render of the messages, generation prompt
        on. A template that refuses them is a `ValueError` (the harness's request, a 400)."""
        try:
            text = self.fmt.render(normalise(messages), tools=tools, gen=True)
        except (TemplateError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(
                f"the chat template cannot render these messages: {type(exc).__name__}: {exc}"
            ) from None
        return self.fmt.template_ids(text)

    async def chat(
        self,
        key: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] = (),
        sampling: Sampling = Sampling(),
    ) -> tuple[Turn, Reply]:
        prompt = self.render(messages, tools)
        turn, n = await self._sample(key, prompt, sampling)
        text = self.fmt.decode(turn.completion_ids)
        return turn, parse_reply(text, turn.finish_reason, call_prefix=f"call_{_seed(key, 0) % 10**8}_{n}")

    async def sample(self, key: str, prompt: Sequence[int], sampling: Sampling) -> Turn:
        """One engine call for session `key` on exact `prompt` ids, recorded (or a loud error)."""
        return (await self._sample(key, prompt, sampling))[0]

    async def _sample(self, key: str, prompt: Sequence[int], sampling: Sampling) -> tuple[Turn, int]:
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            if key not in self.sessions and len(self.sessions) >= self.max_sessions:
                self.take(next(iter(self.sessions)))  # the oldest session goes: memory stays bounded
            if key in self._closed:
                raise SessionClosed(f"session {key!r} is over (its episode ended); this call is not recorded")
            session = self.sessions.setdefault(key, Session(key))
            asked = sampling.max_tokens
            # before any budget: a call that cannot fit is refused and never counted
            fits = context_room(self.context, len(prompt), asked) if self.context is not None else None
            if asked is None:
                asked = self.limits.max_tokens_per_turn if self.limits else 256
                asked = asked if fits is None else min(asked, fits)
            room = self._room(session, key, len(prompt), min(asked, self.max_tokens_cap))
            first = not session.samples
            sample, appended = session.place(prompt)
            n = self._calls[key] = self._calls.get(key, 0) + 1
            stop_ids, stop_seqs = self.fmt.stop_tokens(sampling.stop)
            fixed = self.limits
            params = SamplingParams(
                temperature=fixed.temperature if fixed else sampling.temperature,
                top_p=fixed.top_p if fixed else sampling.top_p,
                max_new_tokens=room,
                stop_token_ids=stop_ids,
                stop_sequences=stop_seqs,
            )
            version = self.engine.version
            try:
                if key in self._episode_seeds:  # as the agent loop seeds turn n - 1
                    seed = seeds.turn_seed(self._episode_seeds[key], n - 1)
                else:
                    seed = sampling.seed if sampling.seed is not None else _seed(key, n)
                gen = await self.engine.generate(tuple(prompt), params, seed=seed)
                check_provenance(gen)
            except BaseException as exc:  # the engine failed or lied: the call leaves no trace
                self.stats.provenance_errors += isinstance(exc, ProvenanceError)
                session.provenance_errors += isinstance(exc, ProvenanceError)
                if not sample.turns:  # the sample this call opened holds nothing
                    session.samples.remove(sample)
                    session.branches -= not first
                raise
            turn = Turn(
                tuple(prompt),
                gen.token_ids,
                gen.logprobs,
                version,
                gen.finish_reason,
                appended,
                gen.versions,
                call=n,
            )
            sample.turns.append(turn)
            self.stats.record(turn, first_of_session=first, branched=not first and not appended)
            return turn, n

    def _room(self, session: Session, key: str, prompt_len: int, asked: int) -> int:
        """The completion's token budget; `BudgetExceeded` (and `session.refused` set) when the
        limits leave none."""
        limits = self.limits
        if limits is None:
            return asked
        room = min(asked, limits.max_tokens_per_turn, limits.max_total_tokens - prompt_len)
        if self._calls.get(key, 0) >= limits.max_turns:
            session.refused = "turns"
            raise BudgetExceeded(
                f"the episode's turn budget is spent (rollout.max_turns = {limits.max_turns})"
            )
        if room <= 0:
            session.refused = "tokens"
            raise BudgetExceeded(
                f"the prompt is {prompt_len} tokens; no room left in rollout.max_total_tokens = "
                f"{limits.max_total_tokens}"
            )
        return room

    async def end(self, key: str) -> Session:
        """An episode's session, once over: later calls on it are refused (`SessionClosed`), a
        call still in flight is waited for (its turn is kept), then the session is taken."""
        self._closed.append(key)
        lock = self._locks.get(key)
        if lock is not None:
            async with lock:
                pass
        return self.finish(key)

    def take(self, key: str) -> list[Sample]:
        """The session's samples, and the session forgotten (a harness episode is over). Refused
        while one of its calls is in flight (its turn would be lost)."""
        return self.finish(key).samples

    def finish(self, key: str) -> Session:
        """`take`, with the whole session (its branches, whether a call was refused)."""
        lock = self._locks.get(key)
        if lock is not None and lock.locked():
            raise RuntimeError(f"session {key!r} has a call in flight; take it once the call has returned")
        self._locks.pop(key, None)
        self._calls.pop(key, None)
        self._episode_seeds.pop(key, None)
        return self.sessions.pop(key, None) or Session(key)

    def metrics(self) -> dict[str, float]:
        return self.stats.metrics()
