"""Where metrics and trajectories go: JSONL and TensorBoard sinks, and a Parquet trajectory file.

A sink takes the flat dicts that `steprl.diagnostics.metrics` produces; it never computes
anything. JSONL is the source of truth (plots and reports read it back); TensorBoard is for
watching a run live. Trajectories go to one Parquet file per training step (`trajectories/
step_000012.parquet`, one row per trajectory), each complete the moment it appears, holding the
exact token ids (not re-tokenized text), so the viewer and offline analysis see what the
learner saw. `read_trajectories(run_dir / "trajectories")` reads them back as one table (a file
that cannot be read is skipped, with a warning naming it).

A write the disk refuses (full, I/O error) is an `OutputWriteError`: one line saying what was
not written and how much space is left. The trainer writes a step's trajectories before its
metrics row and stops there, so a row never stands for trajectories that were lost.

Every writer of a run directory opens its files with `open_output` and checks its directories
with `no_link`: a symlink planted there (pointing anywhere) is refused with one line, never
written through (`OutputLinkError`).
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Protocol, Self, runtime_checkable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from steprl.diagnostics import episode_samples
from steprl.diagnostics.episode_samples import Decode, StepAdvantages
from steprl.errors import RunAborted, UserError
from steprl.types import Trajectory


class OutputWriteError(RunAborted):
    """Metrics or trajectories could not be written (disk full, I/O error); what was written
    before is complete and readable."""


class OutputLinkError(OutputWriteError, UserError):
    """A file or directory a run writes is a symbolic link: refused, never written through (a
    link planted in a run directory could point at anything of the user's)."""


def no_link(path: Path) -> Path:
    """`path`, unless it is a symbolic link (`OutputLinkError`, one line naming it)."""
    if path.is_symlink():
        raise OutputLinkError(
            f"{path} is a symbolic link (to {os.readlink(path)}); steprl never writes a run's files "
            f"through a link: remove the link (rm {path}) and run again"
        )
    return path


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)


def open_output(path: Path, mode: str = "w") -> IO[Any]:
    """`open(path, mode)` for writing ("w", "a", "wb", "ab") that never follows a link at
    `path` (O_NOFOLLOW: no window between a check and the open); one there is an
    `OutputLinkError`. Its directory is the caller's to check (`no_link`) where it is not the
    run directory itself, which a user may link elsewhere on purpose."""
    try:
        return open(path, mode, encoding=None if "b" in mode else "utf-8", opener=_no_follow)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            no_link(path)
        raise


def write_failed(what: str, path: Path, exc: OSError) -> OutputWriteError:
    """The one line for a write the disk refused."""
    where = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    try:
        free = f"{shutil.disk_usage(where).free // 2**20} MiB free under {where}"
    except OSError:
        free = f"{where} unreadable"
    reason = exc.strerror or str(exc) or type(exc).__name__
    code = f"[Errno {exc.errno}] " if exc.errno else ""
    hint = "free space or move run.output_dir" if exc.errno == errno.ENOSPC else "check the disk"
    return OutputWriteError(f"writing {what} to {path} failed: {code}{reason} ({free}); {hint}")


@runtime_checkable
class MetricsSink(Protocol):
    """Receives one flat metrics dict per training step."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class _ClosingContext:
    """`with sink:` closes it; shared by the sinks below."""

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _json_value(value: float) -> float | None:
    """NaN and +-inf are not JSON; write them as null so any JSON reader can load the file."""
    f = float(value)
    return f if math.isfinite(f) else None


class JsonlSink(_ClosingContext):
    """One JSON object per line, `{"step": n, **metrics}`, flushed after every line.

    Opens in append mode so a resumed run continues the same file. Flushing each line means a
    crash loses at most the line being written, and `tail -f` shows progress live.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open_output(self.path, "a")
        self._failed = False

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if "step" in metrics:
            raise ValueError(
                "A metric is named 'step', which the JSONL line uses for the training step; "
                "rename the metric (e.g. 'trainer/step')."
            )
        row: dict[str, Any] = {"step": int(step)}
        row.update({key: _json_value(value) for key, value in metrics.items()})
        try:
            self._file.write(json.dumps(row, allow_nan=False) + "\n")
            self._file.flush()
        except OSError as exc:
            self._failed = True
            raise write_failed(f"the metrics of step {step}", self.path, exc) from exc

    def close(self) -> None:
        try:
            self._file.close()  # flushes what a refused write left buffered: it fails again
        except OSError:
            if not self._failed:
                raise


