"""What a valid config still has to pass on this machine, and what it sets for nothing.

`check_host(cfg)`: `model.device` exists here, `model.cache_dir` is not a file, the tiny
model fits this machine's memory and `run.output_dir` can hold the run directory; each
failure is a `ConfigError`, one line that names the key and the allowed values, raised before
any work (the CLI calls it right after `load_config`).

`config_warnings(cfg)`: settings that are valid but mean nothing in this config (a critic no
advantage reads, `keep_last_k` under a context rule without a window, an option of a runtime
backend that is not selected, ...), one line each; the trainer logs them once at start.
"""

from __future__ import annotations

import os
from pathlib import Path

from steprl.algorithms import ADVANTAGE_NEEDS_CRITIC
from steprl.config.schema import Config, ConfigError, ModelSection, RolloutSection, RuntimeSection

__all__ = [
    "check_cache_dir",
    "check_device",
    "check_host",
    "check_output_dir",
    "check_tiny_size",
    "config_warnings",
]

#: Context rules that read `rollout.keep_last_k`.
_WINDOWED = ("keep_last_k", "drop_old_observations")


def check_host(cfg: Config, *, device: bool = True, output_dir: bool = True) -> None:
    """`check_device` (with the model's own checks) and `check_output_dir` for `cfg` (`steprl
    eval` and `sft` write no run directory; `steprl check-env` needs neither)."""
    if device:
        check_device(cfg.model.device)
        check_cache_dir(cfg.model.cache_dir)
        check_tiny_size(cfg.model)
    if output_dir:
        check_output_dir(cfg.run.output_dir, cfg.run.name)
    # each missing extra: one line before any work, not after the warm start has trained
    from steprl.extras import require_extra

    if cfg.logging.wandb is not None:
        require_extra("wandb", feature="logging.wandb")
    if cfg.runtime.backend in _BACKEND_EXTRAS:
        require_extra(_BACKEND_EXTRAS[cfg.runtime.backend], feature=f"runtime.backend={cfg.runtime.backend}")
    if cfg.runtime.learner_ranks > 1:
        require_extra("ray", feature="runtime.learner_ranks > 1")
    if cfg.runtime.rollout_workers > 0:
        require_extra("ray", feature="runtime.rollout_workers > 0")


#: The extra each non-default env backend needs (`hosting/backend.py` BACKENDS imports them on use).
_BACKEND_EXTRAS = {"http": "serve", "ray": "ray"}


def _allowed_devices(n_cuda: int, mps: bool) -> str:
    cuda = [] if n_cuda == 0 else ["cuda", "cuda:0" if n_cuda == 1 else f"cuda:0..cuda:{n_cuda - 1}"]
    return ", ".join(["cpu", *cuda, *(["mps"] if mps else [])])


def check_device(device: str) -> None:
    """`model.device` is cpu, a CUDA device this machine has, or mps where it is available
    (other torch backends are left to `steprl.models.sources.check_device_dtype`). Counting
    CUDA devices does not initialise CUDA."""
    import torch

    n = torch.cuda.device_count()
    mps = torch.backends.mps.is_available()
    allowed = _allowed_devices(n, mps)
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(
            f"model.device={device!r} is not a torch device; allowed values: {allowed}"
        ) from None
    if dev.type == "cuda" and (dev.index or 0) >= n:
        why = f"this machine has {n} CUDA device(s), torch {torch.__version__}"
    elif dev.type == "mps" and not mps:
        why = "mps is not available here"
    else:
        return
    raise ConfigError(f"model.device={device!r}: no such device ({why}); allowed values: {allowed}")


def check_cache_dir(cache_dir: str | None) -> None:
    """`model.cache_dir` is a directory or not there yet (the warm start makes it): a file there
    is refused now, not after the minutes of warm-start training it would be written after."""
    if cache_dir is not None and Path(cache_dir).exists() and not Path(cache_dir).is_dir():
        raise ConfigError(
            f"model.cache_dir={cache_dir!r}: a file, not a directory; set model.cache_dir to a "
            "directory (made if missing), or leave it unset for the per-user cache"
        )


#: float32 bytes per parameter while training: the weights, their gradients, Adam's two
#: moments and the engine's copy
_TRAIN_BYTES_PER_PARAM = 5 * 4
#: tokens beyond the tiny tokenizer's words: characters and special tokens (models/tiny.py)
_TINY_BASE_VOCAB = 256


