"""How much of the weights one RL update changes, and what the delta weight sync
(`runtime.weight_delta`, `engines/delta.py`) costs against sending the full weights.

    python benchmarks/delta_sync.py [--updates 50] [--lr 1e-6 1e-5]

Trains the tiny Llama of `benchmarks/learner_scale.py` (4.2M parameters) with PPO-clip and AdamW
on fixed rows, and at the syncs after updates 1, 10 and `--updates` compares the new version
with the one before it, as the engine holds it: in fp32 (the learner's dtype) and cast to bf16
(an engine in `model.engine_dtype: bfloat16`). Prints the share of elements that changed, and
the bytes of two encodings against the full weights: a sparse one (int32 index + value per
changed element) and the XOR of the two versions compressed with zlib (level 1).

Then the delta path itself, at the same syncs: `DeltaEncoder.encode` of the learner's update and
`applied` + `load_in_place` into an engine copy in that dtype (checked bit-identical to the
learner's weights cast to it, every sync), its bytes and seconds, beside the full weights in the
engine's dtype broadcast on a gloo group to another process (`--full-broadcast`, as
`runtime.weight_sync: broadcast` sends them). `link MB/s` is the bandwidth below which the delta
is faster end to end: (full bytes - delta bytes) / (encode + apply seconds).
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from learner_scale import rows, settings  # noqa: E402
from steprl.engines.delta import DeltaEncoder, applied  # noqa: E402
from steprl.engines.weights import WeightUpdate, load_in_place, untied  # noqa: E402
from steprl.models import tiny  # noqa: E402
from steprl.training.learn.learner import LocalLearner  # noqa: E402


def flat(model: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([p.detach().to(dtype).reshape(-1) for p in model.parameters()])


def delta(old: torch.Tensor, new: torch.Tensor) -> tuple[float, int, int, float]:
    """Share changed, sparse bytes, XOR+zlib bytes, seconds to make the XOR+zlib one."""
    changed = int((old != new).sum())
    size = new.element_size()
    t0 = time.perf_counter()
    ints = torch.int16 if size == 2 else torch.int32
    xor = (old.view(ints) ^ new.view(ints)).numpy().tobytes()
    packed = len(zlib.compress(xor, 1))
    return changed / new.numel(), changed * (4 + size), packed, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=50)
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    args = ap.parse_args()
    torch.manual_seed(0)
    tok = tiny.build_tokenizer()
    spec = tiny.TinyModelSpec(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024)
    data = rows(32, 128, len(tok))
    print(
        f"{'lr':>8}{'dtype':>7}{'sync':>6}{'changed':>9}{'sparse/full':>13}{'xor+zlib/full':>15}{'zlib s':>8}"
    )
    for lr in args.lr:
        model = tiny.build_model(len(tok), spec, seed=0, pad_id=0, bos_id=1, eos_id=2).train()
        learner = LocalLearner(model, **(settings() | {"lr": lr}))
        before = {d: flat(model, d) for d in (torch.float32, torch.bfloat16)}
        for k in range(1, args.updates + 1):
            learner.update(data, epochs=1, mini_batches=2, generator=torch.Generator().manual_seed(k))
            now = {d: flat(model, d) for d in before}
            if k in (1, 10, args.updates):
                for d, new in now.items():
                    share, sparse, packed, s = delta(before[d], new)
                    full = new.numel() * new.element_size()
                    name = str(d).removeprefix("torch.")
                    ratios = f"{sparse / full:13.3f}{packed / full:15.3f}"
                    print(f"{lr:8.0e}{name:>9}{k:6d}{share:9.3f}{ratios}{s:8.3f}")
            before = now
    print()
    print(
        f"{'lr':>8}{'dtype':>7}{'sync':>6}{'delta/full':>12}{'encode s':>10}{'apply s':>9}"
        f"{'full bcast s':>14}{'link MB/s':>11}"
    )
    for lr in args.lr:
        for dtype in (torch.bfloat16, torch.float32):
            path(lr, dtype, args.updates, spec, len(tok), data)


def path(lr: float, dtype: torch.dtype, updates: int, spec: object, vocab: int, data: list) -> None:
    """The delta path over `updates` syncs into an engine copy in `dtype`, exact every time."""
    import copy

    model = tiny.build_model(vocab, spec, seed=0, pad_id=0, bos_id=1, eos_id=2).train()
    learner = LocalLearner(model, **(settings() | {"lr": lr}))
    engine = copy.deepcopy(model).to(dtype)
    encoder = DeltaEncoder({k: v.dtype for k, v in engine.state_dict().items()})
    encoder.encode(WeightUpdate.of_tensors(model.state_dict(), 0))  # the first sync: full
    load_in_place(engine, encoder.full())
    encoder.commit()
    full = sum(t.numel() * t.element_size() for t in untied(engine.state_dict()).values())
    bcast = full_broadcast(encoder.full())
    for k in range(1, updates + 1):
        learner.update(data, epochs=1, mini_batches=2, generator=torch.Generator().manual_seed(k))
        t0 = time.perf_counter()
        update = encoder.encode(WeightUpdate.of_tensors(model.state_dict(), k))
        t1 = time.perf_counter()
        load_in_place(engine, applied(update, engine.state_dict()))
        t2 = time.perf_counter()
        encoder.commit()
        mine = engine.state_dict()
        assert all(torch.equal(mine[n], t.to(dtype)) for n, t in untied(model.state_dict()).items()), k
        if k in (1, 10, updates):
            cost = (t1 - t0) + (t2 - t1)
            link = max(0.0, full - update.nbytes) / cost / 1e6
            name = str(dtype).removeprefix("torch.")
            times = f"{t1 - t0:10.3f}{t2 - t1:9.3f}{bcast:14.3f}{link:11.0f}"
            print(f"{lr:8.0e}{name:>9}{k:6d}{update.nbytes / full:12.3f}{times}")


def full_broadcast(update: WeightUpdate) -> float:
    """Median seconds of 3 broadcasts of `update` (full tensors) on a gloo group to a process
    that receives and checks every bucket (`weight_sync.py: group_reader`)."""
    import statistics

    from steprl.engines.transports.collective import send
    from weight_sync import reader_group

    group, parent, proc, _host = reader_group(300)
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        send(group, update)
        assert parent.recv() == "done"
        times.append(time.perf_counter() - t0)
    send(group, WeightUpdate(-1))
    proc.join(10)
    return statistics.median(times[1:])


if __name__ == "__main__":
    main()
