"""Issue 46's GPU kit: the learner's ranks with NCCL on the GPUs present, checked against the
one-process learner on the same rows, with the same check as `make test` runs on CPU (gloo).

The lent GPU machine has Python 3.12 with torch, transformers and peft, but no Ray and no
pydantic, and reaches no package registry. So the kit starts the ranks as torchrun would (one
process each, `LOCAL_RANK` set, a TCP rendezvous on loopback), through the same `start_rank`
and `RankLearner` that the Ray actors run: only the process launcher differs. The Ray
placement of `runtime.learner_gpus_per_rank` is not exercised here (it is on CPU).

    here:    .venv/bin/python benchmarks/learner_gpu_kit.py pack        # .devkit46/wheels (ignored)
    device:  carry [".devkit46"]:
             python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \\
                 .devkit46/wheels/*.whl && PYTHONPATH=/tmp/site python3 benchmarks/learner_gpu_kit.py run
    CPU smoke (gloo, 2 ranks): .venv/bin/python benchmarks/learner_gpu_kit.py run --device cpu

`run` trains 3 updates (2 mini-batches each, PPO clip) of a random Llama on fixed rows:
* in one process (the reference), and on the same device;
* on `--ranks` ranks (default: one per GPU; 2 on CPU) in fp32: every update's stats and the
  final weights within 1e-5 relative of one process (asserted), then through a sharded (DCP)
  checkpoint read back in one process (exact);
* the same with the optimizer state offloaded to host memory (`runtime.learner_cpu_offload`):
  within 1e-5 (asserted);
* on CUDA, with the bf16 mixed-precision policy (`runtime.learner_mixed_precision`): the
  difference is reported, not asserted (bf16 rounds at 4e-3).
Then, for speed: the median seconds of one update, trained tokens/s and peak memory of one
process against the ranks. Everything is printed and written to `$OUT/learner_gpu_kit.json`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from learner_scale import rows, settings  # noqa: E402
from steprl.models import tiny  # noqa: E402
from steprl.training.learn.learner import LocalLearner  # noqa: E402

#: what the GPU image lacks (KINDS.md lists its packages), at the versions the tests ran
WHEELS = (
    "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
    "transformers==5.25.0", "huggingface-hub==2.4.0", "tokenizers==0.23.3", "hf-xet==1.8.0",
    "peft==0.21.2", "httpx2==2.17.0", "httpcore2==2.17.0", "truststore==0.10.5", "typing-extensions==4.16.0",
)  # fmt: skip
TOLERANCE = 1e-5


def pack(out: Path) -> None:
    """The wheels for the device's Python 3.12 (x86-64), as `device/README.md` says to fetch them."""
    platforms = (
        "manylinux_2_28_x86_64",
        "manylinux_2_17_x86_64",
        "manylinux2014_x86_64",
        "manylinux1_x86_64",
    )
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", "3.12", "--implementation", "cp", "-d", str(out / "wheels")]
    cmd += [arg for p in platforms for arg in ("--platform", p)]
    subprocess.run([*cmd, *WHEELS], check=True)
    size = sum(f.stat().st_size for f in (out / "wheels").iterdir())
    print(f"{out / 'wheels'}: {size / 2**20:.1f} MiB (the working tree travels too: 64 MiB in all)")


def model_and_rows(args: argparse.Namespace) -> tuple[torch.nn.Module, list[Any]]:
    tok = tiny.build_tokenizer()
    spec = tiny.TinyModelSpec(
        hidden_size=args.hidden, num_layers=args.layers, num_heads=4, intermediate_size=4 * args.hidden
    )
    model = tiny.build_model(
        len(tok), spec, seed=0, pad_id=tok.pad_token_id, bos_id=tok.bos_token_id, eos_id=tok.eos_token_id
    )
    return model.train(), rows(args.rows, args.length, len(tok))


def train(learner: Any, data: list[Any], updates: int, device: str) -> dict[str, Any]:
    """`updates` updates of 2 mini-batches: their stats, the median seconds of one (the first is
    the warm-up), and the peak memory."""
    stats, times = [], []
    for k in range(updates):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        stats.append(
            learner.update(data, epochs=1, mini_batches=2, generator=torch.Generator().manual_seed(k))
        )
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else learner.footprint()
    return {"stats": stats, "update_s": statistics.median(times[1:] or times), "peak_bytes": peak}


