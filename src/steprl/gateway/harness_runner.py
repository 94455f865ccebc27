"""A harness env's episode (`env.name: harness`, `envs/harness.py`): the user's
`run(task, client)` against the gateway, its recorded calls turned into a trajectory.

Per episode: a gateway session opened with the episode's seed (call k samples with the seed
the agent loop gives turn k), an `openai.AsyncOpenAI` client whose API key names that session,
talking to the gateway's real ASGI app in-process (`httpx.ASGITransport`: the HTTP API a
harness sees, without a socket), the harness awaited within its `timeout_s`, then the session
taken and turned into steps (`trajectory_of`):

* each recorded call is a `Step`: its exact prompt ids, sampled ids and log-probs, its policy
  version(s); within a sample, the ids between one completion and the next call's prompt end
  (the harness's tool results and user turns) are that step's observation, never trained on;
* a branched session (the harness re-serialised or edited its history) holds several samples,
  whose steps follow one another: the training view packs a trajectory only where every
  prompt extends the context before it, and takes one row per step otherwise
  (`rollout.views.training_view`);
* the harness's return value is the reward, on the last step. A harness that raises ends
  `infra_failed`, one that runs past its time `env_timeout` (both counted, never trained on);
  a call the gateway refused for the run's budgets ends it `truncated`; a harness that never
  called the model, or returned no finite number, `infra_failed` with why; so does one whose
  calls named another session (an `x-session-id` header): they are not the episode's, and that
  session is ended with it, never left behind;
* the system prompt the harness sent first (`info["system_prompt"]`, "" for none): what the
  warm start's demonstrations are compared with at the first evaluation
  (`training/loop/evaluate.py: system_prompt_note`).

The gateway's counters are the run's `gateway/*` metrics (`HarnessRunner.metrics`).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import math
import secrets
import traceback
from typing import Any

from steprl.envs.spec import Harness
from steprl.gateway.policy_gateway import Gateway, Limits
from steprl.gateway.sessions import GatewayStats, Session, Turn
from steprl.rollout.chat_format import ChatFormat
from steprl.rollout.loop import RolloutSetup
from steprl.types import NOT_TRAINABLE, EndReason, Step, Task, Trajectory

_BASE = "http://steprl-gateway"


def trajectory_of(
    session: Session, task: Task, group_id: str, reward: float, end: EndReason, info: dict[str, Any]
) -> Trajectory:
    """The session's calls as one trajectory, in the order the harness made them (see the module
    docstring)."""
    turns: list[tuple[Turn, int, tuple[int, ...]]] = []  # (call, its sample, its observation ids)
    for k, sample in enumerate(session.samples):
        for i, turn in enumerate(sample.turns):
            after = len(turn.prompt_ids) + len(turn.completion_ids)
            nxt = sample.turns[i + 1].prompt_ids[after:] if i + 1 < len(sample.turns) else ()
            turns.append((turn, k, tuple(nxt)))
    turns.sort(key=lambda t: t[0].call)
    trainable = end not in NOT_TRAINABLE
    steps = tuple(
        Step(
            prompt_ids=turn.prompt_ids,
            action_ids=turn.completion_ids,
            action_logprobs=turn.logprobs,
            observation_ids=obs,
            # the harness's reward, on its last call
            reward=reward if trainable and j == len(turns) - 1 else 0.0,
            policy_version=turn.version,
            info={"finish_reason": turn.finish_reason, "sample": k, "appended": turn.appended},
            action_versions=turn.versions if set(turn.versions) - {turn.version} else (),
        )
        for j, (turn, k, obs) in enumerate(turns)
    )
    info = {
        **info,
        # what `diagnostics.gateway_metrics` sums into the step's gateway/* metrics
        "gateway_calls": len(turns),
        "gateway_branches": session.branches,
        "gateway_tokens": sum(len(t.completion_ids) for t, _, _ in turns),
        # a branched sample's first call was sampled on a re-rendered context: not exact
        "gateway_exact_tokens": sum(len(t.completion_ids) for t, k, _ in turns if t.appended or k == 0),
        "gateway_provenance_errors": session.provenance_errors,
        "samples": len(session.samples),
    }
    return Trajectory(task.id, group_id, task.env, steps, reward if trainable else 0.0, end, info)


class _Requests:
    """What a harness episode's HTTP requests showed (an httpx request hook): the sessions its
    calls named other than its own, and the system prompt of its first chat call."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.foreign: set[str] = set()
        self.system_prompt: str | None = None  # None: no chat call seen yet

    async def __call__(self, request: Any) -> None:
        named = request.headers.get("x-session-id")
        if named is not None and named != self.key:
            self.foreign.add(named)
        if self.system_prompt is None and request.url.path.endswith(("/chat/completions", "/messages")):
            try:
                body = request.content
            except Exception:  # a streamed body (never the openai client's): not read here
                return
            self.system_prompt = _system_text(body)

    def foreign_error(self, calls: int) -> str:
        names = ", ".join(repr(k) for k in sorted(self.foreign))
        return (
            f"the harness sent {calls} call(s) to session {names} (an x-session-id header), not to its "
            "episode's, so none is trained on; drop the header (the client's API key names the episode)"
        )


