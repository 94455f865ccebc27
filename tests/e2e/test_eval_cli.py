"""`steprl eval` on a run directory and on a corrupt checkpoint (issue 23 items 13, 14).

A run directory (the form docs/runs.md gives) means its newest checkpoint that verifies against
its manifest, not the run's own config.yaml taken for a checkpoint's; a corrupt newest one falls
back to the previous with a warning, as a resume does; a corrupt checkpoint named by its path is
one line, exit 2. The run is laid out with `save_checkpoint` (a small random model: evaluating
it is what is tested, not how good it is); the two commands run in parallel.
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

import cli_zygote
from cli_runs import STEPRL, assert_one_line
from steprl.config import dump_config
from steprl.models import tiny
from steprl.training.learn.checkpoint import save_checkpoint, write_model
from tiny_runs import small_config

pytestmark = pytest.mark.e2e


def _make_run(tmp_path: Path) -> Path:
    cfg = small_config(tmp_path, "done")
    run = Path(cfg.run.output_dir) / cfg.run.name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(dump_config(cfg))  # what eval took for a checkpoint's
    tok = tiny.build_tokenizer()
    spec = LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    for step in (1, 2):
        save_checkpoint(
            run / "checkpoints",
            step,
            write_model=functools.partial(write_model, LlamaForCausalLM(spec)),
            tokenizer=tok,
            state={},
            config_yaml=dump_config(cfg),
            keep_last=2,
        )
    return run


@pytest.fixture(scope="module")
def evals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str]]:
    tmp = tmp_path_factory.mktemp("eval_cli")
    run = _make_run(tmp)
    weights = run / "checkpoints" / "step_000002" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-7] ^= 0xFF  # a flipped byte in the weights: the file's checksum fails
    weights.write_bytes(bytes(data))
    cases = {
        "fallback": [str(run), "--tasks", "2"],
        "named": [str(run / "checkpoints" / "step_000002"), "--tasks", "2"],
        "default": [str(run / "checkpoints" / "step_000001")],  # no --tasks: the run's eval_tasks
    }
    env = {**os.environ, "COLUMNS": "400"}

    def start(argv: list[str]) -> subprocess.Popen[str]:
        return cli_zygote.popen(
            [STEPRL, "eval", *argv],
            cwd=tmp,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    # "fallback" and "default" both evaluate step_000001 into the same run's eval directory:
    # one after the other (together, one's write of step_000001.parquet met the other's)
    first = {name: start(cases[name]) for name in ("fallback", "named")}
    outputs = {name: p.communicate(timeout=300)[0] for name, p in first.items()}
    procs = first | {"default": start(cases["default"])}
    outputs["default"] = procs["default"].communicate(timeout=300)[0]
    return {name: (procs[name].returncode, out.strip()) for name, out in outputs.items()}


def test_a_run_directory_evaluates_its_newest_checkpoint_that_verifies(
    evals: dict[str, tuple[int, str]],
) -> None:
    """The run directory itself (whose config.yaml eval took for a checkpoint's), its newest
    checkpoint corrupt: the previous one is evaluated, with a warning. (A run directory whose
    checkpoints all verify: tests/training/test_checkpoint.py, in process.)"""
    rc, out = evals["fallback"]
    assert rc == 0, out
    warning, chosen = out.splitlines()[:2]
    assert "step_000002 is corrupt: model.safetensors fails its checksum" in warning, out
    assert "falling back to step_000001" in warning and chosen.endswith("checkpoints/step_000001"), out
    assert "eval/tasks: 2.0000" in out, out


def test_a_corrupt_checkpoint_named_by_path_is_refused(evals: dict[str, tuple[int, str]]) -> None:
    rc, out = evals["named"]
    assert_one_line(rc, out, "step_000002 is corrupt: model.safetensors fails its checksum")
    assert len(out.splitlines()) == 1, out


def test_eval_takes_the_runs_eval_tasks_by_default(evals: dict[str, tuple[int, str]]) -> None:
    rc, out = evals["default"]
    assert rc == 0, out
    assert "eval/tasks: 8.0000" in out, out  # trainer.eval_tasks=8 (tiny_runs.SMALL), not 200
