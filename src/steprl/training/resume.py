"""A run directory is started fresh, resumed, or refused; a checkpoint holds, and gives back,
everything that continues a run exactly (weights, every optimizer, value head, critic, LoRA
adapters, `TrainState`).

    run.resume: never   an existing run directory is refused, unless run.overwrite clears it whole
    run.resume: auto    continue from the latest complete checkpoint if there is one
    run.resume: must    the same, but refuse when there is none (`steprl train CFG --resume DIR`)

Resuming keeps metrics.jsonl (rows after the checkpoint are dropped: those steps are redone),
TensorBoard (events after the checkpoint are purged) and the per-step trajectory files.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from steprl.config import Config, ConfigError, dump_config
from steprl.training import checkpoint as ckpt
from steprl.training.build import Parts
from steprl.training.lora import is_peft
from steprl.training.state import TrainState

CHECKPOINTS = "checkpoints"
#: keys a resume may change without `run.allow_config_change`: how the run is driven, not what
#: it trains (total_steps: a run is often extended)
RESUMABLE_CHANGES = frozenset(
    {
        "run.resume",
        "run.overwrite",
        "run.allow_config_change",
        "run.output_dir",  # a run directory may move
        "run.name",
        "trainer.total_steps",
        "logging.progress",
    }
)


def prepare_run_dir(cfg: Config, log: Callable[[str], None]) -> tuple[Path, Path | None]:
    """The run directory, ready to write, and the checkpoint to resume from (None: fresh)."""
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    root = run_dir / CHECKPOINTS
    if root.is_dir():
        for stale in ckpt.clean_stale(root):
            log(f"removed {stale.name}, left by a save that was interrupted")
    found = ckpt.find_checkpoint(root, log) if cfg.run.resume != "never" else None
    if found is not None:
        check_config_change(cfg, found)
        return run_dir, found
    if cfg.run.resume == "must":
        raise ConfigError(
            f"--resume {run_dir}: no complete checkpoint under {root}; start it afresh with "
            "run.overwrite=true, or check the path"
        )
    if run_dir.exists() and any(run_dir.iterdir()):
        if not cfg.run.overwrite:
            raise ConfigError(
                f"run.output_dir/run.name: {run_dir} already holds a run; continue it with "
                f"`steprl train CONFIG --resume {run_dir}`, clear it with --set run.overwrite=true, "
                "or choose another run.name"
            )
        shutil.rmtree(run_dir)  # overwrite: cleared whole, never two runs' files side by side
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"run.output_dir: cannot create {run_dir} ({exc.strerror}); choose a writable directory"
        ) from None
    return run_dir, None


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out |= _flat(v, f"{prefix}{k}.")
        return out
    return {prefix[:-1]: d}


def check_config_change(cfg: Config, checkpoint: Path) -> None:
    """CKPT-06: resuming under a different config is refused unless allowed, naming the keys."""
    before = _flat(yaml.safe_load((checkpoint / "config.yaml").read_text()))
    now = _flat(yaml.safe_load(dump_config(cfg)))
    changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
    changed = [k for k in changed if k not in RESUMABLE_CHANGES]
    if changed and not cfg.run.allow_config_change:
        shown = ", ".join(f"{k} ({before.get(k)!r} -> {now.get(k)!r})" for k in changed[:6])
        raise ConfigError(
            f"--resume: the config differs from the checkpoint's ({checkpoint}): {shown}; "
            "resume with the same config, or set run.allow_config_change=true"
        )


def checkpoint_state(parts: Parts, state: TrainState) -> dict[str, Any]:
    """What state.pt holds besides the HF-format policy (which `steprl eval` reads)."""
    learner, critic = parts.learner, parts.critic
    out: dict[str, Any] = {
        "optimizer": learner.optimizer.state_dict(),
        "value_head": learner.value_head.state_dict() if learner.value_head is not None else None,
        "critic": None,
        # LoRA: the adapters (and only they) are trainable; exact tensors, not the re-saved format
        "adapters": (
            {n: p.detach().clone() for n, p in learner.model.named_parameters() if p.requires_grad}
            if is_peft(learner.model)
            else None
        ),
        "train_state": state.to_dict(),
    }
    model = getattr(critic, "model", None)
    if model is not None:  # a separate critic: its own backbone, head and optimizer
        out["critic"] = {
            "model": model.state_dict(),
            "head": critic.head.state_dict(),  # type: ignore[union-attr]
            "optimizer": critic.optimizer.state_dict(),  # type: ignore[union-attr]
        }
    return out


def restore(parts: Parts, path: Path) -> TrainState:
    """Load a verified checkpoint into the built parts; the engines get its weights."""
    saved = ckpt.load_state(path)
    learner, critic = parts.learner, parts.critic
    if saved["adapters"] is not None:
        missing = set(saved["adapters"]) - {n for n, _ in learner.model.named_parameters()}
        if missing:
            raise ConfigError(
                f"{path}: adapters do not fit this model (e.g. {sorted(missing)[:2]}); check model.lora"
            )
        params = dict(learner.model.named_parameters())
        for n, t in saved["adapters"].items():
            params[n].data.copy_(t)
    else:
        ckpt.load_model_weights(learner.model, path)
    learner.optimizer.load_state_dict(saved["optimizer"])
    if learner.value_head is not None and saved["value_head"] is not None:
        learner.value_head.load_state_dict(saved["value_head"])
    if saved["critic"] is not None and getattr(critic, "model", None) is not None:
        critic.model.load_state_dict(saved["critic"]["model"])  # type: ignore[union-attr]
        critic.head.load_state_dict(saved["critic"]["head"])  # type: ignore[union-attr]
        critic.optimizer.load_state_dict(saved["critic"]["optimizer"])  # type: ignore[union-attr]
    state = TrainState.from_dict(saved["train_state"])
    parts.push_weights(state.policy_version)
    return state


def latest_checkpoint(run_dir: Path) -> Path | None:
    return ckpt.latest_complete(run_dir / CHECKPOINTS)


def save(parts: Parts, state: TrainState, run_dir: Path, cfg: Config) -> Path:
    return ckpt.save_checkpoint(
        run_dir / CHECKPOINTS,
        state.step,
        model=parts.learner.model,
        tokenizer=parts.policy.tokenizer,
        state=checkpoint_state(parts, state),
        config_yaml=dump_config(cfg),
        keep_last=cfg.trainer.keep_last,
    )