def _system_text(body: bytes) -> str:
    """The system prompt of a chat call's JSON body: its first message's, when that is a system
    (or developer) message, or `system` (/v1/messages); "" when it has none."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(data, dict):
        return ""
    messages = data.get("messages") or [{}]
    first = messages[0] if isinstance(messages, list) and isinstance(messages[0], dict) else {}
    text = data.get("system") or (
        first.get("content") if first.get("role") in ("system", "developer") else ""
    )
    if isinstance(text, list):  # text parts
        text = "".join(str(p.get("text", "")) for p in text if isinstance(p, dict))
    return text if isinstance(text, str) else ""


class HarnessRunner:
    """Runs `harness` episodes on whatever engine and sampling the rollout set-up holds (RL or
    eval): one gateway per (engine, sampling, budgets), made on first use."""

    def __init__(self, harness: Harness) -> None:
        from steprl.extras import require

        require("openai", extra="llm", feature="env.name: harness")
        require("fastapi", extra="serve", feature="env.name: harness")
        self.harness = harness
        self.token = secrets.token_urlsafe(16)
        self._gateways: dict[tuple[Any, ...], tuple[Gateway, Any]] = {}

    def gateway(self, setup: RolloutSetup) -> tuple[Gateway, Any]:
        from steprl.gateway.app import make_app

        if not isinstance(setup.fmt, ChatFormat):
            raise TypeError(
                "env harness needs a chat format to render the harness's messages: a chat model, or the "
                "tiny model with model.format=chat and model.chat_template"
            )
        b, s = setup.budgets, setup.sampling
        key = (
            id(setup.engine),
            s.temperature,
            s.top_p,
            b.max_turns,
            b.max_tokens_per_turn,
            b.max_total_tokens,
        )
        if key not in self._gateways:
            gateway = Gateway(setup.engine, setup.fmt, "policy")
            gateway.limits = Limits(
                s.temperature, s.top_p, b.max_turns, b.max_tokens_per_turn, b.max_total_tokens
            )
            self._gateways[key] = (gateway, make_app(gateway, self.token))
        return self._gateways[key]

    def metrics(self) -> dict[str, float]:
        """The `gateway/*` metrics over every call so far (all of this runner's gateways)."""
        total = GatewayStats()
        for gateway, _ in self._gateways.values():
            for name in vars(total):
                setattr(total, name, getattr(total, name) + getattr(gateway.stats, name))
        return total.metrics()

    async def __call__(self, task: Task, setup: RolloutSetup, group_id: str, seed: int) -> Trajectory:
        import openai

        # the SDK's own HTTP client class (openai 3 speaks httpx2, earlier ones httpx), on the
        # gateway's ASGI app: the HTTP API a harness sees, in-process
        http_lib = importlib.import_module(openai.DefaultAsyncHttpxClient.__mro__[1].__module__)

        info: dict[str, Any] = {}
        reward, end = 0.0, EndReason.ANSWERED
        try:
            gateway, app = self.gateway(setup)
        except TypeError as exc:
            failed = EndReason.INFRA_FAILED
            return Trajectory(task.id, group_id, task.env, (), 0.0, failed, {"error": str(exc)})
        key = f"{group_id}.{seed}"
        gateway.open(key, seed)
        seen = _Requests(key)
        http = openai.DefaultAsyncHttpxClient(
            transport=http_lib.ASGITransport(app=app), base_url=_BASE, event_hooks={"request": [seen]}
        )
        client = openai.AsyncOpenAI(
            base_url=f"{_BASE}/v1", api_key=f"{self.token}.{key}", http_client=http, max_retries=0
        )
        refusal: Exception | None = None  # the harness let a budget refusal raise
        try:
            value = await asyncio.wait_for(self.harness.run(task, client), self.harness.timeout_s)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                end = EndReason.INFRA_FAILED
                info = {"error": f"the harness returned {value!r}, not a finite reward"}
            else:
                reward = float(value)
        except TimeoutError:
            limit = self.harness.timeout_s
            end = EndReason.ENV_TIMEOUT
            info = {"error": f"the harness {self.harness.path} ran past timeout_s = {limit:g}"}
        except Exception as exc:  # the harness's own failure: counted, never trained on
            end = EndReason.INFRA_FAILED
            info = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=5)}
            refusal = exc if getattr(exc, "type", None) == "budget_exceeded" else None  # openai's error type
        finally:
            # the episode is over whatever happened (a cancel too): later calls are refused, one
            # in flight is waited for, the session leaves the gateway
            session = await gateway.end(key)
            others = [await gateway.end(other) for other in sorted(seen.foreign)]
            await http.aclose()
        if others:  # its calls went elsewhere: none is this episode's to train on, and it says why
            calls = sum(len(s.turns) for o in others for s in o.samples)
            end, info = EndReason.INFRA_FAILED, {"error": seen.foreign_error(calls)}
        elif session.refused and (end is EndReason.ANSWERED or refusal is not None):
            # a call past the run's budget: the episode was cut, as the loop cuts one (no reward
            # when the harness let the refusal raise); any other failure stays a failure
            reward = reward if refusal is None else 0.0
            info = {"refused": info["error"]} if refusal is not None else info
            end = EndReason.TRUNCATED
        if not session.samples and not others and (end not in NOT_TRAINABLE or refusal is not None):
            refused = info.get("refused", info.get("error"))
            why = f"no call fit the run's budgets: {refused}" if refusal is not None else ""
            end, info = EndReason.INFRA_FAILED, {"error": why or "the harness never called the model"}
        # the turn cap, as the loop records it (a token budget cuts an episode without the cap)
        info |= {"turn_cap": setup.budgets.max_turns, "cut_by_cap": session.refused == "turns"}
        if seen.system_prompt is not None:
            info["system_prompt"] = seen.system_prompt
        return trajectory_of(session, task, group_id, reward, end, info)


__all__ = ["HarnessRunner", "trajectory_of"]
