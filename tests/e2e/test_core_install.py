"""The core install trains in-process; a feature whose extra is missing is one line.

Each run is a `steprl` command in a fresh interpreter where every extra's packages are hidden
(`sys.modules[name] = None` makes their import fail as if they were not installed), so a core
module that starts importing one of them fails here, not on a user's laptop.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from steprl.extras import EXTRAS
from tiny_runs import SMALL

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = sorted({m for modules in EXTRAS.values() for m in modules} | {"starlette", "anyio", "sniffio"})
RUN = f"""
import sys
for name in {HIDDEN!r}:
    sys.modules[name] = None
from steprl.cli import main
sys.argv = ["steprl", *sys.argv[1:]]
main()
"""


def _steprl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", RUN, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _train_args(tmp_path: Path, *extra: str) -> list[str]:
    overrides = [
        *SMALL,
        "trainer.total_steps=1",
        f"run.output_dir={tmp_path}",
        f"model.cache_dir={tmp_path}/c",
    ]
    return ["train", "configs/calculator_tiny.yaml", *(a for o in [*overrides, *extra] for a in ("--set", o))]


@pytest.mark.e2e
def test_in_process_training_needs_no_extra(tmp_path):
    done = _steprl(*_train_args(tmp_path))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "held-out success" in done.stdout


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("runtime.backend=ray", "runtime.backend=ray needs the ray extra: pip install 'steprl[ray]'"),
        ("runtime.backend=http", "runtime.backend=http needs the serve extra: pip install 'steprl[serve]'"),
        (
            "runtime.learner_ranks=2",
            "runtime.learner_ranks > 1 needs the ray extra: pip install 'steprl[ray]'",
        ),
    ],
)
def test_a_feature_without_its_extra_is_one_line_before_any_work(tmp_path, override, message):
    done = _steprl(*_train_args(tmp_path, override))
    assert done.returncode == 2
    assert (done.stdout + done.stderr).strip().splitlines() == [message]
    assert not (tmp_path / "c").exists()  # refused before the warm start (its cache) or any work


def test_serve_env_without_its_extra_is_one_line(tmp_path):
    done = _steprl("serve-env")
    assert done.returncode == 2
    assert (done.stdout + done.stderr).strip().splitlines() == [
        "steprl serve-env needs the serve extra: pip install 'steprl[serve]'"
    ]
