"""A Hugging Face Hub id as `model.name` (issue 23 item 17): `org/name` resolves through the
Hub's own cache, as every peer does; offline and not cached is one line naming HF_HUB_OFFLINE.

A small real Llama (the embedded tokenizer) is laid out as the Hub cache lays out a download
(`models--org--name/snapshots/<commit>/...` and `refs/main`); the commands run with
`HF_HUB_CACHE` pointing there and `HF_HUB_OFFLINE=1`, so nothing touches the network. They run
in subprocesses, as a user's would: the Hub reads its environment variables at import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_runs import STEPRL, assert_one_line
from tiny_runs import save_small_llama

COMMIT = "0123456789abcdef0123456789abcdef01234567"
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "calculator_tiny.yaml"
#: `steprl train` from the Hub id, one small step (the command the issue saw refuse it)
TRAIN = {
    "model.name": "steprl-test/tiny-llama",
    "model.init": "pretrained",
    "trainer.total_steps": 1,
    "trainer.eval_tasks": 2,
    "rollout.tasks_per_step": 2,
    "rollout.group_size": 2,
    "rollout.max_turns": 2,
    "rollout.max_tokens_per_turn": 8,
    "logging.progress": "false",
    "logging.tensorboard": "false",
    "run.output_dir": "runs",
}
LOAD = """
import json, sys
from steprl.models.sources import load_pretrained
from steprl.training.commands.template_cli import load_tokenizer
loaded = load_pretrained(sys.argv[1], dtype="float32", device="cpu", cache_dir="unused", chat_template=None,
                         log=lambda line: None)
params = sum(p.numel() for p in loaded.model.parameters())
checked = load_tokenizer(sys.argv[1], None, log=lambda line: None)  # what check-template loads
print(json.dumps({"model": type(loaded.model).__name__, "source": loaded.source, "base": loaded.base_name,
                  "params": params, "eos": loaded.tokenizer.eos_token, "vocab": len(checked)}))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tokenizer) -> tuple[Path, dict[str, tuple[int, str]]]:
    tmp = tmp_path_factory.mktemp("hub")
    repo = tmp / "hub" / "models--steprl-test--tiny-llama"
    snapshot = repo / "snapshots" / COMMIT
    save_small_llama(snapshot, tokenizer)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    env = {
        **os.environ,
        "HF_HOME": str(tmp / "hf-home"),  # no token, no other cache
        "HF_HUB_CACHE": str(tmp / "hub"),
        "HF_HUB_OFFLINE": "1",
        "COLUMNS": "400",
    }
    train = [f"{k}={v}" for k, v in TRAIN.items()]
    cases = {
        "load": [sys.executable, "-c", LOAD, "steprl-test/tiny-llama"],
        "absent": [STEPRL, "check-template", "steprl-test/not-cached"],
        "train": [STEPRL, "train", str(CONFIG), *(a for s in train for a in ("--set", s))],
    }
    procs = {
        name: subprocess.Popen(
            argv, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, argv in cases.items()
    }
    outputs = {name: p.communicate(timeout=300) for name, p in procs.items()}
    results = {name: (procs[name].returncode, (out + err).strip()) for name, (out, err) in outputs.items()}
    results["load_stdout"] = (0, outputs["load"][0].strip())
    return snapshot, results


def test_a_hub_id_loads_from_the_hub_cache(runs, tokenizer) -> None:
    snapshot, results = runs
    rc, out = results["load"]
    assert rc == 0, out
    loaded = json.loads(results["load_stdout"][1].splitlines()[-1])
    assert loaded["model"] == "LlamaForCausalLM" and loaded["params"] > 0 and loaded["eos"], loaded
    assert loaded["vocab"] == len(tokenizer)  # check-template's tokenizer, by the same id
    assert loaded["base"] == str(snapshot)  # a LoRA checkpoint names its base by this directory
    assert loaded["source"].startswith("steprl-test/tiny-llama (Hugging Face Hub cache"), loaded


def test_steprl_train_takes_a_hub_id(runs) -> None:
    snapshot, results = runs
    rc, out = results["train"]
    assert rc == 0 and "Traceback" not in out, out[-3000:]
    assert "policy: steprl-test/tiny-llama (Hugging Face Hub cache" in out, out[-3000:]
    run_dir = snapshot.parents[3] / "runs" / "calculator_tiny"
    assert (run_dir / "checkpoints" / "step_000001").is_dir(), out[-3000:]


def test_an_uncached_hub_id_offline_is_one_line(runs) -> None:
    rc, out = runs[1]["absent"]
    assert_one_line(
        rc, out, "model.name='steprl-test/not-cached'", "not in the Hub cache", "HF_HUB_OFFLINE=1"
    )
    assert len(out.splitlines()) == 1, out
