"""What every probe of the fault battery shares: the outcomes, the probe and result records, and
`Ctx`, which runs the real `steprl` command (or a server it starts) in a fresh temp directory
under a wall-clock deadline and a memory cap, and measures its peak memory.

A process is started in a session of its own, so that a deadline or the memory cap kills it with
everything it started (env servers, workers) and nothing else. Memory is bounded twice: an
address-space limit (`prlimit --as`), so an allocation past it fails inside the process, and the
resident memory of its whole tree, polled every 0.1 s, past which the tree is killed (RSS is what
the machine actually loses; a process may reserve address space it never touches).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STEPRL = str(Path(sys.executable).parent / "steprl")
TINY_CONFIG = ROOT / "configs" / "calculator_tiny.yaml"
MIB = 1 << 20

#: the smallest run the CLI trains (as tests/cli_runs.py: TINY_SCRATCH): a one-layer tiny model
#: from scratch, 2 tasks x 2 episodes of at most 2 turns, no evaluation between steps
TINY = (
    "model.tiny.hidden_size=32",
    "model.tiny.num_layers=1",
    "model.tiny.num_heads=2",
    "model.tiny.intermediate_size=64",
    "model.init=scratch",
    "rollout.max_turns=2",
    "rollout.max_tokens_per_turn=8",
    "rollout.tasks_per_step=2",
    "rollout.group_size=2",
    "trainer.eval_tasks=2",
    "trainer.eval_every=0",
    "trainer.total_steps=2",
    "logging.progress=false",
    "logging.tensorboard=false",
)


class Outcome(StrEnum):
    HOLDS = "holds"
    ESCAPED = "ran code outside the sandbox"
    HUNG = "hung past its deadline"
    MEMORY = "exhausted memory"
    DELETED = "deleted a finished run"
    TRACEBACK = "traceback"
    OTHER = "other defect"


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    detail: str = ""  # what was seen: the deciding line, a status, a size


def holds(detail: str = "") -> Verdict:
    return Verdict(Outcome.HOLDS, detail)


def defect(detail: str) -> Verdict:
    return Verdict(Outcome.OTHER, detail)


@dataclass(frozen=True)
class Probe:
    surface: str
    name: str
    item: str  # the item of issue 44 it checks ("" for a regression guard)
    run: Callable[[Ctx], Verdict]


@dataclass(frozen=True)
class Result:
    surface: str
    name: str
    item: str
    outcome: str
    detail: str
    seconds: float
    peak_mb: float


@dataclass
class Run:
    """One finished (or killed) command: its exit code and output, and how it ended."""

    rc: int | None
    out: str
    seconds: float
    timed_out: bool = False
    mem_killed: bool = False
    peak_mb: float = 0.0

    def last_line(self) -> str:
        lines = [s for s in self.out.strip().splitlines() if s.strip()]
        return lines[-1][:300] if lines else f"(no output, exit {self.rc})"


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and every process below it (0 once it is gone)."""
    try:
        import psutil

        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        total = 0
        for p in procs:
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
        return total
    except ImportError:  # /proc: the processes of the session `pid` leads
        return _session_rss(pid)


def _session_rss(sid: int) -> int:
    total, page = 0, os.sysconf("SC_PAGE_SIZE")
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (d / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[3]) == sid:  # field 6 of stat: the session id
                total += int((d / "statm").read_text().split()[1]) * page
    return total