def tiny_parameters(model: ModelSection) -> int:
    """About how many parameters `model.tiny` builds (a Llama with tied embeddings)."""
    t = model.tiny
    vocab = _TINY_BASE_VOCAB + len(t.words)
    per_layer = 4 * t.hidden_size**2 + 3 * t.hidden_size * t.intermediate_size + 2 * t.hidden_size
    return vocab * t.hidden_size + t.num_layers * per_layer + t.hidden_size


def check_tiny_size(model: ModelSection, memory: int | None = None) -> None:
    """The tiny model trains within half of `memory` (default: this machine's RAM): a size past
    it is one line now, not an allocation traceback or a machine out of memory."""
    if model.name != "tiny":
        return
    if memory is None:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    n = tiny_parameters(model)
    need = n * _TRAIN_BYTES_PER_PARAM
    if need > memory // 2:
        raise ConfigError(
            f"model.tiny: about {n:,} parameters need about {need / 2**30:.1f} GiB to train (weights, "
            f"gradients, Adam state, the engine's copy), over half of this machine's "
            f"{memory / 2**30:.1f} GiB; lower model.tiny.hidden_size, num_layers or intermediate_size"
        )


def check_output_dir(output_dir: str, name: str) -> None:
    """`<output_dir>/<name>` is, or can be made, a directory this process can write in. Nothing
    is created here: the trainer makes the run directory."""
    target = (Path(output_dir) / name).absolute()
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        problem = "is a file, not a directory"
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = "is not writable"
    else:
        return
    raise ConfigError(
        f"run.output_dir={output_dir!r}: {existing} {problem}, so the run directory {target} cannot "
        "be made; set run.output_dir to a directory you can write to (or change run.name)"
    )


def _default(section: type[RolloutSection | RuntimeSection], key: str) -> object:
    return section.model_fields[key].default


def config_warnings(cfg: Config, *, max_positions: int | None = None) -> list[str]:
    """One line per setting that is valid but has no effect (or one that cannot work as meant)
    in `cfg`. Pure: reads only `cfg`. `max_positions` is the model's position limit; for the
    tiny model it is known here, for others pass it (None: not checked)."""
    out: list[str] = []
    r, a, rt = cfg.rollout, cfg.algorithm, cfg.runtime
    if r.keep_last_k != _default(RolloutSection, "keep_last_k") and r.context not in _WINDOWED:
        out.append(
            f"rollout.keep_last_k={r.keep_last_k} has no effect under rollout.context={r.context} "
            f"(only {' and '.join(_WINDOWED)} read it)"
        )
    if a.critic != "none" and not ADVANTAGE_NEEDS_CRITIC.get(a.advantage):
        users = ", ".join(k for k, v in ADVANTAGE_NEEDS_CRITIC.items() if v)
        out.append(
            f"algorithm.critic={a.critic} is trained but unused: advantage={a.advantage} reads no critic "
            f"(only {users} do); set algorithm.critic=none"
        )
    if a.kl_in == "reward" and a.kl_coef == 0:
        out.append(
            "algorithm.kl_in=reward has no effect with algorithm.kl_coef=0 (no KL penalty is applied); "
            "set algorithm.kl_coef > 0, e.g. 0.001"
        )
    if rt.backend != "http":
        for key in ("env_server_url", "env_token_var"):
            if getattr(rt, key) != _default(RuntimeSection, key):
                out.append(
                    f"runtime.{key} is set but runtime.backend={rt.backend}: only backend=http reads it"
                )
    if rt.backend != "ray":
        for key in ("env_workers", "rollout_workers"):
            if getattr(rt, key) != _default(RuntimeSection, key):
                out.append(
                    f"runtime.{key}={getattr(rt, key)} has no effect with runtime.backend={rt.backend}: "
                    "only backend=ray reads it"
                )
    if max_positions is None and cfg.model.name == "tiny":
        from steprl.models.tiny import TinyModelSpec  # transformers: only when it is the tiny model

        max_positions = TinyModelSpec().max_positions
    if max_positions is not None and r.max_total_tokens > max_positions:
        out.append(
            f"rollout.max_total_tokens={r.max_total_tokens} is beyond the model's {max_positions} positions "
            f"(model.name={cfg.model.name}): an episode that long leaves the positions the model knows; "
            f"set rollout.max_total_tokens <= {max_positions}"
        )
    return out
