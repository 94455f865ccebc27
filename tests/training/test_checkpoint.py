"""Checkpoints that cannot be half-written: CKPT-01 (a kill at any point of a save), CKPT-04
(keep_last=1 and a crash), CKPT-05 (disk full / EIO), CKPT-07 (a flipped byte)."""

from __future__ import annotations

import errno
import functools
import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from steprl.models import tiny
from steprl.training.learn import checkpoint as ckpt


class Killed(BaseException):
    """What SIGKILL does to a save, as far as the files are concerned: it stops, nothing cleans up."""


@pytest.fixture(scope="module")
def model_and_tokenizer():
    tok = tiny.build_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    return LlamaForCausalLM(cfg), tok


def _save(root: Path, step: int, mt, keep_last: int = 2, payload: float = 0.0) -> Path:
    model, tok = mt
    state = {"train_state": {"step": step}, "x": torch.full((4,), payload)}
    return ckpt.save_checkpoint(
        root,
        step,
        write_model=functools.partial(ckpt.write_model, model),
        tokenizer=tok,
        state=state,
        config_yaml="run: {}\n",
        keep_last=keep_last,
    )


def _loaded_step(root: Path, warnings: list[str] | None = None) -> int | None:
    found = ckpt.find_checkpoint(root, (warnings if warnings is not None else []).append)
    return None if found is None else ckpt.load_state(found)["train_state"]["step"]


def test_layout_manifest_latest_and_keep_last(tmp_path, model_and_tokenizer):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        _save(root, step, model_and_tokenizer, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000003"]
    assert os.readlink(root / "latest") == "step_000003"
    assert ckpt.verify(root / "step_000003") is None
    assert _loaded_step(root) == 3


def _count_fsyncs(monkeypatch) -> list[int]:
    calls = [0]
    real = os.fsync

    def counting(fd: int) -> None:
        calls[0] += 1
        real(fd)

    monkeypatch.setattr(ckpt.os, "fsync", counting)
    return calls


def test_ckpt01_a_kill_at_any_point_of_a_save_keeps_the_previous_checkpoint(
    tmp_path, model_and_tokenizer, monkeypatch
):
    root = tmp_path / "measure"
    _save(root, 1, model_and_tokenizer)
    calls = _count_fsyncs(monkeypatch)
    _save(root, 2, model_and_tokenizer)
    points = calls[0]  # every file, the manifest, the directories: each a place a kill can land
    assert points >= 6
    real = os.fsync
    for k in range(points + 1):  # + 1: after the rename, before `latest` moves
        root = tmp_path / f"kill-{k}"
        _save(root, 1, model_and_tokenizer)
        seen = [0]

        def killing(fd: int, k: int = k, seen: list[int] = seen) -> None:
            seen[0] += 1
            if seen[0] > k:
                raise Killed
            real(fd)

        monkeypatch.setattr(ckpt.os, "fsync", killing)
        if k == points:
            monkeypatch.setattr(ckpt.os, "fsync", real)
            monkeypatch.setattr(ckpt.os, "replace", lambda *a: (_ for _ in ()).throw(Killed()))
        with pytest.raises(Killed):
            _save(root, 2, model_and_tokenizer, keep_last=1)
        monkeypatch.setattr(ckpt.os, "fsync", real)
        monkeypatch.setattr(ckpt.os, "replace", os.replace)
        # `latest` still names a complete checkpoint, and the loader takes a complete one
        assert ckpt.verify((root / "latest").resolve()) is None
        assert _loaded_step(root) in (1, 2)
        if k < points - 1:  # killed before the rename: the partial directory is ignored...
            assert _loaded_step(root) == 1 and (root / ".tmp-step_000002").exists()
        removed = ckpt.clean_stale(root)  # ...and cleaned at the next start
        assert not list(root.glob(".tmp-*")) and not list(root.glob(".latest.tmp"))
        assert (root / "step_000001").exists()  # CKPT-04: keep_last=1 never deleted it first
        del removed


def test_ckpt05_disk_full_is_one_line_and_the_previous_checkpoint_survives(
    tmp_path, model_and_tokenizer, monkeypatch
):
    root = tmp_path / "checkpoints"
    _save(root, 1, model_and_tokenizer)

    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(ckpt, "_write", full)
    with pytest.raises(ckpt.CheckpointSaveError) as err:
        _save(root, 2, model_and_tokenizer)
    msg = str(err.value)
    assert "\n" not in msg and "No space left on device" in msg and "step_000001 is intact" in msg
    assert (
        "MiB free" in msg and f"then resume with: steprl train --resume {tmp_path} (from step_000001" in msg
    )
    assert not list(root.glob(".tmp-*")) and not (root / "step_000002").exists()
    assert _loaded_step(root) == 1

    def eio(path: Path, data: bytes) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))

    monkeypatch.setattr(ckpt, "_write", eio)
    with pytest.raises(ckpt.CheckpointSaveError, match="Input/output error"):
        _save(root, 2, model_and_tokenizer)
    assert _loaded_step(root) == 1


def test_a_full_disk_at_the_first_save_says_start_again_not_resume(
    tmp_path, model_and_tokenizer, monkeypatch
):
    """Issue 44 item 11: with no checkpoint saved, "then resume" led to a refusal (--resume: no
    complete checkpoint), and without run.overwrite the same command is refused too (the run
    directory is there)."""

    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(ckpt, "_write", full)
    with pytest.raises(ckpt.CheckpointSaveError) as err:
        _save(tmp_path / "checkpoints", 2, model_and_tokenizer)
    msg = str(err.value)
    assert (
        "\n" not in msg
        and "No space left on device" in msg
        and "resume" not in msg.replace("nothing to resume", "")
    )
    assert "so there is nothing to resume" in msg
    assert "start the run again with --set run.overwrite=true" in msg


def test_ckpt07_a_flipped_byte_falls_back_to_the_previous_checkpoint(tmp_path, model_and_tokenizer):
    root = tmp_path / "checkpoints"
    _save(root, 1, model_and_tokenizer, payload=1.0)
    _save(root, 2, model_and_tokenizer, payload=2.0)
    target = root / "step_000002" / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    warnings: list[str] = []
    assert _loaded_step(root, warnings) == 1
    assert len(warnings) == 1
    assert "step_000002 is corrupt: model.safetensors fails its checksum" in warnings[0]
    assert "falling back to step_000001" in warnings[0]
    (root / "step_000001" / "state.pt").unlink()
    warnings.clear()
    assert _loaded_step(root, warnings) is None and "no earlier checkpoint" in warnings[-1]


def test_resolve_checkpoint_accepts_a_run_directory(tmp_path, model_and_tokenizer):
    root = tmp_path / "run" / "checkpoints"
    _save(root, 3, model_and_tokenizer)
    (tmp_path / "run" / "config.yaml").write_text("run: {}\n")  # a run's own: not a checkpoint's
    for given in (tmp_path / "run", root, root / "latest", root / "step_000003"):
        assert ckpt.resolve_checkpoint(given, print) == (root / "step_000003").resolve()
