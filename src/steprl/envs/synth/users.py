"""The simulated user who answers `ask_user`: scripted from the task's hidden intent, or an LLM
behind any OpenAI-compatible endpoint (vLLM, SGLang, a hosted API, a steprl gateway), or an LLM
served by a steprl engine in the env's own process (`engine: hf | vllm`, `engine_chat.py`).

Either way the reply is **checked against the intent**: a reply that does not state every value
the user has in mind (as a whole word) is a user error, marked on its step
(`info["user_error"]`) so ERPO masks the trajectory instead of blaming the policy. User
simulators are a known noise source (tau2-bench PR #392: up to 30% of failed retail
trajectories came from simulator mistakes); here each mistake is caught where it is made.

`tasks.user_error_rate` still injects errors on purpose: the user is given a wrong value to
have in mind (the scripted user says it; an LLM user is told it), and the step is marked.

In `env.params` of the synth family::

    user: {base_url: http://127.0.0.1:8000/v1, model: my-user-model, api_key_env: USER_API_KEY,
           temperature: 0.0, max_tokens: 64, timeout_s: 30}
    user: {engine: hf, model: Qwen/Qwen3-0.6B, temperature: 0.0, max_tokens: 64}   # in-process

A call that fails (endpoint down, timeout) raises: the episode ends `infra_failed`, counted and
never trained on.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from steprl.envs.synth.engine_chat import EngineChat, engine_chat_from
from steprl.envs.synth.spec import SynthSpecError
from steprl.extras import require


class SimUser(Protocol):
    """Answers the agent's question as the user who asked for `request` and has `intent` in mind."""

    def reply(self, request: str, question: str, intent: Mapping[str, Any]) -> str: ...


def api_key(env_var: str, where: str) -> str:
    """The key in `env_var` ("none" when no variable is named: a local endpoint takes any key)."""
    if not env_var:
        return "none"
    key = os.environ.get(env_var)
    if not key:
        raise SynthSpecError(
            f"{where}: the environment variable {env_var} is not set; export it with the API key"
        )
    return key


@functools.lru_cache(maxsize=16)
def _client(base_url: str, key: str, timeout_s: float) -> Any:
    """One client (and its connection pool) per endpoint, shared by every episode's user."""
    openai = require("openai", extra="llm", feature="an LLM-backed simulated user")
    return openai.OpenAI(base_url=base_url, api_key=key, timeout=timeout_s, max_retries=1)


def scripted_reply(intent: Mapping[str, Any]) -> str:
    said = [f"the {name} is {value}" for name, value in intent.items()]
    reply = ("; ".join(said) or "nothing more: do what I asked") + "."
    return reply[0].upper() + reply[1:]


class ScriptedUser:
    """States each value it has in mind, in one fixed sentence (what the expert strategy reads)."""

    def reply(self, request: str, question: str, intent: Mapping[str, Any]) -> str:
        return scripted_reply(intent)


def states_intent(reply: str, intent: Mapping[str, Any]) -> bool:
    """Whether `reply` states every value of `intent` as a whole word (case-insensitive)."""
    return all(
        re.search(rf"(?<![\w-]){re.escape(str(v))}(?![\w-])", reply, flags=re.IGNORECASE)
        for v in intent.values()
    )


_SYSTEM = (
    "You are a customer who sent this request to an assistant: {request!r}. The assistant asks "
    "you about what the request left open. What you have in mind: {intent}. Answer in one short "
    "sentence that states exactly these values; say nothing else."
)


def _messages(request: str, question: str, intent: Mapping[str, Any]) -> list[dict[str, str]]:
    wants = "; ".join(f"the {k} is {v}" for k, v in intent.items()) or "nothing more"
    return [
        {"role": "system", "content": _SYSTEM.format(request=request, intent=wants)},
        {"role": "user", "content": question or "What do you have in mind?"},
    ]


