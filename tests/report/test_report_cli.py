"""`steprl train` writes <run_dir>/report.html at its end and prints its path; `steprl report RUN
--vs RUN2 -o FILE` writes a comparison; a directory that is not a run is one line, exit 2."""

from __future__ import annotations

from fixture_run import make_run

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
