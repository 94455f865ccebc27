"""A chat model served by a steprl engine inside this process: what the simulated user and the
tool writer call when they are given `engine:` (and a model) instead of an OpenAI-compatible
endpoint, so an LLM user or writer needs no server of its own.

`engine: hf` serves the model with steprl's `HFEngine`, `engine: vllm` with its `VLLMEngine` (vLLM
in a process of its own, from the vLLM venv: `vllm_python`); `model` is what `model.name` takes
(a Hugging Face directory, a Hub id, a `.gguf` file, `gemma-3-270m`). The messages are rendered by
the model's chat template (`chat_template` replaces it), the reply is sampled with a seed drawn from
the messages (the same question to the same model gets the same answer; temperature 0 is greedy)
and decoded up to the end of its turn.

The engine's `generate` is a coroutine and an env's `step` is not (the agent loop calls it on its
own event loop), so each served model runs on an event loop of its own, in a daemon thread; one
copy per (engine, model, template, dtype) per process, shared by every episode. The simulated user
loads it when the env is configured (a load failure is one line at start-up); a reply that takes
longer than `timeout_s` is cancelled and the episode ends `infra_failed`.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import threading
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENGINES = ("hf", "vllm")
DEFAULT_VLLM_PYTHON = ".venv-vllm/bin/python"


@dataclass(frozen=True)
class EngineChat:
    """A chat model on a steprl engine in this process."""

    engine: str  # one of ENGINES
    model: str  # as `model.name` takes it
    chat_template: str = ""  # a Jinja file replacing the model's template ("" = the model's own)
    dtype: str = "float32"
    vllm_python: str = DEFAULT_VLLM_PYTHON
    timeout_s: float = 25.0  # under the env call's deadline (runtime.env_call_timeout_s, 30 s)

    def warm(self) -> None:
        """Load the model now (at start-up), not in the first episode's step, under its deadline."""
        _served(self.engine, self.model, self.chat_template, self.dtype, self.vllm_python)

    def complete(self, messages: Sequence[Mapping[str, str]], *, temperature: float, max_tokens: int) -> str:
        served = _served(self.engine, self.model, self.chat_template, self.dtype, self.vllm_python)
        return served.complete(messages, temperature, max_tokens, self.timeout_s)


class PromptTooLong(ValueError):
    """The rendered conversation leaves the model no position to answer in."""


class _Served:
    def __init__(self, engine: Any, tokenizer: Any, positions: int, name: str) -> None:
        self.engine, self.tokenizer, self.positions, self.name = engine, tokenizer, positions, name
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="steprl-engine-chat", daemon=True)
        self.thread.start()
        atexit.register(self.close)

    def close(self) -> None:
        """Stop the loop between two decode steps and wait for it: a daemon thread still inside a
        forward pass when the interpreter tears down aborts the process (a reply cancelled on
        timeout goes on decoding until its batch ends)."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
        closing = getattr(self.engine, "close", None)
        if callable(closing):
            closing()  # the vLLM worker process

    def complete(
        self, messages: Sequence[Mapping[str, str]], temperature: float, max_tokens: int, timeout_s: float
    ) -> str:
        from steprl.engines.base import SamplingParams

        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
        )
        # the prompt is the template's text, tokenized once here: this model's own output is only
        # decoded (nothing it generated is tokenized again, and it never enters a loss)
        ids = self.tokenizer.encode(str(text), add_special_tokens=False)
        room = self.positions - len(ids)
        if room < 1:
            raise PromptTooLong(
                f"the prompt is {len(ids)} tokens and the model takes {self.positions} positions; "
                "serve a model with a longer context"
            )
        sampling = SamplingParams(
            temperature=temperature,
            max_new_tokens=min(max_tokens, room),
            stop_token_ids=tuple(_stop_ids(self.tokenizer)),
        )
        seed = zlib.crc32(repr([dict(m) for m in messages]).encode())
        future = asyncio.run_coroutine_threadsafe(self.engine.generate(ids, sampling, seed=seed), self.loop)
        try:
            out = future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            # the caller stops waiting; the engine finishes that row (its result dropped), and later
            # requests join the running batch meanwhile (continuous batching)
            future.cancel()
            raise TimeoutError(f"{self.name} gave no reply in {timeout_s:g} s (timeout_s)") from None
        return str(self.tokenizer.decode(list(out.token_ids), skip_special_tokens=True)).strip()


def _stop_ids(tokenizer: Any) -> list[int]:
    """EOS and the chat template's end-of-turn token when the tokenizer has one."""
    ids = {tokenizer.eos_token_id}
    for mark in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>"):
        tid = tokenizer.convert_tokens_to_ids(mark)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return sorted(i for i in ids if isinstance(i, int))