def read_metrics_jsonl(
    path: str | Path, skip_bad: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    """Read back what `JsonlSink` wrote: one dict per line, nulls as `None`.

    A last line without its newline (the run was killed mid-write) is skipped; any other line
    that is not a UTF-8 JSON object raises, naming the line, or with `skip_bad` is skipped and
    reported to it (a resume keeps going past a damaged line).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"No metrics file at {path}; a run writes it as <run_dir>/metrics.jsonl.")
    lines = path.read_bytes().split(b"\n")
    rows: list[dict[str, Any]] = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            if i == len(lines):  # the unterminated last line of an interrupted write
                continue
            problem = f"{path}:{i} is not a JSON object ({e})"
            if skip_bad is None:
                raise ValueError(f"{problem}; fix or delete that line.") from e
            skip_bad(f"{problem}; line dropped")
            continue
        if not isinstance(row, dict) or not isinstance(row.get("step", 0), int):
            problem = f"{path}:{i} is not a metrics row ({type(row).__name__}, no integer step)"
            if skip_bad is None:
                raise ValueError(f"{problem}; fix or delete it.")
            skip_bad(f"{problem}; line dropped")
            continue
        rows.append(row)
    return rows


def truncate_metrics(path: str | Path, last_step: int, warn: Callable[[str], None] = print) -> int:
    """Keep the rows of steps `<= last_step` (a resume redoes the steps after its checkpoint;
    their old rows would be duplicates) and drop lines that cannot be read, telling `warn`.
    Atomic: the file is the old or the new one. Returns the number of rows dropped."""
    path = no_link(Path(path))
    if not path.exists():
        return 0
    rows = read_metrics_jsonl(path, skip_bad=lambda problem: warn(f"WARNING: {problem}"))
    kept = [r for r in rows if int(r.get("step", 0)) <= last_step]
    tmp = path.with_name(path.name + ".tmp")
    with open_output(tmp, "w") as f:
        f.write("".join(json.dumps(r, allow_nan=False) + "\n" for r in kept))
    os.replace(tmp, path)
    return len(rows) - len(kept)


class _QuietTensorBoardThread:
    """`threading.excepthook` without a traceback for TensorBoard's writer thread's OSError (a
    full disk): tensorboard keeps the error for the foreground, whose next write or flush raises
    it (`TensorBoardSink`: one line), and re-raises it in the thread too, whose traceback the
    default hook printed before that line. Other threads' errors go to the hook it replaced."""

    def __init__(self, previous: Callable[[threading.ExceptHookArgs], Any]) -> None:
        self.previous = previous

    def __call__(self, args: threading.ExceptHookArgs) -> None:
        if not (
            type(args.thread).__module__.startswith("tensorboard.") and isinstance(args.exc_value, OSError)
        ):
            self.previous(args)


class TensorBoardSink(_ClosingContext):
    """One TensorBoard scalar per metric key (the slash prefix becomes the chart group); with
    `log_episodes`, histograms of each step's outcome rewards and token advantages, and every
    `text_every` steps `text_episodes` sample episodes as text (with `decode`, ids -> text).

    `torch.utils.tensorboard` is imported here, not at module import, because it pulls in the
    whole tensorboard package; code that only needs JSONL should not pay for it.
    """

    def __init__(
        self,
        logdir: str | Path,
        purge_step: int | None = None,
        *,
        decode: Decode | None = None,
        text_every: int = 10,
        text_episodes: int = 4,
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = Path(logdir)
        # purge_step (a resume): TensorBoard hides the events at and after it that an earlier
        # process wrote, so a redone step is shown once
        self._writer = SummaryWriter(log_dir=str(self.logdir), purge_step=purge_step)
        if not isinstance(threading.excepthook, _QuietTensorBoardThread):
            threading.excepthook = _QuietTensorBoardThread(threading.excepthook)
        self.decode, self.text_every, self.text_episodes = decode, text_every, text_episodes
        self._failed = False

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        try:
            for key, value in metrics.items():
                self._writer.add_scalar(key, float(value), global_step=int(step))
            self._writer.flush()  # otherwise up to 2 minutes late in the TensorBoard UI
        except OSError as exc:
            self._failed = True
            raise write_failed(f"the TensorBoard events of step {step}", self.logdir, exc) from exc

    def log_episodes(
        self, step: int, trajectories: Sequence[Trajectory], advantages: StepAdvantages | None = None
    ) -> None:
        """Histograms (the distribution a mean hides: a bimodal reward, advantages all near 0)
        and, when due, sample episodes; flushed with the step's scalars by `log`."""
        rewards = [t.outcome_reward for t in trajectories]
        advs = episode_samples.flat_advantages(advantages)
        try:
            if rewards:
                self._writer.add_histogram("histograms/outcome_reward", np.asarray(rewards), int(step))
            if advs:
                self._writer.add_histogram("histograms/advantage", np.asarray(advs), int(step))
            if self.decode is not None and episode_samples.due(step, self.text_every):
                for i, t in enumerate(episode_samples.pick(trajectories, self.text_episodes)):
                    text = episode_samples.as_markdown(step, t, self.decode)
                    self._writer.add_text(f"episodes/sample_{i}", text, int(step))
        except OSError as exc:
            self._failed = True
            raise write_failed(f"the TensorBoard episodes of step {step}", self.logdir, exc) from exc

    def close(self) -> None:
        try:
            self._writer.close()
        except OSError as exc:
            if not self._failed:  # else: said already, by `log`
                raise write_failed("the TensorBoard events", self.logdir, exc) from exc


class MultiSink(_ClosingContext):
    """Fans one `log` out to several sinks; `close` closes every one even if one fails."""

    def __init__(self, sinks: Sequence[MetricsSink]) -> None:
        self.sinks = tuple(sinks)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        first_error: BaseException | None = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # keep closing the rest, then report the first failure
                first_error = first_error or e
        if first_error is not None:
            raise first_error


# ---------------------------------------------------------------- trajectories -> Parquet

_IDS = pa.list_(pa.int32())

#: One row per trajectory. Per-step columns are lists with one entry per step, in step order.
#: Only the first step's prompt is stored: with an append-only context every later prompt is
#: that prompt plus the earlier actions and observations.
TRAJECTORY_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),  # training step at which the trajectory was logged
        ("task_id", pa.string()),
        ("group_id", pa.string()),
        ("env", pa.string()),
        ("end", pa.string()),  # EndReason value
        ("outcome_reward", pa.float64()),
        ("num_steps", pa.int32()),
        ("prompt_ids", _IDS),  # first step's prompt
        ("action_ids", pa.list_(_IDS)),
        ("action_logprobs", pa.list_(pa.list_(pa.float32()))),
        ("observation_ids", pa.list_(_IDS)),
        ("rewards", pa.list_(pa.float64())),  # per-step rewards
        ("policy_versions", pa.list_(pa.int64())),  # per step: the version when it started
        ("token_versions", pa.list_(pa.list_(pa.int64()))),  # per step, per action token
        ("info_json", pa.string()),  # Trajectory.info as JSON (non-JSON values via str)
        ("step_info_json", pa.list_(pa.string())),  # each Step.info as JSON
        # per step, per action token: the advantage the learner trained that token with; null
        # for an episode not trained on (filtered out, failed in the env, a held-out episode)
        ("advantages", pa.list_(pa.list_(pa.float32()))),
        # per step: the learned step reward (algorithm.step_reward) it was scored with; null
        # without a step-reward model and for an episode it did not score
        ("step_credit", pa.list_(pa.float64())),
    ]
)
TEXT_FIELDS = [
    ("prompt_text", pa.string()),
    ("action_texts", pa.list_(pa.string())),
    ("observation_texts", pa.list_(pa.string())),
]


