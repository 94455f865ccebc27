"""Seconds, bytes and the sender's extra memory of one weight sync, for every transport that runs
here, side by side with the paths they replace, from one run (issue 47 item 5).

    python benchmarks/weight_sync.py [--model gemma-3-270m | tiny] [--repeats 3]

For the full weights (fp32) of the model and for a LoRA adapter on it (the shipped Gemma
config's: r 16 on q, k, v and o):

* `clone + ray.put` (before): a full copy of the state dict, put in Ray's object store whole,
  read back and loaded (what Ray rollout workers got per version before the buckets);
* `ray` (`WEIGHT_SYNC["ray"]`): 256 MiB buckets put one by one, each sealed with its checksums,
  read back, checked and loaded bucket by bucket; a tied head (Gemma's: its 640 MB embedding)
  sent once, as every path but vLLM's now sends it;
* `files` (`WEIGHT_SYNC["files"]`, before for vLLM): a safetensors file per bucket, read back,
  checked and loaded;
* `socket` (`WEIGHT_SYNC["socket"]`, now for vLLM): the buckets streamed over a pipe to a child
  process that decodes and checks every tensor (what the vLLM worker does before its reload);
* `gloo broadcast` (`WEIGHT_SYNC["broadcast"]`, `runtime.weight_sync: broadcast`): each tensor
  broadcast from its own memory on a gloo group to a process that receives and checks every
  bucket (the one-process learner's path; learner ranks gather one bucket at a time into
  rank 0 first);
* `inprocess`: views copied in place (the engine beside the learner);
* the adapter: its bytes, through Ray and as the PEFT directory vLLM loads.

Each row: the median seconds of one sync (load included; `--repeats` after a warm-up), the
bytes moved, and the sender's peak extra resident memory while it sends (sampled every 5 ms:
a full clone shows up as the model's size; a bucketed path should stay near one bucket). The
receiver's own copy of the model is there in every path and not counted. Never run it beside
tests or helpers: it times.
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from steprl.engines.transports import WEIGHT_SYNC  # noqa: E402
from steprl.engines.transports.socket_stream import chain  # noqa: E402
from steprl.engines.vllm_engine import write_adapter  # noqa: E402
from steprl.engines.weights import WeightUpdate, load_in_place  # noqa: E402
from steprl.training.learn.lora import adapter_update, apply_lora  # noqa: E402


class PeakRSS:
    """The process's peak resident memory above where it stood at the start."""

    def __enter__(self) -> PeakRSS:
        self.proc, self.stop = psutil.Process(), threading.Event()
        self.base = self.peak = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.wait(0.005):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()
        self.extra = max(0, self.peak - self.base)


def reader(conn: Any) -> None:
    """The receiving end of the socket path: the vLLM worker's own reader (`tensors_of`: each
    tensor read from the socket into its memory, its checksum checked)."""
    from steprl.engines.vllm_worker import tensors_of

    while True:
        header = conn.recv()
        if header is None:
            return
        if header["op"] == "end":
            conn.send("done")
            continue
        for _ in tensors_of(conn, header):
            pass


def group_reader(address: Any, conn: Any) -> None:
    """The receiving end of the broadcast path: rank 1 of a gloo group; every bucket of each
    update received and checked (order, CRC-32 per tensor), as a Ray rollout worker does before
    it loads them."""
    from steprl.engines.transports.collective import join, receive

    torch.set_num_threads(1)
    group = join(address, 1)
    while True:
        update = receive(group)
        if update.version < 0:
            return
        for _ in update.buckets():
            pass
        conn.send("done")


def reader_group(timeout_s: float = 600) -> tuple[Any, Any, Any, Any]:
    """This process as rank 0 of a gloo weights group whose rank 1 is a `group_reader` process:
    (this end, the pipe it says "done" on, the process, the store's host: keep it while the
    group is used)."""
    from steprl.engines.transports.collective import GroupHost, join

    host = GroupHost(timeout_s=timeout_s)
    address = host.address(2, timeout_s)
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=group_reader, args=(address, child), daemon=True)
    proc.start()
    return join(address, 0), parent, proc, host


