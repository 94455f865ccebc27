"""Files: each bucket a safetensors file in a directory (its version, index, count and each
tensor's checksum in the file's metadata), read back in order and checked; for an engine in a
process that shares a file system but not memory (the vLLM worker, `engines/vllm_worker.py`,
which reads the same files itself and checks the same checksums). A LoRA adapter travels
merged by the sender (the vLLM engine merges into its plain copy first)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from steprl.engines.weights import Bucket, WeightSyncError, WeightUpdate, checksum


@dataclass(frozen=True)
class FileHandle:
    version: int
    names: tuple[str, ...]
    paths: tuple[str, ...]


class SafetensorsFiles:
    """Writes under `directory` (made if missing); `release` removes what `send` wrote."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def send(self, update: WeightUpdate) -> FileHandle:
        from safetensors.torch import save_file

        if update.adapter is not None:
            raise WeightSyncError("the file transport carries full tensors: merge the adapter first")
        self.directory.mkdir(parents=True, exist_ok=True)
        paths = []
        for b in update.buckets():
            path = self.directory / f"weights-{b.version}-{b.index:05d}.safetensors"
            tensors = {k: v.detach().to("cpu").contiguous() for k, v in b.tensors.items()}
            sums = json.dumps({k: checksum(v) for k, v in tensors.items()})
            meta = {
                "version": str(b.version),
                "index": str(b.index),
                "count": str(b.count),
                "checksums": sums,
            }
            save_file(_unshared(tensors), path, metadata=meta)
            paths.append(str(path))
        return FileHandle(update.version, update.names, tuple(paths))

    def receive(self, handle: FileHandle) -> WeightUpdate:
        return WeightUpdate(
            handle.version, handle.names, lambda: (read_bucket(Path(p)) for p in handle.paths)
        )

    def release(self, handle: FileHandle) -> None:
        for p in handle.paths:
            Path(p).unlink(missing_ok=True)


def read_bucket(path: Path) -> Bucket:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    try:
        version, index, count = int(meta["version"]), int(meta["index"]), int(meta["count"])
    except (KeyError, ValueError):
        raise WeightSyncError(f"{path}: not a weight bucket (no version, index and count)") from None
    return Bucket(version, index, count, load_file(str(path)), json.loads(meta.get("checksums", "{}")))


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): a copy of the second."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for k, v in tensors.items():
        out[k] = v.clone() if v.data_ptr() in seen else v
        seen.add(v.data_ptr())
    return out


__all__ = ["FileHandle", "SafetensorsFiles", "read_bucket"]