class Proc:
    """A process started by `Ctx.start`: output to a file, watched for memory until it ends."""

    def __init__(self, popen: subprocess.Popen[bytes], log: Path, mem_cap: int, started: float) -> None:
        self.popen, self.log, self.mem_cap, self.started = popen, log, mem_cap, started
        self.peak = 0
        self.mem_killed = False
        self._watch = threading.Thread(target=self._poll, daemon=True)
        self._watch.start()

    def _poll(self) -> None:
        while self.popen.poll() is None:
            rss = tree_rss(self.popen.pid)
            self.peak = max(self.peak, rss)
            if rss > self.mem_cap:
                self.mem_killed = True
                self.kill()
                return
            time.sleep(0.1)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.popen.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole session this process leads (what it started with it)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)

    def wait(self, timeout: float) -> Run:
        """Wait up to `timeout` s; past it the tree is killed and the run marked timed out."""
        timed_out = False
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        self.kill()  # also what a finished command left behind (a server it forgot to stop)
        self.popen.wait()
        self._watch.join(1)
        rc = None if timed_out or self.mem_killed else self.popen.returncode
        return Run(
            rc, self.output(), time.monotonic() - self.started, timed_out, self.mem_killed, self.peak / MIB
        )

    def wait_for(self, needle: str, timeout: float) -> bool:
        """Until `needle` is in the output (True), the process ends or `timeout` passes (False)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if needle in self.output():
                return True
            if self.popen.poll() is not None:
                return needle in self.output()
            time.sleep(0.1)
        return False


@dataclass
class Ctx:
    """One probe's world: a fresh temp directory, the processes it started, their peak memory."""

    tmp: Path
    mem_cap_mb: int = 3072
    address_space_mb: int = 12288
    procs: list[Proc] = field(default_factory=list)
    #: what probes reuse: "root" (a directory that outlives them), a finished run, a server;
    #: "closers": what stops the shared servers when the battery ends
    shared: dict[str, Any] = field(default_factory=dict)
    watched: list[Proc] = field(default_factory=list)  # a shared server this probe used
    src: Path | None = None  # steprl's sources to run instead of the installed ones (--src)

    @property
    def marker(self) -> Path:
        """The file a payload writes on the host if it escapes: it must never exist."""
        return self.tmp / "ESCAPED"

    @property
    def peak_mb(self) -> float:
        return max((p.peak for p in [*self.procs, *self.watched]), default=0) / MIB

    def start(
        self,
        args: Sequence[str],
        *,
        program: Sequence[str] = (STEPRL,),
        env: Mapping[str, str | None] | None = None,
        cwd: Path | None = None,
        plugin_path: Sequence[Path] = (),
        mem_cap_mb: int | None = None,
    ) -> Proc:
        """`steprl *args` (or `program *args`) started in a session of its own, in `cwd` (default:
        the temp directory), `plugin_path` on PYTHONPATH (envs loaded with --plugin)."""
        environ = {**os.environ, "COLUMNS": "400", "HOME": str(self.tmp / "home")}
        for k, v in (env or {}).items():
            if v is None:  # unset (W&B reads an empty variable as a value)
                environ.pop(k, None)
            else:
                environ[k] = v
        environ.setdefault("STEPRL_CACHE", str(self.tmp / "cache"))
        path = [*([self.src] if self.src else []), *plugin_path]
        if path:  # ahead of the editable install's .pth entry: --src wins, plugins import
            environ["PYTHONPATH"] = os.pathsep.join(str(p) for p in path)
        (self.tmp / "home").mkdir(exist_ok=True)
        log = self.tmp / f"out-{len(self.procs)}.log"
        limit = ["prlimit", f"--as={self.address_space_mb * MIB}", "--"] if shutil.which("prlimit") else []
        with log.open("wb") as sink:
            popen = subprocess.Popen(
                [*limit, *program, *args],
                cwd=cwd or self.tmp,
                env=environ,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = Proc(popen, log, (mem_cap_mb or self.mem_cap_mb) * MIB, time.monotonic())
        self.procs.append(proc)
        return proc

    def steprl(self, args: Sequence[str], *, deadline: float = 120, **kw: object) -> Run:
        """`steprl *args` to its end, or killed at `deadline` s or at the memory cap."""
        return self.start(args, **kw).wait(deadline)  # type: ignore[arg-type]

    def train(
        self,
        sets: Sequence[str],
        *,
        config: Path = TINY_CONFIG,
        deadline: float = 180,
        extra_args: Sequence[str] = (),
        **kw: object,
    ) -> Run:
        """`steprl train CONFIG` at the tiny shape, writing under the temp directory; `sets`
        after the shape (so they win), `extra_args` (a --plugin) after those."""
        shape = [*TINY, f"run.output_dir={self.tmp / 'runs'}", *sets]
        return self.steprl(["train", str(config), *_sets(shape), *extra_args], deadline=deadline, **kw)

    def close(self) -> None:
        for p in self.procs:
            p.kill()


def _sets(settings: Sequence[str]) -> list[str]:
    return [x for s in settings for x in ("--set", s)]


def sets(settings: Sequence[str]) -> list[str]:
    """`--set a --set b ...` for `steprl`'s command line."""
    return _sets(settings)


def judge(run: Run, ok_codes: Sequence[int] = (2,), *, why: str = "") -> Verdict:
    """The usual verdict on a command that should refuse in one line (`ok_codes`): a deadline or
    the memory cap first, then a traceback, then the exit code."""
    if run.timed_out:
        return Verdict(Outcome.HUNG, f"killed after {run.seconds:.0f} s; last: {run.last_line()}")
    if run.mem_killed or "MemoryError" in run.out:
        return Verdict(Outcome.MEMORY, f"{run.peak_mb:.0f} MB resident; last: {run.last_line()}")
    if "Traceback (most recent call last)" in run.out:
        return Verdict(Outcome.TRACEBACK, run.last_line())
    if run.rc in ok_codes:
        return holds(f"exit {run.rc}: {run.last_line()}")
    return defect(f"{why}exit {run.rc}: {run.last_line()}")


@contextlib.contextmanager
def probe_dir(keep: bool) -> Iterator[Path]:
    """A fresh temp directory for one probe, removed after it unless `keep`."""
    path = Path(tempfile.mkdtemp(prefix="steprl-fault-"))
    try:
        yield path
    finally:
        if not keep:
            _unmount_below(path)
            shutil.rmtree(path, ignore_errors=True)


def _unmount_below(path: Path) -> None:
    """Unmount what a probe mounted under its temp dir (a small tmpfs), before it is removed."""
    for line in Path("/proc/mounts").read_text().splitlines():
        where = line.split()[1]
        if where.startswith(str(path)):
            subprocess.run(["umount", "-l", where], check=False, capture_output=True)


def snapshot(run_dir: Path) -> dict[str, int]:
    """Relative path -> size of every file under `run_dir`: what a finished run holds."""
    return {str(p.relative_to(run_dir)): p.stat().st_size for p in sorted(run_dir.rglob("*")) if p.is_file()}


def lost_files(before: Mapping[str, int], run_dir: Path) -> list[str]:
    """The files of `before` that are gone from `run_dir` (or changed size)."""
    now = snapshot(run_dir) if run_dir.is_dir() else {}
    return [k for k, size in before.items() if now.get(k) != size]