_LOCK = threading.Lock()
_SERVED: dict[tuple[str, str, str, str, str], _Served] = {}


def _served(engine: str, model: str, chat_template: str, dtype: str, vllm_python: str) -> _Served:
    """The one copy of this model on this engine in this process, loaded on first use: under a
    lock, so envs asking at once load it once (an lru_cache would load it once per caller)."""
    key = (engine, model, chat_template, dtype, vllm_python)
    with _LOCK:
        if key not in _SERVED:
            _SERVED[key] = _load(*key)
        return _SERVED[key]


def _load(engine: str, model: str, chat_template: str, dtype: str, vllm_python: str) -> _Served:
    from steprl.models.sources import load_pretrained

    # engine: hf runs on the CPU (an env's process holds no GPU of its own); vLLM on its build's device
    loaded = load_pretrained(
        model,
        dtype=dtype,
        device="cpu",
        cache_dir=None,
        chat_template=chat_template or None,
        log=lambda _: None,
    )
    tok = loaded.tokenizer
    positions = int(getattr(loaded.model.config, "max_position_embeddings", 2048) or 2048)
    from steprl.engines.registry import ENGINES, EngineArgs

    python = str(Path(vllm_python).expanduser().absolute())  # the worker runs in a directory of its own
    args = EngineArgs(loaded.model, tok, max_positions=min(positions, 4096), vllm_python=python)
    served: Any = ENGINES[engine].make(args)
    positions = served.max_positions or positions  # an engine that holds fewer (vLLM: 4096 here)
    return _Served(served, tok, positions, f"{model} on engine {engine}")


def _number(raw: Mapping[str, Any], key: str, name: str, error: type[Exception], *, low: float) -> float:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or value < low:
        raise error(f"{name}: a number of at least {low:g}, got {value!r}")
    return float(value)


def engine_chat_from(
    raw: Mapping[str, Any], where: str, error: type[Exception], *, sep: str = ".", timeout_s: float = 25.0
) -> EngineChat:
    """`raw`'s engine, model, chat_template, dtype, vllm_python and timeout_s checked, one line
    per problem (raised as `error`, each key named `where` + `sep` + key: `env.params.user.model`,
    `--writer-model`)."""

    def name(key: str) -> str:
        return f"{where}{sep}{key}"

    engine, model = raw.get("engine"), raw.get("model")
    if engine not in ENGINES:
        raise error(f"{name('engine')}: one of {', '.join(ENGINES)}, got {engine!r}")
    if not isinstance(model, str) or not model:
        raise error(
            f"{name('model')}: required with engine: a Hugging Face directory, a Hub id, a .gguf file "
            "or gemma-3-270m (what model.name takes)"
        )
    args: dict[str, Any] = {"engine": engine, "model": model, "timeout_s": timeout_s}
    for key in ("chat_template", "dtype", "vllm_python"):
        if key in raw:
            if not isinstance(raw[key], str):
                raise error(f"{name(key)}: must be str, got {raw[key]!r}")
            args[key] = raw[key]
    if "timeout_s" in raw:
        args["timeout_s"] = _number(raw, "timeout_s", name("timeout_s"), error, low=1e-3)
    from steprl.models.sources import DTYPES

    if args.get("dtype", "float32") not in DTYPES:
        raise error(f"{name('dtype')}: one of {', '.join(DTYPES)}, got {args['dtype']!r}")
    return EngineChat(**args)


__all__ = ["ENGINES", "EngineChat", "PromptTooLong", "engine_chat_from"]
