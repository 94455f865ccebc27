"""benchmarks/device_kit.py: the GGUF travels to a GPU machine in pieces that fit one call each;
the pieces must join into the same bytes, and a damaged or missing piece must be refused, not
converted into a wrong model."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _kit():
    spec = importlib.util.spec_from_file_location("device_kit", ROOT / "benchmarks" / "device_kit.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pieces_join_into_the_same_file_and_a_damaged_or_missing_one_is_refused(tmp_path: Path) -> None:
    kit = _kit()
    blob = tmp_path / "model.gguf"
    blob.write_bytes(os.urandom(2500))
    kit.pack(tmp_path / "kit", blob, "3.12", wheels=False, piece=1000)
    folders = sorted((tmp_path / "kit").glob("c*"))
    assert [f.name for f in folders] == ["c0", "c1", "c2"]  # 1000 + 1000 + 500 bytes

    home = tmp_path / "device"
    for folder in folders[:2]:
        kit.receive(folder, home)
    with pytest.raises(SystemExit, match="pieces 2 were not received"):
        kit.join(home)

    damaged = tmp_path / "c2"
    damaged.mkdir()
    (damaged / "manifest.json").write_bytes((folders[2] / "manifest.json").read_bytes())
    (damaged / "piece").write_bytes(b"x" * 500)
    with pytest.raises(SystemExit, match="piece 2: sha256 differs"):
        kit.receive(damaged, home)

    kit.receive(folders[2], home)
    joined = kit.join(home)
    assert joined.read_bytes() == blob.read_bytes() and joined.name == kit.GGUF_NAME
