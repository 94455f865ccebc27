"""The learning diff ranks held-out tasks by their evidence (issue 44, item 12): a task solved
once at the last evaluation after failing at the first, one sample each, on a run whose held-out
success fell, is no lesson learned; the page shows each task's successes at every evaluation and
how likely so large a change is by chance, and leads with what the evidence supports."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import yaml
from fixture_run import CONFIG, GUESSED, SOLVED, episode, page_data, steprl

from steprl.diagnostics import JsonlSink, TrajectoryWriter
from steprl.report.learning_diff import first_difference, first_difference_at

#: per evaluation step: the tasks solved (one sample each), on a run that collapses
SOLVED_AT = {0: set(range(19)), 2: set(range(10)), 4: {0, 1, 19}}  # 19: failed, failed, solved
#: a task evaluated 4 times per evaluation: never solved at first, always at the end
MULTI = {0: 0, 2: 2, 4: 4}


def _collapsing_run(root: Path) -> Path:
    run = root / "collapsing"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({**CONFIG, "run": {"name": "collapsing"}}))
    writer = TrajectoryWriter(run / "eval_trajectories")
    with JsonlSink(run / "metrics.jsonl") as sink:
        for step, solved in SOLVED_AT.items():
            eps = [
                episode(f"eval-{t}", f"g{t}", SOLVED if t in solved else GUESSED, float(t in solved), step)
                for t in range(20)
            ]
            eps += [
                episode(
                    "eval-multi", "gm", SOLVED if k < MULTI[step] else GUESSED, float(k < MULTI[step]), step
                )
                for k in range(4)
            ]
            writer.write(step, eps)
            sink.log(step, {"eval/success": sum(e.outcome_reward for e in eps) / len(eps)})
    return run


def test_the_learning_diff_leads_with_evidence_not_one_sample_flips(tmp_path, monkeypatch, capsys):
    run = _collapsing_run(tmp_path)
    rc, printed = steprl(monkeypatch, capsys, "report", str(run))
    assert rc == 0, printed
    diff = next(s["data"] for s in page_data(run / "report.html")["sections"] if s["name"] == "learning_diff")
    lead = diff["pairs"][0]
    assert (lead["task"], lead["verdict"]) == ("eval-multi", "learned"), [p["task"] for p in diff["pairs"]]
    assert lead["evidence"]["first"] == [0, 4] and lead["evidence"]["last"] == [4, 4]
    assert lead["evidence"]["p"] < 0.05  # Fisher's exact test, one-sided: 1/70
    # the one-sample flips: each with its successes at every evaluation and its p-value; the
    # losses, the way the run went, before the lone gain (which 17 of them keep off the page)
    second = diff["pairs"][1]
    assert (second["task"], second["verdict"]) == ("eval-10", "weak_loss")
    assert (
        second["evidence"]["history"] == [[0, 1, 1], [2, 0, 1], [4, 0, 1]] and second["evidence"]["p"] == 0.5
    )
    assert "eval-19" not in [p["task"] for p in diff["pairs"]]
    assert diff["tally"] == {
        "learned": 1,
        "forgot": 0,
        "weak_gain": 1,
        "weak_loss": 17,
        "changed": 0,
        "same": 2,
    }
    # over all these tasks' episodes, held-out success fell from 19/24 to 7/24: the page says so
    assert diff["success"]["first"] == [19, 24] and diff["success"]["last"] == [7, 24]
    assert "fell" in diff["warn"], diff


def test_the_first_difference_in_arrow_is_the_first_difference_in_python():
    cases = [
        ([[1, 2], [3]], [[1, 2], [3]]),  # identical
        ([[1, 2], [3]], [[1, 2], [4]]),  # a token of turn 2
        ([[1, 2], [3]], [[1], [2, 3]]),  # same ids, cut into turns differently
        ([[1, 2]], [[1, 2], [3]]),  # one more turn
        ([[1, 2], [3]], [[1, 2]]),
        ([], [[1]]),
        ([[], [5]], [[], [6]]),  # an empty turn first
        ([[1, 2, 3]], [[1, 2]]),
    ]
    actions = pa.chunked_array(
        [pa.array([c for pair in cases for c in pair], type=pa.list_(pa.list_(pa.int32())))]
    )
    for k, (a, b) in enumerate(cases):
        assert first_difference_at(actions, 2 * k, 2 * k + 1) == first_difference(a, b), (a, b)