def _to_json(info: Mapping[str, Any]) -> str:
    return json.dumps(dict(info), default=str, sort_keys=True)


def trajectory_row(
    trajectory: Trajectory,
    step: int = 0,
    advantages: Sequence[Sequence[float]] | None = None,
    decode: Callable[[Sequence[int]], str] | None = None,
    step_credit: Sequence[float] | None = None,
) -> dict[str, Any]:
    """A `Trajectory` as the row `TrajectoryWriter` writes for it (column -> value); with
    `decode`, the text columns too."""
    steps = trajectory.steps
    row: dict[str, Any] = {
        "step": int(step),
        "task_id": trajectory.task_id,
        "group_id": trajectory.group_id,
        "env": trajectory.env,
        "end": str(trajectory.end),  # StrEnum: str() is the value
        "outcome_reward": float(trajectory.outcome_reward),
        "num_steps": len(steps),
        "prompt_ids": list(steps[0].prompt_ids) if steps else [],  # the first step's prompt
        "action_ids": [list(s.action_ids) for s in steps],
        "action_logprobs": [list(s.action_logprobs) for s in steps],
        "observation_ids": [list(s.observation_ids) for s in steps],
        "rewards": [float(s.reward) for s in steps],
        "policy_versions": [int(s.policy_version) for s in steps],
        "token_versions": [list(s.token_versions) for s in steps],
        "info_json": _to_json(trajectory.info),
        "step_info_json": [_to_json(s.info) for s in steps],
        "advantages": None if advantages is None else [[float(a) for a in turn] for turn in advantages],
        "step_credit": None if step_credit is None else [float(r) for r in step_credit],
    }
    if decode is not None:
        row["prompt_text"] = decode(row["prompt_ids"])
        row["action_texts"] = [decode(s.action_ids) for s in steps]
        row["observation_texts"] = [decode(s.observation_ids) for s in steps]
    return row


