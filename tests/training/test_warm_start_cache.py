"""The tiny model's warm-start cache (issue 23 item 12): keyed on what the warm start depends on
(the config, the env's code, its task generator's output, the strategies), kept in one cache per
user, and the log says which key was reused.

Through `steprl sft` on a plugin env written to tmp_path: after its task generator is edited, a
run builds a new warm start instead of reusing the one of the old tasks, while a run of the
unedited module (a copy in another directory, started at the same time) reuses it.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

import cli_zygote
from cli_runs import STEPRL
from steprl.models.sources import cache_root
from tiny_runs import SMALL

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = """
from dataclasses import replace

from steprl.envs.registry import get_spec

CALC = get_spec("calculator")
OFFSET = 0  # the edit: another slice of the calculator's tasks


def tasks(split, seed, **params):
    for task in CALC.tasks(split, seed + OFFSET, **params):
        yield replace(task, env="mycalc")


SPEC = replace(CALC, name="mycalc", tasks=tasks)
"""
FAST = ["model.sft.skill_steps=2", "model.sft.steps=0", "model.sft.num_episodes=8", "model.sft.batch_size=4"]


def _sft(work: Path, cache: Path, *extra: str) -> subprocess.Popen[str]:
    """`steprl sft` on the plugin env in `work` (its module), the warm start cached in `cache`."""
    overrides = [*SMALL, *FAST, "env.name=mycalc:SPEC", *extra]
    return cli_zygote.popen(
        [
            STEPRL,
            "sft",
            str(ROOT / "configs" / "calculator_tiny.yaml"),
            *(a for o in overrides for a in ("--set", o)),
        ],
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "STEPRL_CACHE": str(cache), "PYTHONPATH": str(work), "COLUMNS": "400"},
    )


def _done(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """(the log, the warm start's cache directory it names)."""
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out
    found = re.search(r"policy: (?:cached SFT \(|fresh SFT \(cached to )(\S+?)\)", out)
    assert found is not None, out
    return out, found.group(1)


@pytest.mark.e2e
def test_an_edited_task_generator_gets_a_new_warm_start(tmp_path: Path) -> None:
    work, same, cache = tmp_path / "work", tmp_path / "same", tmp_path / "cache"
    for d in (work, same):
        d.mkdir()
        (d / "mycalc.py").write_text(PLUGIN)
    first, first_dir = _done(_sft(work, cache))
    assert "SFT warm start: none cached for key" in first and "fresh SFT" in first, first

    # then, at once: the module edited, and the same module (as it was) in another directory,
    # its RL task source named (it orders RL's tasks, not the demonstrations': the same key)
    (work / "mycalc.py").write_text(PLUGIN.replace("OFFSET = 0", "OFFSET = 1000"))
    edited, unchanged = _sft(work, cache), _sft(same, cache, "env.source=stream")
    (edited_log, edited_dir), (again, again_dir) = _done(edited), _done(unchanged)
    assert edited_dir != first_dir and "fresh SFT" in edited_log and "reusing" not in edited_log, edited_log
    assert again_dir == first_dir and f"SFT warm start: reusing {first_dir} (key " in again, again
    assert "env code " in again and " tasks " in again, again  # the log says what the key is made of
    assert Path(first_dir).parent == cache and Path(edited_dir).parent == cache
    assert not (work / ".cache").exists()  # nothing under the directory the command ran from


def test_the_cache_is_one_per_user(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("STEPRL_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root(None) == tmp_path / "home" / ".cache" / "steprl"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root(None) == tmp_path / "xdg" / "steprl"
    monkeypatch.setenv("STEPRL_CACHE", str(tmp_path / "mine"))
    assert cache_root(None) == tmp_path / "mine"
    assert cache_root(str(tmp_path / "configured")) == tmp_path / "configured"  # model.cache_dir wins