def rank_main(
    rank: int, world: int, port: int, variant: dict[str, Any], args: argparse.Namespace, out: str
) -> None:
    """One rank, as torchrun starts it: `LOCAL_RANK`, then the same `start_rank` a Ray actor calls."""
    import torch.distributed as dist

    from steprl.training.learn.rank_learner import ModelParts, start_rank

    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(args.threads_per_rank)
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model, data = model_and_rows(args)
    learner_settings = settings() | {"device": args.device, "pack": False, **variant}
    learner = start_rank(
        ModelParts.of(model),
        learner_settings,
        rank=rank,
        world=world,
        init_method=f"tcp://127.0.0.1:{port}",
        timeout_s=300,
    )
    result = train(learner, data, args.updates, args.device)
    result["weights"] = learner.full_state()  # rank 0's; every rank takes part
    learner.save_sharded(out)  # every rank writes its shards
    t0 = time.perf_counter()
    learner.full_state()
    result["gather_s"] = time.perf_counter() - t0
    sizes: list[Any] = [None] * world
    dist.all_gather_object(sizes, result["peak_bytes"])
    result["peak_bytes"] = max(sizes)
    if rank == 0:
        torch.save(result, Path(out) / "result.pt")
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def on_ranks(world: int, variant: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(rank_main, args=(world, free_port(), variant, args, out), nprocs=world, join=True)
        result = torch.load(Path(out) / "result.pt", weights_only=False)
        result["from_checkpoint"] = read_back(Path(out), args)
    return result


def read_back(checkpoint: Path, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The ranks' sharded checkpoint read in one process with no process group."""
    from steprl.training.learn import sharded_state

    model, _ = model_and_rows(args)
    learner = LocalLearner(model, **settings())
    sharded_state.load(learner.model, learner.optimizer, checkpoint / sharded_state.LEARNER_DIR, stepped=True)
    return {k: v.detach().clone() for k, v in learner.model.state_dict().items()}


def rel(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def compare(one: dict[str, Any], other: dict[str, Any]) -> dict[str, float]:
    stats = max(rel(s2[k], s1[k]) for s1, s2 in zip(one["stats"], other["stats"], strict=True) for k in s1)
    weights = max(rel(other["weights"][k].cpu(), v.cpu()) for k, v in one["weights"].items())
    return {"stats": stats, "weights": weights}


def run(args: argparse.Namespace) -> int:
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU here (--device cpu for the CPU smoke)")
    world = args.ranks or (torch.cuda.device_count() if cuda else 2)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model, data = model_and_rows(args)
    tokens = sum(sum(s.loss_mask) for s in data)
    params = sum(p.numel() for p in model.parameters())
    print(f"device {args.device} x {world} rank(s); model {params:,} parameters; {tokens} tokens an update")
    torch.set_num_threads(args.threads_per_rank * world)
    one_learner = LocalLearner(copy.deepcopy(model), **(settings() | {"device": args.device}))
    one = train(one_learner, data, args.updates, args.device)
    one["weights"] = {k: v.detach().cpu().clone() for k, v in one_learner.model.state_dict().items()}
    del one_learner
    variants: dict[str, dict[str, Any]] = {"fp32": {}, "cpu_offload": {"cpu_offload": True}}
    if cuda:
        variants["bf16_mixed"] = {"mixed_precision": True}
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "ranks": world,
        "parameters": params,
        "tokens_per_update": tokens,
        "one_process": {"update_s": one["update_s"], "peak_mb": one["peak_bytes"] / 2**20},
    }
    failed = []
    for name, variant in variants.items():
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        got = on_ranks(world, variant, args)
        diff = compare(one, got)
        exact = max(rel(got["from_checkpoint"][k], got["weights"][k].cpu()) for k in got["weights"])
        asserted = name != "bf16_mixed"
        ok = (not asserted) or (diff["stats"] <= TOLERANCE and diff["weights"] <= TOLERANCE and exact == 0.0)
        failed += [] if ok else [name]
        report[name] = {
            "stats_rel": diff["stats"],
            "weights_rel": diff["weights"],
            "checkpoint_read_back_rel": exact,
            "asserted": asserted,
            "ok": ok,
            "update_s": got["update_s"],
            "tokens_per_s": tokens / got["update_s"],
            "peak_mb_per_rank": got["peak_bytes"] / 2**20,
            "gather_s": got["gather_s"],
        }
    head = f"{'stats rel':>11}{'weights rel':>13}{'ckpt':>6}{'update s':>10}{'tokens/s':>10}{'peak MB':>9}"
    print(f"{'':14}{head}  ok")
    print(
        f"{'one process':14}{'':>11}{'':>13}{'':>6}{one['update_s']:10.3f}{tokens / one['update_s']:10.0f}"
        f"{one['peak_bytes'] / 2**20:9.1f}"
    )
    for name in variants:
        r = report[name]
        print(
            f"{name:14}{r['stats_rel']:11.2e}{r['weights_rel']:13.2e}{r['checkpoint_read_back_rel']:6.0g}"
            f"{r['update_s']:10.3f}{r['tokens_per_s']:10.0f}{r['peak_mb_per_rank']:9.1f}  "
            f"{'yes' if r['ok'] else 'NO'}{'' if r['asserted'] else ' (reported)'}"
        )
    out = Path(os.environ.get("OUT") or args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "learner_gpu_kit.json").write_text(json.dumps(report, indent=2))
    print(
        "FAILED: " + ", ".join(failed)
        if failed
        else f"all asserted variants within {TOLERANCE:g} of one process"
    )
    return 1 if failed else 0


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--out", type=Path, default=ROOT / ".devkit46")
    r = sub.add_parser("run")
    r.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    r.add_argument("--ranks", type=int, default=0, help="0: one per GPU (2 on CPU)")
    r.add_argument("--rows", type=int, default=16)
    r.add_argument("--length", type=int, default=128)
    r.add_argument("--hidden", type=int, default=256)
    r.add_argument("--layers", type=int, default=4)
    r.add_argument("--updates", type=int, default=3)
    r.add_argument("--threads-per-rank", type=int, default=1)
    r.add_argument("--out", default="/tmp/learner_gpu_kit")
    args = ap.parse_args()
    if args.cmd == "pack":
        pack(args.out)
    else:
        sys.exit(run(args))


if __name__ == "__main__":
    main()