@dataclass(frozen=True)
class EngineUser:
    """An LLM user served by a steprl engine in this process (no endpoint to run)."""

    chat: EngineChat
    temperature: float = 0.0
    max_tokens: int = 64

    def reply(self, request: str, question: str, intent: Mapping[str, Any]) -> str:
        messages = _messages(request, question, intent)
        return self.chat.complete(messages, temperature=self.temperature, max_tokens=self.max_tokens)


@dataclass(frozen=True)
class ChatUser:
    """An LLM user through an OpenAI-compatible `/v1/chat/completions` (the `openai` SDK)."""

    base_url: str
    model: str
    api_key_env: str = ""  # the environment variable holding the key ("" = no key)
    temperature: float = 0.0
    max_tokens: int = 64
    timeout_s: float = 30.0

    def reply(self, request: str, question: str, intent: Mapping[str, Any]) -> str:
        client = _client(
            self.base_url, api_key(self.api_key_env, "env.params.user.api_key_env"), self.timeout_s
        )
        out = client.chat.completions.create(
            model=self.model,
            messages=_messages(request, question, intent),
            temperature=self.temperature,
            max_tokens=self.max_tokens,
        )
        return (out.choices[0].message.content or "").strip()


_USER_KEYS = {
    "base_url": str,
    "model": str,
    "api_key_env": str,
    "temperature": float,
    "max_tokens": int,
    "timeout_s": float,
}


def _engine_user(raw: Mapping[str, Any]) -> EngineUser:
    allowed = (
        "engine",
        "model",
        "chat_template",
        "dtype",
        "vllm_python",
        "timeout_s",
        "temperature",
        "max_tokens",
    )
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise SynthSpecError(
            f"env.params.user.{unknown[0]}: unknown with engine; allowed: {', '.join(allowed)}"
        )
    chat = engine_chat_from(raw, "env.params.user", SynthSpecError)
    temperature, max_tokens = raw.get("temperature", 0.0), raw.get("max_tokens", 64)
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or temperature < 0:
        raise SynthSpecError(f"env.params.user.temperature: a number of at least 0, got {temperature!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise SynthSpecError(f"env.params.user.max_tokens: an int of at least 1, got {max_tokens!r}")
    try:  # at start-up: not in the first episode's step, under its deadline
        chat.warm()
    except Exception as exc:  # a bad path, a Hub id not in the cache, vLLM not starting
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise SynthSpecError(
            f"env.params.user: cannot serve {chat.model!r} on engine {chat.engine}: {line}"
        ) from None
    return EngineUser(chat, float(temperature), max_tokens)


def user_from_params(raw: Any) -> SimUser | None:
    """`env.params.user` checked: None (the scripted user), a `ChatUser` (an endpoint) or an
    `EngineUser` (a steprl engine in process); one line per problem."""
    if raw is None or raw == "scripted":
        return None
    if not isinstance(raw, Mapping):
        raise SynthSpecError(
            f"env.params.user: 'scripted', a mapping with base_url and model (an endpoint), or with engine "
            f"and model (in process), got {raw!r}"
        )
    if "engine" in raw:
        return _engine_user(raw)
    unknown = sorted(set(raw) - set(_USER_KEYS))
    if unknown:
        raise SynthSpecError(f"env.params.user.{unknown[0]}: unknown; allowed: {', '.join(_USER_KEYS)}")
    for key in ("base_url", "model"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise SynthSpecError(f"env.params.user.{key}: required (e.g. base_url: http://127.0.0.1:8000/v1)")
    args: dict[str, Any] = {}
    for key, kind in _USER_KEYS.items():
        if key in raw:
            value = raw[key]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise SynthSpecError(f"env.params.user.{key}: must be {kind.__name__}, got {value!r}")
            args[key] = value
    user = ChatUser(**args)
    api_key(user.api_key_env, "env.params.user.api_key_env")  # an unset key is one line at start-up
    require("openai", extra="llm", feature="an LLM-backed simulated user")
    return user
