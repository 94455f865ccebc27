"""`steprl train` writes <run_dir>/report.html at its end and prints its path; `steprl report RUN
--vs RUN2 -o FILE` writes a comparison; a directory that is not a run is one line, exit 2, and so
is an -o the report cannot be written to (issue 44, item 10); runs that differ only in their task
source (`env.source`, a curriculum) are comparable (item 12)."""

from __future__ import annotations

import pytest
from fixture_run import make_run, page_data, steprl

from cli_runs import ROOT, TINY_SCRATCH, assert_one_line, run_steprl


def test_train_writes_the_report_and_steprl_report_compares_runs(tmp_path):
    sets = [*TINY_SCRATCH, "trainer.total_steps=1", f"run.output_dir={tmp_path}"]
    rc, out = run_steprl(
        ["train", "configs/calculator_tiny.yaml", *[x for s in sets for x in ("--set", s)]], ROOT
    )
    run = tmp_path / "calculator_tiny"
    assert rc == 0, out
    assert f"report: {run / 'report.html'}" in out and (run / "report.html").stat().st_size > 0
    assert out.splitlines()[-1] == f"report: {run / 'report.html'} (open it in a browser)"  # the last word

    other = make_run(tmp_path / "others")
    rc, out = run_steprl(["report", str(run), "--vs", str(other), "-o", str(tmp_path / "vs.html")], ROOT)
    assert rc == 0, out
    assert f"report: {tmp_path / 'vs.html'}" in out
    page = (tmp_path / "vs.html").read_text()
    assert "calculator_tiny vs fixture" in page and "model differs (model.tiny.hidden_size" in page

    rc, out = run_steprl(["report", str(tmp_path / "nothing")], ROOT)
    assert_one_line(rc, out, "is not a run directory")


def test_an_out_path_the_report_cannot_be_written_to_is_one_line(tmp_path, monkeypatch, capsys):
    run = make_run(tmp_path)
    (tmp_path / "a_file").write_text("not a folder")
    (tmp_path / "a_folder").mkdir()
    for out in (tmp_path / "a_file" / "sub" / "report.html", tmp_path / "a_folder"):
        rc, printed = steprl(monkeypatch, capsys, "report", str(run), "-o", str(out))
        assert rc == 2 and "Traceback" not in printed and len(printed.splitlines()) == 1, printed[-3000:]
        assert f"cannot write the report to {out}" in printed and "-o" in printed, printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "a_folder", "fixture"]  # no debris
    assert not any((tmp_path / "a_folder").iterdir())


@pytest.mark.parametrize("source", [{"source": "difficulty"}, {"source_params": {"easy": 0.2}}])
def test_runs_that_differ_only_in_their_task_source_are_comparable(tmp_path, monkeypatch, capsys, source):
    a = make_run(tmp_path, "a", env={"name": "calculator", "params": {}, "source": "stream"})
    b = make_run(tmp_path, "b", env={"name": "calculator", "params": {}, "source": "stream", **source})
    rc, printed = steprl(
        monkeypatch, capsys, "report", str(a), "--vs", str(b), "-o", str(tmp_path / "vs.html")
    )
    assert rc == 0, printed
    config = next(s["data"] for s in page_data(tmp_path / "vs.html")["sections"] if s["name"] == "config")
    assert config["not_comparable"] == [], config
    assert [d["key"].split(".")[1] for d in config["diff"]] == [next(iter(source))]  # shown, not flagged
