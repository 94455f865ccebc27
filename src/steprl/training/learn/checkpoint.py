"""Checkpoints that cannot be half-written (reliability.md CKPT-01, 04, 05, 07).

Layout under `<run_dir>/checkpoints/`:

    step_000040/   model (HF format; with LoRA the adapters, whose config names the base),
                   tokenizer, config.yaml, state.pt (optimizers, value head, critic, adapters,
                   TrainState), manifest.json (sha256 of every other file: written last)
    latest -> step_000040    a symlink, replaced atomically after the directory is complete

A checkpoint is written into `.tmp-step_N/`, every file is flushed to disk, the manifest is
written, the directory is renamed, and only then does `latest` move and do older checkpoints
beyond `keep_last` go. A kill at any point leaves `latest` on a complete checkpoint; a
left-over `.tmp-*` is removed at the next start. A file whose checksum fails makes the loader
fall back to the previous checkpoint, with a warning. Nothing is written through a link:
`checkpoints/` being one is refused with one line; a link at a checkpoint's own names
(`.tmp-step_N`, `step_N`) is replaced, its target untouched.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from steprl.diagnostics.sinks import no_link, open_output
from steprl.errors import RunAborted, UserError
from steprl.training.learn.lora import is_adapter_checkpoint, is_peft, load_adapter_checkpoint, save_adapters

MANIFEST = "manifest.json"
STATE = "state.pt"
LATEST = "latest"


class CheckpointSaveError(RunAborted):
    """A save failed (disk full, I/O error): the previous checkpoint is intact."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def _write(path: Path, data: bytes) -> None:
    """Every byte of state.pt and the manifest goes through here (tests inject faults)."""
    with open_output(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    root: Path,
    step: int,
    *,
    write_model: Callable[[Path, Path], None],
    tokenizer: Any,
    state: dict[str, Any],
    config_yaml: str,
    keep_last: int,
) -> Path:
    """Write checkpoint `step` and point `latest` at it; raise `CheckpointSaveError` (one line)
    if the disk refuses, leaving the previous checkpoint as it was."""
    no_link(root).mkdir(parents=True, exist_ok=True)
    final = step_dir(root, step)
    tmp = root / f".tmp-{final.name}"
    for own in (tmp, final):  # our names: a link there goes (never what it points at)
        if own.is_symlink():
            own.unlink()
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        write_model(tmp, final)
        tokenizer.save_pretrained(tmp)
        _write(tmp / "config.yaml", config_yaml.encode())
        buf = io.BytesIO()  # serialise in memory: a full disk is then an OSError from write()
        torch.save(state, buf)
        _write(tmp / STATE, buf.getvalue())
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        for p in files:  # what transformers and tokenizers wrote: flushed before the manifest
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
        manifest = {"step": step, "files": {str(p.relative_to(tmp)): _sha256(p) for p in files}}
        _write(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        _fsync_dir(tmp)
        if final.exists():  # a checkpoint of the same step from before a resume: replaced whole
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync_dir(root)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_complete(root)
        kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        free = shutil.disk_usage(root).free // 2**20
        raise CheckpointSaveError(
            f"checkpoint save at step {step} failed: {type(exc).__name__}: {exc} "
            f"({free} MiB free under {root}); {kept}; free space or move run.output_dir, "
            + then_what(root.parent, previous)
        ) from exc
    link = root / f".{LATEST}.tmp"
    link.unlink(missing_ok=True)
    link.symlink_to(final.name)
    os.replace(link, root / LATEST)  # atomic: `latest` is the old or the new, never neither
    for old in complete_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def then_what(run_dir: Path, last: Path | None) -> str:
    """What to do once a write the disk refused has room again: resume from the checkpoint
    `last`, or, with none saved, start the run again (a --resume would be refused then, and so
    would the same command, the run directory being there)."""
    if last is not None:
        then = f"then resume with: steprl train --resume {run_dir}"
        return f"{then} (from {last.name}: the steps after it run again)"
    return (
        "then start the run again with --set run.overwrite=true: no checkpoint was saved before it "
        "(trainer.checkpoint_every), so there is nothing to resume"
    )


def clean_stale(root: Path) -> list[Path]:
    """Remove what a killed save left behind (`.tmp-*`, a half-made `latest` link)."""
    stale = [p for p in root.glob(".tmp-*")] + [p for p in root.glob(f".{LATEST}.tmp")]
    for p in stale:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return stale


def complete_checkpoints(root: Path) -> list[Path]:
    """Directories with a manifest (so fully written), oldest first."""
    return sorted(p for p in root.glob("step_*") if (p / MANIFEST).is_file())


def latest_complete(root: Path) -> Path | None:
    found = complete_checkpoints(root) if root.is_dir() else []
    return found[-1] if found else None


def verify(path: Path) -> str | None:
    """None if every file matches the manifest, else what is wrong (one phrase)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        return f"unreadable manifest ({exc})"
    for name, digest in manifest["files"].items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if _sha256(f) != digest:
            return f"{name} fails its checksum"
    return None


def find_checkpoint(root: Path, warn: Callable[[str], None]) -> Path | None:
    """The newest checkpoint that verifies: `latest` first, then older ones (CKPT-07)."""
    if not root.is_dir():
        return None
    candidates = complete_checkpoints(root)[::-1]
    pointed = root / LATEST
    if pointed.is_symlink() and pointed.resolve() in [c.resolve() for c in candidates]:
        target = pointed.resolve()
        candidates = [target, *(c for c in candidates if c.resolve() != target)]
    for i, c in enumerate(candidates):
        problem = verify(c)
        if problem is None:
            return c
        rest = candidates[i + 1 :]
        warn(
            f"WARNING: checkpoint {c} is corrupt: {problem}; "
            + (f"falling back to {rest[0].name}" if rest else "no earlier checkpoint to fall back to")
        )
    return None


def load_state(path: Path) -> dict[str, Any]:
    """state.pt of a verified checkpoint (ours: pickled RNG states, so not weights_only)."""
    return torch.load(path / STATE, map_location="cpu", weights_only=False)


def write_model(model: Any, directory: Path, final: Path) -> None:
    """The policy in HF format into `directory` (LoRA: the adapters, their config naming the
    base; `final` is where the directory is renamed to)."""
    if is_peft(model):
        save_adapters(model, directory, final)
    else:
        model.save_pretrained(directory)


def load_model_weights(model: Any, path: Path) -> None:
    """Restore a full (non-LoRA) policy from the checkpoint's safetensors, exactly."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("model*.safetensors")):
        weights |= load_file(f)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")}  # tied to the embeddings: saved once
    if unexpected or set(missing) - tied:
        raise RuntimeError(
            f"{path}: weights do not fit the model (missing {missing}, unexpected {unexpected})"
        )


class CheckpointNotUsable(UserError):
    """A checkpoint named on the command line that is missing, incomplete or corrupt."""


def resolve_checkpoint(path: Path, warn: Callable[[str], None]) -> Path:
    """What `steprl eval PATH` evaluates, verified against its manifest as a resume is:

    * a checkpoint (`checkpoints/step_N`, or `checkpoints/latest`): itself; one that fails its
      manifest is refused (`CheckpointNotUsable`, one line): it was asked for by name;
    * a run directory or its `checkpoints/`: the newest checkpoint that verifies (`find_checkpoint`:
      a corrupt one falls back to the previous complete one, with a warning)."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        problem = verify(path)
        if problem is not None:
            raise CheckpointNotUsable(
                f"checkpoint {path} is corrupt: {problem}; evaluate another checkpoint, or the run "
                "directory (its newest checkpoint that verifies)"
            )
        return path.resolve()
    for root in (path / "checkpoints", path):
        if complete_checkpoints(root):
            found = find_checkpoint(root, warn)
            if found is None:
                raise CheckpointNotUsable(f"{path}: no checkpoint under {root} verifies (see the warnings)")
            return found.resolve()
    raise CheckpointNotUsable(
        f"{path} is not a checkpoint (no {MANIFEST}) or a run directory with a complete one; pass "
        "runs/<name> or runs/<name>/checkpoints/step_N"
    )


def load_checkpoint_model(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    """The policy of a checkpoint as a plain `transformers` model, ready to generate: a full
    checkpoint as saved; a LoRA one as its named base with the adapters merged in."""
    if is_adapter_checkpoint(path):
        return load_adapter_checkpoint(path, merged=True, dtype=dtype)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
