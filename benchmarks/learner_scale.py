"""The learner's update on one process with 2 threads against 2 FSDP2 ranks with 1 thread each
(`runtime.learner_ranks=2`: Ray actors, gloo), on the same rows, side by side from one run.

    python benchmarks/learner_scale.py [--rows 32] [--length 128] [--repeats 5]

Prints, for each: the median seconds of one update (epochs 1, 2 mini-batches, micro-batches
of 4), trained tokens per second and the ratio, parameter + gradient + Adam bytes per process
(the ranks: their shards), and the median time of one full-weight gather (what each engine push
costs). The model is the tiny Llama of `configs/calculator_tiny.yaml` made wider so that the
arithmetic, not Python, dominates. On 2 cores, 2 ranks cannot be faster than 1 process with 2
threads: the ratio measures the overhead of sharding (all-gathers, reduce-scatters, the
process boundary). Never run it beside tests or helpers: it times.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from steprl.algorithms import POLICY_LOSSES  # noqa: E402
from steprl.models import tiny  # noqa: E402
from steprl.rollout.views import Sample  # noqa: E402
from steprl.training.learn.learner import LocalLearner  # noqa: E402


def rows(n: int, length: int, vocab: int, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        mask = [0] * (length // 4) + [1] * (length - length // 4)
        adv = (torch.randn(length, generator=g) * torch.tensor(mask)).tolist()
        old = [-2.0 * m for m in mask]
        out.append(
            Sample(tuple(ids), tuple(mask), tuple(old), i, advantages=tuple(adv), returns=(0.0,) * length)
        )
    return out


def settings() -> dict:
    spec = POLICY_LOSSES.lookup("ppo_clip")
    return {
        "policy_loss": functools.partial(spec.fn),
        "needs_proximal": spec.needs_proximal,
        "aggregation": "token-mean",
        "loss_scale_factor": None,
        "lr": 1e-4,
        "weight_decay": 0.0,
        "betas": (0.9, 0.999),
        "grad_clip": 1.0,
        "micro_batch_size": 4,
        "pad_id": 0,
        "temperature": 1.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--model", default="tiny", help="tiny, or gemma-3-270m (full fine-tune, fp32)")
    args = ap.parse_args()
    if args.model == "tiny":
        tok = tiny.build_tokenizer()
        spec = tiny.TinyModelSpec(
            hidden_size=args.hidden, num_layers=args.layers, num_heads=4, intermediate_size=4 * args.hidden
        )
        model = tiny.build_model(
            len(tok), spec, seed=0, pad_id=tok.pad_token_id, bos_id=tok.bos_token_id, eos_id=tok.eos_token_id
        ).train()
        vocab = len(tok)
    else:
        from steprl.models.sources import load_pretrained

        loaded = load_pretrained(
            args.model, dtype="float32", device="cpu", cache_dir=None, chat_template=None, log=print
        )
        model, vocab = loaded.model.train(), min(len(loaded.tokenizer), 32000)  # ids any token may take
    data = rows(args.rows, args.length, vocab)
    tokens = sum(sum(s.loss_mask) for s in data)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {n_params:,} parameters; {args.rows} rows x {args.length} tokens, "
        f"{tokens} trained per update"
    )

    def measure(learner) -> tuple[float, float]:
        """Median seconds of one update and of one full-weight gather (the first of each: warm-up)."""
        times, gathers = [], []
        for k in range(args.repeats + 1):
            t0 = time.perf_counter()
            learner.update(data, epochs=1, mini_batches=2, generator=torch.Generator().manual_seed(k))
            times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            learner.weights(k).full()
            gathers.append(time.perf_counter() - t0)
        return statistics.median(times[1:]), statistics.median(gathers[1:])

    torch.set_num_threads(2)
    one = LocalLearner(copy.deepcopy(model), **settings())
    (one_s, one_g), one_mem = measure(one), one.footprint()

    from steprl.hosting.ray_backend import ensure_ray
    from steprl.training.learn.learner_group import LearnerGroup

    ensure_ray(num_cpus=2)
    group = LearnerGroup(copy.deepcopy(model), settings(), ranks=2, timeout_s=600)
    try:
        two_s, two_g = measure(group)
        two_mem = max(group._wait([a.call.remote("footprint") for a in group.actors], "measuring memory"))
    finally:
        group.close()

    print(f"{'':24}{'update s':>10}{'tokens/s':>11}{'P+G+Adam MB':>13}{'gather s':>10}")
    print(
        f"{'1 process x 2 threads':24}{one_s:10.3f}{tokens / one_s:11.0f}{one_mem / 2**20:13.1f}{one_g:10.3f}"
    )
    print(f"{'2 ranks x 1 thread':24}{two_s:10.3f}{tokens / two_s:11.0f}{two_mem / 2**20:13.1f}{two_g:10.3f}")
    print(
        f"ratio (2 ranks / 1 process): tokens/s {one_s / two_s:.2f}, "
        f"memory per process {two_mem / one_mem:.2f}"
    )


if __name__ == "__main__":
    main()
