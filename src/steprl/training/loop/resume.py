"""A run directory is started fresh, resumed, or refused; a checkpoint holds, and gives back,
everything that continues a run exactly (weights, every optimizer, value head, critic, LoRA
adapters, `TrainState`).

    run.resume: never   an existing run directory is refused, unless run.overwrite clears it whole
    run.resume: auto    continue from the latest complete checkpoint if there is one
    run.resume: must    the same, but refuse when there is none (`steprl train --resume DIR`)

Deciding (`plan_run_dir`) touches nothing; the directory is cleared and made (`make_run_dir`)
only once every start-up check has passed (config, env, model, extras), so a start that fails
leaves an earlier run whole. `run.overwrite` clears only a steprl run directory: one holding the
`.steprl-run` marker that `make_run_dir` writes (or, made before the marker, only what a run
writes, with its config.yaml and metrics.jsonl); anything else is refused with one line.

Resuming keeps metrics.jsonl (rows after the checkpoint are dropped: those steps are redone; a
line that cannot be read is dropped with a warning), TensorBoard (events after the checkpoint
are purged) and the per-step trajectory files (those after the checkpoint are removed and
written again; one that cannot be read is moved aside as `*.unreadable`, with a warning).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from steprl.bounded_yaml import load_yaml_bounded
from steprl.config import Config, ConfigError, dump_config
from steprl.diagnostics.sinks import no_link, open_output, readable_parquet
from steprl.training.components import component_states, load_component_states
from steprl.training.learn import checkpoint as ckpt
from steprl.training.setup.build import Parts
from steprl.training.state import TrainState

CHECKPOINTS = "checkpoints"
TRAJECTORIES = "trajectories"
#: written into every run directory steprl makes; `run.overwrite` clears only such a directory
MARKER = ".steprl-run"
#: what a run writes at its top level (a run made before the marker holds only these)
RUN_FILES = frozenset(
    {"config.yaml", "metrics.jsonl", CHECKPOINTS, TRAJECTORIES, "tensorboard", "learning_curve.png"}
)
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
        # the learner's processes: a checkpoint resumes on any number of ranks (resharded)
        "runtime.learner_ranks",
        "runtime.learner_placement",
        "runtime.learner_timeout_s",
        "runtime.learner_gpus_per_rank",
        "runtime.learner_cpu_offload",
        "runtime.weight_sync",  # how weights travel, not what they are
        "runtime.weight_delta",
    }
)


def resume_command(run_dir: Path) -> str:
    """The command that continues the run in `run_dir` as it was configured: its config.yaml
    holds every override it was started with (and its plugins)."""
    return f"steprl train --resume {run_dir}"


@dataclass(frozen=True)
class RunDir:
    """Where a run writes, decided (every refusal raised) before anything is touched."""

    path: Path
    resume_from: Path | None  # the checkpoint to continue from; None: a fresh run
    clear: bool  # run.overwrite: an earlier run's directory, cleared whole by `make_run_dir`


def is_run_dir(path: Path) -> bool:
    """A directory steprl made for a run (so `run.overwrite` may clear it)."""
    if path.is_symlink() or not path.is_dir():
        return False
    names = {p.name for p in path.iterdir()}
    return MARKER in names or (names <= RUN_FILES and {"config.yaml", "metrics.jsonl"} <= names)


def plan_run_dir(cfg: Config, log: Callable[[str], None]) -> RunDir:
    """The run directory and the checkpoint to resume from, or a `ConfigError` (one line).
    Reads only: nothing is cleared, made or written here."""
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    root = run_dir / CHECKPOINTS
    found = ckpt.find_checkpoint(root, log) if cfg.run.resume != "never" else None
    if found is not None:
        found = _redo_unreadable(run_dir, found, log)
        check_config_change(cfg, found)
        return RunDir(run_dir, found, clear=False)
    if cfg.run.resume == "must":
        raise ConfigError(
            f"--resume {run_dir}: no complete checkpoint under {root}; start it afresh with "
            "run.overwrite=true, or check the path"
        )
    if not (run_dir.exists() and any(run_dir.iterdir())):
        return RunDir(run_dir, None, clear=False)
    if not cfg.run.overwrite:
        raise ConfigError(
            f"run.output_dir/run.name: {run_dir} already holds a run; continue it with "
            f"`{resume_command(run_dir)}`, clear it with --set run.overwrite=true, "
            "or choose another run.name"
        )
    if not is_run_dir(run_dir):
        shown = ", ".join(sorted(p.name for p in run_dir.iterdir())[:3])
        raise ConfigError(
            f"run.overwrite: {run_dir} is not a steprl run directory (no {MARKER}; it holds {shown}), "
            "so it is not cleared; choose another run.name or run.output_dir, or empty it yourself"
        )
    return RunDir(run_dir, None, clear=True)


def make_run_dir(plan: RunDir, cfg: Config, log: Callable[[str], None]) -> Path:
    """Clear (overwrite) and make the run directory, with its marker and config.yaml; on a
    resume, remove what an interrupted save left and repair the trajectory files. Called once
    every start-up check has passed."""
    run_dir = plan.path
    try:
        if plan.clear:
            shutil.rmtree(run_dir)  # overwrite: cleared whole, never two runs' files side by side
        run_dir.mkdir(parents=True, exist_ok=True)
        for name, text in (
            (MARKER, "a steprl run directory: run.overwrite may clear it whole\n"),
            ("config.yaml", dump_config(cfg)),
        ):
            with open_output(run_dir / name, "w") as f:  # a link planted there: refused
                f.write(text)
    except OSError as exc:
        raise ConfigError(
            f"run.output_dir: cannot write the run directory {run_dir} ({exc.strerror or exc}); "
            "choose a writable directory with free space"
        ) from None
    root = no_link(run_dir / CHECKPOINTS)  # what a save left there is removed: never through a link
    if root.is_dir():
        for stale in ckpt.clean_stale(root):
            log(f"removed {stale.name}, left by a save that was interrupted")
    if plan.resume_from is not None:
        repair_trajectories(run_dir / TRAJECTORIES, checkpoint_step(plan.resume_from), log)
    return run_dir


def checkpoint_step(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def _step_files(directory: Path) -> list[tuple[int, Path]]:
    """(step, file) of each per-step trajectory file, in step order."""
    found = [(re.fullmatch(r"step_(\d+)\.parquet", f.name), f) for f in directory.glob("step_*.parquet")]
    return sorted((int(m.group(1)), f) for m, f in found if m is not None)


def _redo_unreadable(run_dir: Path, found: Path, log: Callable[[str], None]) -> Path:
    """A trajectory file of a step up to the checkpoint's that cannot be read: resume from an
    earlier checkpoint before it, if one verifies, so that step runs again (exactly: seeds are
    keyed by task, not by time) and writes its file anew."""
    step = checkpoint_step(found)
    bad = [s for s, f in _step_files(run_dir / TRAJECTORIES) if s <= step and readable_parquet(f)]
    earlier = [
        c
        for c in ckpt.complete_checkpoints(run_dir / CHECKPOINTS)
        if bad and checkpoint_step(c) < bad[0] and ckpt.verify(c) is None
    ]
    if not earlier:
        return found  # nothing to redo, or no way to: make_run_dir moves the file aside
    log(
        f"WARNING: the trajectories of step {bad[0]} cannot be read; resuming from {earlier[-1]} "
        f"instead of {found.name}, so that step runs again and writes them anew"
    )
    return earlier[-1]


def repair_trajectories(directory: Path, step: int, log: Callable[[str], None]) -> None:
    """A resume from checkpoint `step`: the files of later steps go (those steps are run again
    and write them anew); a file of an earlier step that cannot be read (truncated, corrupt) is
    moved aside, so `read_trajectories` reads the rest, with a warning naming it. A link in
    place of `directory` is refused: nothing is removed or moved through it."""
    for file_step, f in _step_files(no_link(directory)):
        if file_step > step:
            f.unlink()
        elif (problem := readable_parquet(f)) is not None:
            aside = f.with_name(f.name + ".unreadable")
            f.replace(aside)
            log(
                f"WARNING: {f} cannot be read ({problem}); moved to {aside.name}: the trajectories "
                f"of that step are lost (the checkpoint, step {step}, is past it)"
            )


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out |= _flat(v, f"{prefix}{k}.")
        return out
    return {prefix[:-1]: d}


def check_config_change(cfg: Config, checkpoint: Path) -> None:
    """CKPT-06: resuming under a different config is refused unless allowed, naming the keys."""
    saved = checkpoint / "config.yaml"
    before = _flat(load_yaml_bounded(saved.read_text(), str(saved)))
    now = _flat(yaml.safe_load(dump_config(cfg)))
    # a key the checkpoint's config lacks and that holds its default now is a setting steprl
    # gained since that checkpoint: the run trains as it did, so it is not a change
    default = _flat(yaml.safe_load(dump_config(Config())))
    changed = sorted(
        k
        for k in before.keys() | now.keys()
        if before.get(k) != now.get(k) and not (k not in before and k in default and now[k] == default[k])
    )
    changed = [k for k in changed if k not in RESUMABLE_CHANGES]
    if changed and not cfg.run.allow_config_change:
        shown = ", ".join(f"{k} ({before.get(k)!r} -> {now.get(k)!r})" for k in changed[:6])
        raise ConfigError(
            f"--resume: the config differs from the checkpoint's ({checkpoint}): {shown}; "
            "resume with the same config, or set run.allow_config_change=true"
        )


#: state.pt's layout: every stateful part by name (what `torch.distributed.checkpoint` writes
#: in one place when the learner is sharded); 1 was the learner's keys at the top level
STATE_FORMAT = 2


def checkpoint_state(parts: Parts, state: TrainState) -> dict[str, Any]:
    """What state.pt holds besides the HF-format policy (which `steprl eval` reads): every
    stateful part of the run by name (the learner: optimizer, value head, adapters; the critic;
    each run component, engine snapshots among them) and where the run stands."""
    critic = parts.critic.state_dict() if parts.critic is not None else None
    return {
        "format": STATE_FORMAT,
        "learner": parts.learner.state_dict(),
        "critic": critic or None,  # a shared critic's head is the learner's
        "components": component_states(parts.components),  # the task source, ...: by name
        "train_state": state.to_dict(),
    }


def restore(parts: Parts, path: Path) -> TrainState:
    """Load a verified checkpoint into the built parts; the engines get its weights."""
    saved = ckpt.load_state(path)
    if "components" not in saved:  # written before run components (issue 24): not continued
        raise ConfigError(
            f"{path}: this checkpoint was written by a steprl from before run components, which "
            "kept the KL coefficient and guard streaks elsewhere; resume it with that version, or "
            "start the run afresh with run.overwrite=true"
        )
    if saved.get("format", 1) > STATE_FORMAT:
        raise ConfigError(
            f"{path}: written by a newer steprl (state format {saved['format']}, this one reads up to "
            f"{STATE_FORMAT}); resume it with that version"
        )
    learner = saved["learner"] if "learner" in saved else {k: saved[k] for k in LEARNER_KEYS_V1}
    parts.learner.load_state_dict(learner, path)
    if saved["critic"] is not None and parts.critic is not None:
        parts.critic.load_state_dict(saved["critic"])
    state = TrainState.from_dict(saved["train_state"])
    load_component_states(parts.components, saved["components"])
    parts.push_weights(state.policy_version)
    return state


#: format 1 kept the learner's state at the top level (checkpoints before the Learner protocol)
LEARNER_KEYS_V1 = ("optimizer", "value_head", "adapters")


def latest_checkpoint(run_dir: Path) -> Path | None:
    return ckpt.latest_complete(run_dir / CHECKPOINTS)


def save(parts: Parts, state: TrainState, run_dir: Path, cfg: Config, *, keep_all: bool = False) -> Path:
    """Checkpoint `state`; `trainer.keep_last` older ones are kept, or (`keep_all`: a stop's
    save) every one, so the last good checkpoint before a stop stays beside it."""
    return ckpt.save_checkpoint(
        run_dir / CHECKPOINTS,
        state.step,
        write_model=parts.learner.save_model,
        tokenizer=parts.policy.tokenizer,
        state=checkpoint_state(parts, state),
        config_yaml=dump_config(cfg),
        keep_last=cfg.trainer.keep_last + 1 if keep_all else cfg.trainer.keep_last,
    )
