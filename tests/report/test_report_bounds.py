"""The report stays small whatever the run holds (issue 44, item 9): a run of hostile episodes
(1 MiB observations, 10,000-turn episodes, bidi controls U+202A-U+202E and U+2066-U+2069 and a
"</script>" in token texts, task ids and step infos, thousands of metrics rows) gives a page under
10 MB, where each cut piece says its full length and the `steprl show` line that prints the rest,
and no bidi control reaches the page (each is shown as a visible escape, e.g. "⟨U+202E⟩")."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from fixture_run import CONFIG, page_data, steprl
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from steprl.diagnostics import JsonlSink, TrajectoryWriter
from steprl.report import Caps, write_report
from steprl.report.budget import size
from steprl.types import EndReason, Step, Trajectory

BIDI = [chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))]
BIDI_RE = re.compile("[" + "".join(BIDI) + "]")
VOCAB = ["[UNK]", "</script>", *BIDI, *"abcdefgh<>/ ", "\u202eevil\u202c"]
EVIL = "t\u202e1</script>\u2066x"  # in task ids and step infos
BIG = tuple(k % len(VOCAB) for k in range(2**20))  # a 1 MiB observation: 1,048,576 ids
ACTION = (1, *range(2, 2 + len(BIDI)), len(VOCAB) - 1)


def _episode(task: str, turns: int, observation: tuple[int, ...], reward: float, version: int) -> Trajectory:
    """`turns` turns (one Step object repeated) seeing `observation`, then the answer; a one-turn
    episode's info is 20,000 characters of bidi controls and "</script>"."""
    info = {"note": EVIL * (2000 if turns == 1 else 1), "reward_components": {"outcome": reward}}
    step = Step((2, 3), ACTION, tuple(-0.5 for _ in ACTION), observation, 0.0, version, info)
    last = Step((2, 3), ACTION, step.action_logprobs, observation, reward, version, info)
    return Trajectory(
        task, f"g-{task}", "calc\u2067ulator", (step,) * (turns - 1) + (last,), reward, EndReason.ANSWERED
    )


def _with_tokenizer(run: Path) -> Path:
    """`run` with a checkpoint tokenizer whose tokens are `VOCAB` (bidi controls among them)."""
    (run / "checkpoints" / "latest").mkdir(parents=True)
    tok = Tokenizer(WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.save(str(run / "checkpoints" / "latest" / "tokenizer.json"))
    return run


def _hostile_run(root: Path) -> Path:
    run = _with_tokenizer(root / "hostile")
    config = {**CONFIG, "run": {"name": "hostile\u202e</script>"}, "model": {"name": str(run / "hf")}}
    (run / "config.yaml").write_text(yaml.safe_dump(config, allow_unicode=True))
    train = TrajectoryWriter(run / "trajectories")
    big = [_episode(f"{EVIL}-{k}", 1, BIG, float(k % 2), 0) for k in range(2)]  # one group of 2
    train.write(1, big, advantages=[[[0.5] * len(ACTION)]] * 2)
    train.write(2, [_episode("long-0", 10_000, ACTION, 0.0, 1)], advantages=[[[0.5] * len(ACTION)] * 10_000])
    evals = TrajectoryWriter(run / "eval_trajectories")
    for step, reward, turns in ((0, 0.0, 3), (2, 1.0, 10_000)):  # "long" took 3 turns at first
        long = _episode("long", turns, ACTION, reward, step)
        evals.write(step, [_episode(EVIL, 1, BIG, reward, step), long])
    with JsonlSink(run / "metrics.jsonl") as sink:
        for step in range(1, 5001):
            sink.log(
                step, {"reward/mean": step % 7 / 7, "actor/entropy": 1 / step, "end_frac/\u202eanswered": 0.5}
            )
    return run


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _hostile_run(tmp_path_factory.mktemp("hostile"))


def test_a_hostile_run_gives_a_page_under_10_mb_with_no_bidi_control(hostile, monkeypatch, capsys):
    rc, printed = steprl(monkeypatch, capsys, "report", str(hostile), "-o", str(hostile / "r.html"))
    assert rc == 0, printed
    page = (hostile / "r.html").read_text(encoding="utf-8")
    assert len(page.encode("utf-8")) < 10_000_000, f"{len(page.encode()) / 1e6:.1f} MB"
    assert not BIDI_RE.search(page), sorted({hex(ord(c)) for c in BIDI_RE.findall(page)})
    assert "\u27e8U+202E\u27e9" in page and "\u27e8U+2066\u27e9" in page  # shown, not dropped
    assert page.count("</script>") == 2  # the data's and the code's own
    data = page_data(hostile / "r.html")
    sections = {s["name"]: s for s in data["sections"]}
    assert all("error" not in s for s in sections.values()), [s.get("error") for s in sections.values()]
    episodes = sections["episodes"]["data"]["episodes"]
    caps = Caps()
    big = next(e for e in episodes if e["task"].endswith("-0"))
    assert big["turns"][0]["ol"] == 2**20 and 0 < len(big["turns"][0]["o"]) <= caps.turn_tokens
    assert big["show"].startswith(f"steprl show {hostile} --step 1 --task ")
    long = next(e for e in episodes if e["task"] == "long-0")
    assert long["turns_total"] == 10_000 and 1 < len(long["turns"]) < 10_000
    assert long["turns"][-1]["k"] == 9_999  # the last turn (the answer) is kept
    assert all(len(t["info"].get("raw", "")) <= caps.info_chars + 40 for e in episodes for t in e["turns"])
    diff = sections["learning_diff"]["data"]
    assert {p["task"] for p in diff["pairs"]} == {
        "long",
        EVIL.replace("\u202e", "\u27e8U+202E\u27e9").replace("\u2066", "\u27e8U+2066\u27e9"),
    }
    for chart in sections["curves"]["data"]["charts"]:
        assert all(len(s["points"]) <= caps.curve_points for s in chart["series"]), chart["title"]
    assert len(json.dumps(data["tokens"])) < 100_000


def test_the_shares_hold_for_many_episodes_each_over_its_share(tmp_path):
    # the caps scaled down 50x: 190 episodes of 3,000-token observations, ~470 bytes of share each
    caps = Caps(episode_bytes=90_000, diff_bytes=30_000, other_bytes=60_000, section_bytes=40_000)
    run = _with_tokenizer(tmp_path / "many")
    (run / "config.yaml").write_text(yaml.safe_dump({**CONFIG, "run": {"name": "many"}}))
    obs = BIG[:3000]
    TrajectoryWriter(run / "trajectories").write(1, [_episode("t", 2, obs, k % 2, 0) for k in range(150)])
    evals = TrajectoryWriter(run / "eval_trajectories")
    for step in (0, 1):
        evals.write(step, [_episode(f"e{k}", 1, obs, float(step), step) for k in range(20)])
    written = write_report(run, tmp_path / "r.html", caps=caps)
    shell = 100_000  # the page's script, styles and header
    assert written.bytes < caps.episode_bytes + caps.diff_bytes + caps.other_bytes + shell
    sections = {s["name"]: s for s in page_data(written.path)["sections"]}
    episodes = sections["episodes"]["data"]["episodes"]
    assert size(episodes) < caps.episode_bytes and size(sections["learning_diff"]["data"]) < caps.diff_bytes
    assert len(episodes) > 150 and all("show" in e for e in episodes)  # cut, and each says so
