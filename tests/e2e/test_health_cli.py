"""Health rules through the real CLI: a rule that stops the run says so in one line naming the
rule, its signal and the last good checkpoint; a rollback publishes the restored weights; every
firing is a health.jsonl record and an ALERT line."""

from __future__ import annotations

import json

from cli_runs import ROOT, TINY_SCRATCH, run_steprl

RULES = (
    "[{name: kl_watch, when: [{signal: approx_kl, above: -1}], steps: 3, actions: [alert, stop]},"
    " {name: undo, when: [{signal: approx_kl, above: -1}], cooldown: 0,"
    " actions: [rollback, {lr_scale: {factor: 0.5}}]}]"
)


def test_a_health_rule_rolls_back_then_stops_the_run_in_one_line(tmp_path):
    sets = [*TINY_SCRATCH, "trainer.total_steps=5", "trainer.checkpoint_every=1", f"health.rules={RULES}"]
    args = ["train", "configs/calculator_tiny.yaml", "--set", f"run.output_dir={tmp_path}"]
    rc, out = run_steprl([*args, *(x for s in sets for x in ("--set", s))], cwd=ROOT)
    assert rc == 1, out
    last = out.splitlines()[-1]
    assert "health rule 'kl_watch' stopped the run at step 3 (approx_kl=" in last, out
    assert "the last good checkpoint is" in last and "step_000002" in last, out
    assert "Traceback" not in out
    run_dir = tmp_path / "calculator_tiny"
    fired = [json.loads(line) for line in (run_dir / "health.jsonl").read_text().splitlines()]
    assert [(f["step"], f["rule"]) for f in fired] == [(1, "undo"), (2, "undo"), (3, "kl_watch"), (3, "undo")]
    assert (
        "restored the weights of step 0" in fired[0]["outcome"] and "lr scale 1 -> 0.5" in fired[0]["outcome"]
    )
    assert sum("ALERT step" in line and "health rule" in line for line in out.splitlines()) == 4
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # each step publishes its update, and each rollback its restored weights: version + 2
    assert [r["policy/version"] for r in rows if r["step"]] == [1.0, 3.0, 5.0]
    assert [r["health/lr_scale"] for r in rows if r["step"]] == [0.5, 0.25, 0.125]
