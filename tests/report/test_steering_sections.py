"""The report's curriculum and env-weight sections read what the curriculum controllers and the
task sources log: the turn cap's stages, and each env's weight and share of the gradient."""

from __future__ import annotations

from dataclasses import replace

from steprl.report.registry import SECTIONS, check_section
from steprl.report.run_data import empty_run


def _run():
    metrics = (
        {"step": 1, "curriculum/max_turns": 2, "success/rate": 0.2, "curriculum/cut_by_cap_frac": 0.5},
        {"step": 2, "curriculum/max_turns": 2, "success/rate": 0.4},
        {
            "step": 3,
            "curriculum/max_turns": 4,
            "success/rate": 0.3,
            "source/weight/a": 0.7,
            "grad_share/a": 0.9,
        },
        {
            "step": 4,
            "curriculum/max_turns": 4,
            "source/weight/a": 0.5,
            "source/weight/b": 0.5,
            "grad_share/b": 0.4,
        },
    )
    config = {
        "env": {"mix": [{"name": "calculator", "id": "a", "weight": 3.0}, {"name": "bandit", "id": "b"}]}
    }
    return replace(empty_run("steer", config), metrics=metrics)


def test_the_curriculum_section_lists_each_stage_once():
    check_section("curriculum", SECTIONS["curriculum"], _run())
    data = SECTIONS["curriculum"].build(_run())
    assert data["rows"] == [[1, 2, 0.2, 0.5], [3, 4, 0.3, ""]]


def test_the_env_weight_section_gives_each_env_its_weights_and_gradient_share():
    check_section("env_weights", SECTIONS["env_weights"], _run())
    rows = {r[0]: r[1:] for r in SECTIONS["env_weights"].build(_run())["rows"]}
    assert rows["a"] == [0.75, 0.7, 0.5, 0.6, 0.9, 0.9, 0.9]
    assert rows["b"] == [0.25, 0.5, 0.5, 0.5, 0.4, 0.4, 0.4]  # no weight in its entry: the default 1


def test_the_admission_section_shows_the_pass_rate_against_the_band():
    metrics = tuple(
        {"step": i, "source/active": 8, "source/admitted": 8 + i, "source/retired": i, "source/parked": 0}
        | {"source/skipped": 0, "source/admitted_anyway": i // 2, "source/probation": 1}
        | {"source/rejected": 2 * i}
        | ({"source/pass_rate": rate} if rate is not None else {})
        | {"source/shape_rate/a>b": 0.1 * i}
        | ({"source/shape_rate/c": 0.9} if i > 2 else {})
        for i, rate in enumerate([None, 0.5, 0.9, 0.3], 1)
    )
    run = replace(empty_run("admit", {"env": {"source_params": {"band": [0.2, 0.8]}}}), metrics=metrics)
    check_section("admission", SECTIONS["admission"], run)
    data = SECTIONS["admission"].build(run)
    assert data["rows"][1] == [2, 8, 10, 2, 0, 0, 1, 1, 4, 0.5, "yes"] and data["rows"][2][-1] == "no"
    assert data["rows"][-1][-1] == "2 of 3 steps"
    assert SECTIONS["admission"].build(empty_run("none", {}))["rows"] == []
    shapes = SECTIONS["admission_shapes"].build(run)  # per shape: first rated, first, last, band
    assert shapes["rows"] == [["c", 3, 0.9, 0.9, "above"], ["a>b", 1, 0.1, 0.4, "in"]]
    assert SECTIONS["admission_shapes"].build(empty_run("none", {}))["rows"] == []
