"""A run with no held-out tasks (issue 44 item 11): an env whose eval split is empty is refused
at start in one line naming the env, not trained and reported as "held-out success 0.000
(0 tasks)" with exit 0."""

from __future__ import annotations

from cli_runs import ROOT, TINY_SCRATCH, assert_one_line, run_steprl


def test_an_env_with_an_empty_eval_split_is_refused_at_start_in_one_line(tmp_path):
    settings = [*TINY_SCRATCH, "env.name=no_eval", f"run.output_dir={tmp_path}", "trainer.total_steps=1"]
    args = ["train", "configs/calculator_tiny.yaml", "--plugin", "faulty_envs"]
    rc, out = run_steprl(
        [*args, *[x for s in settings for x in ("--set", s)]], ROOT, pythonpath=[ROOT / "tests"]
    )
    assert_one_line(rc, out, "env 'no_eval'", "no held-out tasks", "split='eval'")
    assert "held-out success" not in out, out
    assert not (tmp_path / "calculator_tiny").exists()  # refused before the run directory is made
