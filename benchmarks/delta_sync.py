"""How much of the weights one RL update changes: the measurement that decides whether a delta
weight sync (issue 47 item 4: send only what changed since the engine's version) is worth
building. Not the delta path itself (not built).

    python benchmarks/delta_sync.py [--updates 50] [--lr 1e-6 1e-5]

Trains the tiny Llama of `benchmarks/learner_scale.py` (4.2M parameters) with PPO-clip and AdamW
on fixed rows, and at the syncs after updates 1, 10 and `--updates` compares the new version
with the one before it, as the engine holds it: in fp32 (the learner's dtype) and cast to bf16
(an engine in `model.engine_dtype: bfloat16`). Prints the share of elements that changed, and
the bytes of two encodings against the full weights: a sparse one (int32 index + value per
changed element) and the XOR of the two versions compressed with zlib (level 1).
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


if __name__ == "__main__":
    main()
