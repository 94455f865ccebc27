"""The "Alarms and interventions" section and `steprl show` read the trainer's health.jsonl (one
line per firing of a health rule): a damaged line is skipped and noted, a run without firings
says whether health was on, an observed-only firing stays marked as not acted."""

from __future__ import annotations

import json
from dataclasses import replace

from fixture_run import FIRINGS, make_run
from rich.console import Console

from steprl.diagnostics.show import health_line, show_run
from steprl.report import health
from steprl.report.registry import SECTIONS, check_section
from steprl.report.run_data import empty_run, load_run


def test_a_damaged_health_line_is_skipped_and_noted(tmp_path):
    run = make_run(tmp_path)
    good = [json.dumps(f) for f in FIRINGS]
    lines = [good[0], '{"step": 1, "rule": "grad_bl', '{"step": 2, "signals": {}}', good[1], '{"step": 3']
    (run / "health.jsonl").write_text("\n".join(lines))  # the last one cut mid-write: dropped unsaid
    loaded = load_run(run, episodes=False)
    assert [f["rule"] for f in loaded.health] == ["entropy_collapse", "grad_blowup"]
    noted = [n for n in loaded.notes if "health.jsonl" in n]
    assert len(noted) == 2 and ":2 is not a JSON object" in noted[0] and "no rule name" in noted[1]
    check_section("alarms", SECTIONS["alarms"], loaded)
    assert health_line(run / "health.jsonl") == "health: 2 firings (entropy_collapse at 1, grad_blowup at 2)"


def test_without_firings_the_section_says_whether_health_was_on():
    off = empty_run()
    on = replace(empty_run(), metrics=({"step": 1, "health/grad_norm_z": 0.3, "health/firings": 0},))
    assert health.build(off)["empty"] == "no health rule fired; health was off for this run"
    assert health.build(on)["empty"] == "no health rule fired; health rules were on"
    assert health.build(on)["last_step"] == 1 and health.build(on)["firings"] == []


def test_observed_firings_and_odd_values_stay_json(monkeypatch):
    rows = tuple(
        {"step": s, "rule": "grad_blowup", "signals": {"grad_norm_z": float("nan"), "kl": 0.123456},
         "actions": ["alert", {"lr_scale": {"factor": 0.5}}], "outcome": "observed", "acted": False}
        for s in (3, 3, 9)
    )  # fmt: skip
    run = replace(empty_run(), health=rows)
    check_section("alarms", SECTIONS["alarms"], run)  # NaN would not be JSON
    monkeypatch.setattr(health, "MAX_FIRINGS", 2)
    data = health.build(run)
    first = data["firings"][0]
    assert first["signals"] == {"grad_norm_z": "nan", "kl": 0.1235} and first["acted"] is False
    assert first["actions"] == ["alert", '{"lr_scale":{"factor":0.5}}']
    assert data["last_step"] == 9 and data["left_out"] == 1 and data["counts"] == {"grad_blowup": 3}


def test_steprl_show_lists_the_firings_below_the_summary(tmp_path):
    run = make_run(tmp_path)
    console = Console(record=True, width=200)
    show_run(run, console=console)
    out = console.export_text()
    assert "health: 2 firings (entropy_collapse at 1, grad_blowup at 2)" in out.splitlines()[-1]
    observed = [{**f, "acted": False} for f in FIRINGS * 5]  # health.act: false, ten firings
    (run / "health.jsonl").write_text("".join(json.dumps(f) + "\n" for f in observed))
    line = health_line(run / "health.jsonl")
    assert line is not None and line.startswith("health: 10 firings (entropy_collapse at 1, grad_blowup at 2")
    assert line.endswith(", ... 2 more); observed only (health.act: false)")
    (run / "health.jsonl").unlink()
    console = Console(record=True, width=200)
    show_run(run, console=console)
    assert "health:" not in console.export_text()
