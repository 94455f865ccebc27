"""The report's data (not its pixels): every section's JSON for a small fixed run, checked against
tests/report/golden/*.json (refresh with STEPRL_UPDATE_GOLDEN=1 after a deliberate change and
read the diff), and the section checker over every entry of SECTIONS."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fixture_run import make_run

from steprl.report import SECTIONS, SectionSpec, check_section, empty_run, load_run, render, report_data

GOLDEN = Path(__file__).parent / "golden"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return make_run(root), make_run(root, "other", env={"name": "sokoban", "params": {}})


def test_report_data_matches_the_golden_files(runs):
    data = report_data(load_run(runs[0]))
    produced = {s["name"]: s.get("data", s.get("error")) for s in data["sections"]} | {
        "tokens": data["tokens"]
    }
    if os.environ.get("STEPRL_UPDATE_GOLDEN"):
        for name, value in produced.items():
            (GOLDEN / f"{name}.json").write_text(json.dumps(value, indent=1, sort_keys=True) + "\n")
    expected = {p.stem: json.loads(p.read_text()) for p in GOLDEN.glob("*.json")}
    assert set(expected) == set(produced), (
        "a section was added or removed: refresh with STEPRL_UPDATE_GOLDEN=1"
    )
    for name, value in produced.items():
        assert json.loads(json.dumps(value)) == expected[name], (
            f"section {name!r} differs from golden/{name}.json"
        )
    diff = produced["learning_diff"]
    # one episode each: failed, then solved; a gain one sample cannot tell from luck (p = 0.5)
    assert diff["pairs"][0]["task"] == "eval-0" and diff["pairs"][0]["verdict"] == "weak_gain"
    assert diff["pairs"][0]["first_diff_turn"] == 0


@pytest.mark.parametrize("name", list(SECTIONS))
def test_every_section_builds_from_an_empty_and_a_small_run(name, runs):
    check_section(name, SECTIONS[name])
    check_section(name, SECTIONS[name], empty_run(config={"model": {"name": "tiny"}}))
    check_section(name, SECTIONS[name], load_run(runs[0], vs=[load_run(runs[1])]))


def test_the_checker_refuses_data_that_is_not_json_and_unknown_renderers():
    with pytest.raises(TypeError, match="'nan' returned data that is not JSON"):
        check_section("nan", SectionSpec("NaN", lambda run: {"x": float("nan")}, "table"))
    with pytest.raises(ValueError, match="renderer 'plot3d' is not one of"):
        check_section("p", SectionSpec("P", lambda run: {}, "plot3d"))
    check_section("own", SectionSpec("Own", lambda run: {}, "own", script='RENDERERS["own"] = (el) => {};'))


def test_vs_diffs_the_configs_and_flags_runs_on_another_env(runs):
    data = SECTIONS["config"].build(load_run(runs[0], vs=[load_run(runs[1])]))
    assert {"key": "env.name", "values": ["calculator", "sokoban"]} in data["diff"]
    assert data["not_comparable"] == ["env differs (env.name)"]
    assert not any(d["key"].startswith("run.") for d in data["diff"])  # names and paths always differ


def test_run_text_cannot_end_the_data_script_early():
    data = report_data(empty_run("</script><script>alert(1)</script>"))
    page = render(data)
    assert page.count("</script>") == 2  # the data's and the code's own, none from the run
    assert "\\u003c/script>\\u003cscript>alert(1)" in page