def measure(run: Callable[[], int], repeats: int) -> tuple[float, int, int]:
    """Median seconds, bytes moved, peak extra sender memory (the largest over the repeats)."""
    times, extra, moved = [], 0, 0
    for k in range(repeats + 1):
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            moved = run()
            dt = time.perf_counter() - t0
        if k:  # the first is the warm-up
            times.append(dt)
            extra = max(extra, mem.extra)
    return statistics.median(times), moved, extra


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma-3-270m", help="gemma-3-270m, or tiny")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="", help="the rows whose name contains this")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.model == "tiny":
        from steprl.models import tiny

        tok = tiny.build_tokenizer()
        spec = tiny.TinyModelSpec(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024)
        model = tiny.build_model(len(tok), spec, seed=0, pad_id=0, bos_id=1, eos_id=2)
    else:
        from steprl.models.sources import load_pretrained

        model = load_pretrained(
            args.model, dtype="float32", device="cpu", cache_dir=None, chat_template=None, log=print
        ).model
    learner = model.state_dict()
    engine = copy.deepcopy(model)
    full = sum(t.numel() * t.element_size() for t in learner.values())
    print(f"{args.model}: {full / 2**20:.0f} MiB of fp32 weights; pid {os.getpid()}")

    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    scratch = Path(tempfile.mkdtemp(prefix="weight-sync-"))

    def clone_put() -> int:  # before: a full clone, put whole
        ref = ray.put({k: v.detach().clone() for k, v in learner.items()})
        engine.load_state_dict(ray.get(ref))
        del ref
        return full

    def transport(name: str, tied: bool = True) -> Callable[[], int]:
        t = WEIGHT_SYNC[name](scratch)

        def run() -> int:
            update = WeightUpdate.of_tensors(learner, 1, tied=tied)
            handle = t.send(update)
            load_in_place(engine, t.receive(handle))
            t.release(handle)
            return update.nbytes

        return run

    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=reader, args=(child,), daemon=True)
    proc.start()

    def socket() -> int:  # streamed as produced, decoded and checked in another process
        update = WeightUpdate.of_tensors(learner, 1, tied=False)  # every name, as vLLM gets them
        for msg in chain(update):
            parent.send(msg) if isinstance(msg, dict) else parent.send_bytes(msg)
        parent.send({"op": "end"})
        assert parent.recv() == "done"
        return update.nbytes

    from steprl.engines.transports.collective import send as broadcast

    group, b_parent, b_proc, _host = reader_group()

    def gloo_broadcast() -> int:  # each tensor from its own memory to another process's group end
        update = WeightUpdate.of_tensors(learner, 1)
        broadcast(group, update)
        assert b_parent.recv() == "done"
        return update.nbytes

    peft = apply_lora(
        copy.deepcopy(model),
        SimpleNamespace(r=16, alpha=32, dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    )
    adapter = adapter_update(peft)

    def adapter_ray() -> int:
        ray.get(ray.put(adapter.to("cpu")))
        return adapter.nbytes()

    def adapter_files() -> int:
        path = write_adapter(adapter, scratch / "adapter")
        return (path / "adapter_model.safetensors").stat().st_size

    rows = [
        ("full: clone + ray.put (before)", clone_put),
        ("full: ray, buckets", transport("ray")),
        ("full: files (before, vLLM)", transport("files", tied=False)),
        ("full: socket (vLLM now)", socket),
        ("full: gloo broadcast (Ray workers)", gloo_broadcast),
        ("full: inprocess", transport("inprocess")),
        ("adapter: ray", adapter_ray),
        ("adapter: PEFT files (vLLM)", adapter_files),
    ]
    print(f"{'':36}{'s / sync':>10}{'MiB moved':>11}{'sender extra MiB':>18}")
    for name, run in rows:
        if args.only not in name:
            continue
        s, moved, extra = measure(run, args.repeats)
        print(f"{name:36}{s:10.3f}{moved / 2**20:11.2f}{extra / 2**20:18.1f}")
    print(f"adapter / full bytes: {adapter.nbytes() / full:.4f}")
    parent.send(None)
    proc.join(10)
    broadcast(group, WeightUpdate(-1))
    b_proc.join(10)
    ray.shutdown()


if __name__ == "__main__":
    main()