class TrajectoryWriter(_ClosingContext):
    """Writes each step's trajectories to `<directory>/step_NNNNNN.parquet`.

    Each file is written under a temporary name and renamed when complete, so a kill at any
    moment (SIGKILL included) leaves every finished step readable and no half file; a resumed
    run rewrites the files of the steps it redoes. With `decode` (token ids -> text, e.g.
    `tokenizer.decode`), the text columns `prompt_text`, `action_texts` and `observation_texts`
    are added for human reading; the ids stay the truth. Log-probs are stored as float32 (what
    engines return); ids round-trip exactly.
    """

    def __init__(self, directory: str | Path, decode: Callable[[Sequence[int]], str] | None = None) -> None:
        self.path = no_link(Path(directory))
        self.path.mkdir(parents=True, exist_ok=True)
        for stale in self.path.glob(".*.tmp"):  # a write that a kill interrupted
            stale.unlink(missing_ok=True)
        self.decode = decode
        schema = TRAJECTORY_SCHEMA
        if decode is not None:
            for name, typ in TEXT_FIELDS:
                schema = schema.append(pa.field(name, typ))
        self.schema = schema
        self._closed = False

    def write(
        self,
        step: int,
        trajectories: Sequence[Trajectory],
        advantages: Sequence[Sequence[Sequence[float]] | None] | None = None,
        step_credit: Sequence[Sequence[float] | None] | None = None,
    ) -> None:
        """Write `step`'s file. `advantages`, parallel to `trajectories`: each one's advantages
        per step and action token (None: not trained on); `step_credit`, parallel too: each
        one's learned step rewards per step (None: not scored)."""
        for what, given in (("advantage", advantages), ("step credit", step_credit)):
            if given is not None and len(given) != len(trajectories):
                raise ValueError(f"{len(given)} {what} lists for {len(trajectories)} trajectories")
        if self._closed:
            raise RuntimeError(f"TrajectoryWriter({self.path}) is closed; open a new one to write more.")
        columns: dict[str, list[Any]] = {name: [] for name in self.schema.names}
        for k, t in enumerate(trajectories):
            row = trajectory_row(
                t,
                step,
                advantages[k] if advantages is not None else None,
                self.decode,
                step_credit[k] if step_credit is not None else None,
            )
            for name in self.schema.names:
                columns[name].append(row[name])
        final = self.path / f"step_{int(step):06d}.parquet"
        tmp = self.path / f".{final.name}.tmp"
        table = pa.Table.from_pydict(columns, schema=self.schema)
        try:
            with open_output(tmp, "wb") as f:
                pq.write_table(table, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except OSError as exc:  # the disk refused: no half file, the earlier steps' files intact
            tmp.unlink(missing_ok=True)
            raise write_failed(f"the trajectories of step {step}", final, exc) from exc

    def close(self) -> None:
        self._closed = True


def readable_parquet(path: Path) -> str | None:
    """None if `path` has a Parquet footer, else why not (a truncated file has none). Reads the
    footer only: cheap for every step file of a long run."""
    try:
        pq.read_metadata(str(path))
    except (OSError, pa.ArrowException) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def read_trajectories(path: str | Path) -> pa.Table:
    """Load what `TrajectoryWriter` wrote: a run's `trajectories/` directory (every step file,
    in step order, as one table; a file that cannot be read is skipped with a warning naming
    it) or a single step file. For intact files the same as
    `pyarrow.dataset.dataset(path, format="parquet").to_table()` (or `pandas.read_parquet`)."""
    path = Path(path)
    if path.is_dir():
        tables = []
        for f in sorted(path.glob("step_*.parquet")):
            try:
                tables.append(pq.read_table(str(f)))
            except (OSError, pa.ArrowException) as exc:  # one damaged file, not the whole run
                warnings.warn(f"{f}: cannot be read ({exc}); skipped", stacklevel=2)
        if not tables:
            return TRAJECTORY_SCHEMA.empty_table()
        return pa.concat_tables(tables, promote_options="default")
    if not path.exists():
        raise FileNotFoundError(
            f"No trajectory file at {path}; a run writes one per step under <run_dir>/trajectories/."
        )
    return pq.read_table(str(path))
