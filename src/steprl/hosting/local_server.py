"""`LocalEnvServer`: a `steprl serve-env` subprocess on a free loopback port, for one run or test.

    with LocalEnvServer(plugins=["my_envs"]) as server:     # waits for /healthz
        backend = HttpEnvBackend(server.url, server.token, "calculator")
        ...
        server.kill(); server.restart()                     # same port and token

The token is generated here and handed to the child in its environment (STEPRL_ENV_TOKEN),
never on the command line (argv is world-readable in /proc). The child runs
`python -m steprl.hosting` (the `serve-env` command without the trainer's imports) and exits
by itself if this process dies (it watches its parent). With `auto_restart=True` a monitor
thread restarts the server whenever it exits on its own (crash, OOM kill, request recycling):
the supervisor of reliability ENV-01 / HTTP-10. Logs go to `log_path`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from steprl.hosting.protocol import PARENT_VAR, TOKEN_VAR


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the child binds it; a lost race is retried)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


class LocalEnvServer:
    """A loopback env server in a subprocess. `start()` returns once /healthz answers."""

    def __init__(
        self,
        *,
        port: int | None = None,
        token: str | None = None,
        plugins: Sequence[str] = (),
        max_instances: int = 256,
        idle_ttl_s: float = 600.0,
        handler_timeout_s: float = 30.0,
        max_body_bytes: int = 1 << 20,
        keep_alive_s: int = 5,
        header_timeout_s: float = 10.0,
        body_timeout_s: float = 30.0,
        graceful_shutdown_s: int = 10,
        limit_max_requests: int | None = None,
        max_threads: int | None = None,
        allow_import_paths: bool = False,
        extra_env: Mapping[str, str] | None = None,
        startup_timeout_s: float = 60.0,
        auto_restart: bool = False,
        log_path: Path | None = None,
    ) -> None:
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self._fixed_port = port is not None
        self.token = token or secrets.token_urlsafe(32)
        self.plugins = tuple(plugins)
        self.startup_timeout_s = startup_timeout_s
        self.auto_restart = auto_restart
        self.restarts = 0  # restarts by the monitor (auto_restart) or by restart()
        self._options = [
            "--max-instances",
            str(max_instances),
            "--idle-ttl",
            str(idle_ttl_s),
            "--handler-timeout",
            str(handler_timeout_s),
            "--max-body-bytes",
            str(max_body_bytes),
            "--keep-alive",
            str(keep_alive_s),
            "--header-timeout",
            str(header_timeout_s),
            "--body-timeout",
            str(body_timeout_s),
            "--graceful-shutdown",
            str(graceful_shutdown_s),
            *(["--limit-max-requests", str(limit_max_requests)] if limit_max_requests else []),
            *(["--max-threads", str(max_threads)] if max_threads else []),
            *(["--allow-import-paths"] if allow_import_paths else []),
            *(arg for module in self.plugins for arg in ("--plugin", module)),
        ]
        self._extra_env = dict(extra_env or {})
        self._owns_log = log_path is None
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="steprl-env-server-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.RLock()
        self._stopping = False
        self._monitor: threading.Thread | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __repr__(self) -> str:  # never shows the token
        return f"LocalEnvServer({self.url}, pid={self.pid})"

    def __enter__(self) -> LocalEnvServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> LocalEnvServer:
        """Start the server (a lost race for the port picks another one, unless it was fixed).
        A no-op when it is already running (so `with LocalEnvServer(...).start()` is fine)."""
        with self._lock:
            if self.running:
                return self
            self._stopping = False
            for attempt in range(3):
                try:
                    self._spawn()
                    break
                except RuntimeError:
                    if self._fixed_port or attempt == 2:
                        raise
                    self.port = free_port()
            if self.auto_restart and self._monitor is None:
                self._monitor = threading.Thread(
                    target=self._watch, name="steprl-env-server-monitor", daemon=True
                )
                self._monitor.start()
        return self

    def _spawn(self) -> None:
        env = {**os.environ, **self._extra_env, TOKEN_VAR: self.token, PARENT_VAR: str(os.getpid())}
        argv = [
            sys.executable,
            "-m",
            "steprl.hosting",
            "--host",
            self.host,
            "--port",
            str(self.port),
            *self._options,
        ]
        with open(self.log_path, "ab") as log:
            proc = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        self._proc = proc
        if self._finalizer is not None:
            self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _kill, proc)  # never outlive this process's objects
        self._wait_healthy(proc)

    def _wait_healthy(self, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=1.0, trust_env=False) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"the env server exited with code {proc.returncode} while starting; "
                        f"its log ({self.log_path}) ends with:\n{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/healthz").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    _kill(proc)
                    raise RuntimeError(
                        f"the env server did not answer /healthz within {self.startup_timeout_s:g}s; "
                        f"see its log {self.log_path}"
                    )
                time.sleep(0.05)

    def _watch(self) -> None:
        while True:
            time.sleep(0.1)
            with self._lock:
                if self._stopping:
                    return
                if self._proc is not None and self._proc.poll() is not None:
                    self.restarts += 1
                    with contextlib.suppress(RuntimeError):  # tried again on the next tick
                        self._spawn()

    def healthy(self) -> bool:
        """True when the server answers /healthz right now."""
        try:
            return httpx.get(f"{self.url}/healthz", timeout=1.0, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the server (a crash). With auto_restart the monitor brings it back."""
        proc = self._proc
        if proc is not None:
            _kill(proc)

    def terminate(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (graceful: in-flight calls finish) and wait; the exit code (0 when clean)."""
        with self._lock:
            self._stopping = True
            proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill(proc)
        return proc.returncode

    def restart(self) -> None:
        """Stop the server if it runs, then start it again on the same port with the same token."""
        with self._lock:
            if self.running:
                self.terminate()
            self.restarts += 1
            self._stopping = False
            self._spawn()

    def stop(self) -> None:
        """Terminate gracefully (SIGKILL after the grace period) and stop the monitor. A log file
        this object made is deleted after a clean exit, kept for a post-mortem otherwise."""
        code = self.terminate()
        if self._monitor is not None:
            self._monitor.join(timeout=1.0)
            self._monitor = None
        if code == 0 and self._owns_log:
            self.log_path.unlink(missing_ok=True)
