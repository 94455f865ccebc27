"""Logging where users already look (issue 25, item 4): one tiny run with TensorBoard and an
offline Weights & Biases sink, read back with each tool's own reader.

TensorBoard: sample episodes as text, histograms of outcome rewards and advantages. W&B (the real
`wandb` package, `mode: offline`, no network): the scalars of metrics.jsonl at their steps and
the sample-episode table.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cli_runs import TINY_SCRATCH
from steprl.config import ConfigError, load_config
from steprl.diagnostics.sinks import read_metrics_jsonl
from steprl.diagnostics.wandb_sink import TABLE_COLUMNS, TABLE_KEY
from steprl.training.loop.trainer import TrainResult, train

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> TrainResult:
    """Two RL steps of a scratch model, an evaluation after each; the samples due every step."""
    tmp = tmp_path_factory.mktemp("dashboards")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")  # belt and braces: the config says offline too
        mp.setenv("WANDB_SILENT", "true")
        mp.delenv("WANDB_DIR", raising=False)  # the run directory, as users get it
        mp.setenv("WANDB_CONFIG_DIR", str(tmp / "wandb-config"))  # not the user's ~/.config
        cfg = load_config(
            "configs/calculator_tiny.yaml",
            [
                *TINY_SCRATCH,
                f"run.output_dir={tmp}",
                "trainer.total_steps=2",
                "trainer.eval_every=1",
                "logging.tensorboard=true",
                "logging.wandb.mode=offline",
                "logging.wandb.table_every=1",
                "logging.wandb.table_episodes=2",
            ],
        )
        return train(cfg, log=lambda _: None)


def test_tensorboard_shows_sample_episodes_and_histograms(run: TrainResult) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(
        str(run.run_dir / "tensorboard"), size_guidance={"tensors": 0, "histograms": 0}
    ).Reload()
    tags = events.Tags()
    assert {"histograms/outcome_reward", "histograms/advantage"} <= set(tags["histograms"])
    assert [e.step for e in events.Histograms("histograms/outcome_reward")] == [1, 2]
    assert events.Histograms("histograms/outcome_reward")[0].histogram_value.num == 4  # 2 tasks x 2
    # torch's SummaryWriter files text under "<tag>/text_summary"
    texts = sorted(t for t in tags["tensors"] if t.startswith("episodes/"))
    assert texts == [f"episodes/sample_{i}/text_summary" for i in range(4)]
    first = events.Tensors("episodes/sample_0/text_summary")[0]
    text = first.tensor_proto.string_val[0].decode()
    assert first.step == 1 and "step 1 · env calculator" in text and "[turn 1 action" in text


def _wandb_records(path: Path) -> Iterator[Any]:
    """The records of an offline run's .wandb file: W&B's protobuf `Record`s (parsed by wandb's
    own classes) in LevelDB's log framing (32 KiB blocks of [crc32c, length, type] records)
    after a 7-byte ':W&B' header; the python package no longer ships a reader for it."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B data file"
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # a block's zero padding
            pos += left
            continue
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def test_wandb_offline_holds_the_scalars_and_the_episode_table(run: TrainResult) -> None:
    (run_files,) = (run.run_dir / "wandb").glob("offline-run-*")
    history: dict[int, dict[str, Any]] = {}
    for record in _wandb_records(next(run_files.glob("run-*.wandb"))):
        if record.WhichOneof("record_type") == "history":
            row = history.setdefault(record.history.step.num, {})
            row.update({".".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    expected = read_metrics_jsonl(run.run_dir / "metrics.jsonl")
    assert sorted(history) == [r["step"] for r in expected] == [0, 1, 2]
    for row in expected:
        logged = history[row["step"]]
        for key, value in row.items():
            if key != "step" and value is not None:
                assert logged[key] == pytest.approx(value), key
    assert f"{TABLE_KEY}._type" not in history[0]  # step 0 is the warm start's evaluation
    tables = sorted(run_files.glob(f"files/media/table/{TABLE_KEY}_*.table.json"))
    assert [history[s][f"{TABLE_KEY}.path"] for s in (1, 2)] == [
        str(t.relative_to(run_files / "files")) for t in tables
    ]
    table = json.loads(tables[0].read_text())
    assert table["columns"] == TABLE_COLUMNS and len(table["data"]) == 2
    step, env, task, _reward, _end, turns, prompt, transcript = table["data"][0]
    assert (step, env) == (1, "calculator") and task and turns >= 1
    assert prompt and transcript.startswith("[turn 1 action")


def test_wandb_section_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"logging\.wandb\.mode"):
        load_config(None, ["logging.wandb.mode=cloud"])
    with pytest.raises(ConfigError, match=r"logging\.wandb\.table_every.*>= 0"):
        load_config(None, ["logging.wandb.table_every=-1"])
    with pytest.raises(ConfigError, match=r"logging\.wandb\.projcet: unknown key"):
        load_config(None, ["logging.wandb.projcet=x"])
    assert load_config(None, []).logging.wandb is None


def test_wandb_without_the_package_is_one_line_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from steprl.diagnostics.wandb_sink import WandbSink
    from steprl.extras import MissingExtra

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now fails as if absent
    with pytest.raises(
        MissingExtra, match=r"^logging\.wandb needs the wandb extra: pip install 'steprl\[wandb\]'$"
    ):
        WandbSink(tmp_path, name="x", config={}, mode="offline")
