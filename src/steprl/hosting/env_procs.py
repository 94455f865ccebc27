"""Sync user envs in processes of their own: a call past its deadline is killed, not abandoned.

A sync env call runs on a thread (`envs/deadline.py`), and Python cannot stop a thread: a call
past its deadline was abandoned there. One that blocks in I/O only holds its thread; one that
spins (`while True: pass`) held a core and the GIL for the rest of the run (issue 44: a 1-step
run never finished, 129 s to exit after SIGTERM). So the in-process backend runs a user's sync
env (`isolates`) in a process per instance, forked from one zygote per env
(`env_worker.py`), and `ProcessEnv` is the sync env the trainer sees: each call is a round trip
on that instance's socket, still under `DeadlineEnv`'s deadline (the env is built in the child
inside its first call, so the factory has the deadline too). When a call passes it the loop
closes the env at once, and `close` on an instance with a call in flight SIGKILLs its process
(the zygote reaps it): the thread waiting on it wakes with an EOF and the cores are free.

Costs, measured with `benchmarks/env_call_roundtrip.py`: a step round trip is a few tens of
microseconds more than on a thread, and a new instance a fork (~ms) instead of a call. steprl's
own envs and async envs stay in-process: they are not user code that may spin, and an async env
runs on the trainer's loop as before.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import sendfds
from typing import Any

from steprl.envs.base import Env, EnvTimeout, InfraError, Observation, ToolInfo, Transition
from steprl.hosting.env_worker import Failure, Meta, Setup
from steprl.hosting.threads import is_async
from steprl.types import Task


class EnvProcessError(InfraError):
    """An env's process failed (it died, or its zygote could not start or fork)."""


def isolates(factory: Callable[..., Env], env: Env) -> bool:
    """Whether the env `factory` built runs in processes of its own: a sync env that is not one
    of steprl's (a user's code, which may spin past its deadline)."""
    target = getattr(factory, "func", factory)  # a functools.partial
    own = str(getattr(target, "__module__", "")).startswith("steprl.")
    return not own and not (is_async(env.reset) and is_async(env.step))


def _reference(factory: Callable[..., Env]) -> bytes | None:
    """The factory pickled by reference (module + name), or None where the zygote cannot import
    it that way (a lambda, a closure, `__main__`): the zygote then looks the env up by name."""
    if getattr(factory, "__module__", None) == "__main__":
        return None
    try:
        return pickle.dumps(factory)
    except Exception:
        return None


class EnvProcesses:
    """One env's zygote (`env_worker.py`): forks a process per instance, kills one on request.

    Every request is a short round trip under one lock (threads of several instances share the
    channel). A zygote that died is started again at the next fork.
    """

    def __init__(
        self,
        env: str,
        params: Mapping[str, Any],
        factory: Callable[..., Env],
        plugins: Sequence[str] = (),
        *,
        start_timeout_s: float = 60.0,
    ) -> None:
        self.setup = Setup(tuple(sys.path), tuple(plugins), env, dict(params), _reference(factory))
        self.start_timeout_s = start_timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._conn: Connection | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> EnvProcesses:
        with self._lock:
            self._start()
        return self

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        # imported, not run as __main__: the records it sends must unpickle here by their names
        code = f"from steprl.hosting.env_worker import main; main({theirs.fileno()})"
        argv = [sys.executable, "-c", code]
        self._proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        # a backend dropped without close() (a test, a notebook) takes its zygote with it; the
        # zygote's children die with it (PR_SET_PDEATHSIG)
        weakref.finalize(self, _kill_quietly, self._proc)
        self._sock, self._conn = ours, Connection(os.dup(ours.fileno()))
        self._conn.send(self.setup)
        if not self._conn.poll(self.start_timeout_s):
            self._stop()
            raise EnvProcessError(f"the env's zygote process gave no answer within {self.start_timeout_s:g}s")
        answer = self._conn.recv()
        if answer[0] == "error":
            self._stop()
            raise EnvProcessError(f"the env's zygote process cannot build it: {_text(answer[1])}")

    def fork(self) -> tuple[int, Connection]:
        """A new process for one instance, and the channel to it."""
        ours, theirs = socket.socketpair()
        try:
            with self._lock:
                if self._proc is None or self._proc.poll() is not None:
                    self._stop()
                    self._start()
                assert self._conn is not None and self._sock is not None
                try:
                    self._conn.send(("fork",))
                    sendfds(self._sock, [theirs.fileno()])
                    pid: int = self._conn.recv()
                except (EOFError, OSError) as exc:
                    raise EnvProcessError(f"the env's zygote process died: {exc}") from None
        finally:
            theirs.close()
        return pid, Connection(ours.detach())

    def kill(self, pid: int) -> None:
        """SIGKILL the instance process `pid` and wait until it is reaped."""
        with self._lock:
            if self._conn is None:
                return
            try:
                self._conn.send(("kill", pid))
                self._conn.recv()
            except (EOFError, OSError):
                pass  # the zygote is gone, and its children with it

    def close(self) -> None:
        """Stop the zygote; its instance processes die with it."""
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        if self._conn is not None:
            self._conn.close()  # the zygote sees EOF, kills and reaps its children, exits
            self._conn = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None


class ProcessEnv:
    """The sync env the trainer sees for one instance in its own process (`EnvProcesses`).

    Made without I/O; its process is forked and the env built at the first call. Calls arrive
    one at a time from `DeadlineEnv`'s thread; `close` comes from another thread when a call
    passed its deadline, and then kills the process instead of waiting for it.
    """

    def __init__(self, procs: EnvProcesses, meta: Meta, timeout_s: float) -> None:
        self._procs = procs
        self._meta = meta  # the probe env's until this instance says otherwise
        self.timeout_s = timeout_s  # the call deadline, kept here too: see `_receive`
        self._pid: int | None = None
        self._conn: Connection | None = None
        self._busy: str | None = None  # the call in flight
        self._closed = False

    @property
    def class_name(self) -> str:  # what `DeadlineEnv` calls the env in its messages
        return self._meta.class_name

    @property
    def system_prompt(self) -> str:
        return self._meta.system_prompt

    @property
    def stop_strings(self) -> Sequence[str]:
        return self._meta.stop_strings

    @property
    def tools(self) -> Mapping[str, ToolInfo]:
        return {t.name: t for t in self._meta.tools}

    def reset(self, task: Task, seed: int) -> Observation:
        result: Observation = self._call("reset", task, seed)
        return result

    def step(self, action: str) -> Transition:
        result: Transition = self._call("step", action)
        return result

    def close(self) -> None:
        if self._busy is not None:  # a call past its deadline: stop it, do not wait for it
            self._kill()
            return
        if self._conn is None or self._closed:
            return
        try:
            self._call("close")
        finally:
            self._closed = True
            self._conn.close()

    def _kill(self) -> None:
        if self._closed:  # killed already (at the deadline, then by the loop's close)
            return
        self._closed = True
        if self._pid is not None:
            self._procs.kill(self._pid)

    def _call(self, method: str, *args: Any) -> Any:
        if self._closed:
            raise EnvProcessError(f"{method}(): this env's process was stopped")
        self._busy = method
        started = time.monotonic()
        try:
            if self._conn is None:
                self._pid, self._conn = self._procs.fork()
                self._answer(self._receive(method, started))  # the factory ran in the child
            self._conn.send((method, args))
            return self._answer(self._receive(method, started))
        finally:
            self._busy = None

    def _receive(self, method: str, started: float) -> Any:
        """The child's answer. At the deadline the child is killed from here, on the call's own
        thread: the loop that enforces the deadline too may be busy (a CPU engine generates on
        it), and a spinning child would hold a core until the loop got to it."""
        assert self._conn is not None
        try:
            if not self._conn.poll(max(0.0, self.timeout_s - (time.monotonic() - started))):
                self._kill()
                raise EnvTimeout(
                    f"{self.class_name}.{method}() gave no answer within {self.timeout_s:g}s; its "
                    "process was killed (raise runtime.env_call_timeout_s if the env is only slow)"
                )
            return self._conn.recv()
        except (EOFError, OSError):
            if self._closed:  # killed past its deadline; DeadlineEnv has answered already
                raise EnvTimeout(f"{method}() was stopped past its deadline") from None
            raise EnvProcessError(f"the env's process (pid {self._pid}) died during {method}()") from None

    def _answer(self, reply: tuple[Any, ...]) -> Any:
        if reply[0] == "error":
            raise _exception(reply[1])
        _, result, meta = reply
        if meta is not None:
            self._meta = meta
        return result


def _kill_quietly(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _exception(failure: Failure) -> BaseException:
    """The env's exception as it raised it where it unpickles, else an `InfraError` with its text."""
    if failure.pickled is not None:
        try:
            exc = pickle.loads(failure.pickled)
        except Exception:
            exc = None
        if isinstance(exc, BaseException):
            return exc
    return InfraError(_text(failure))


def _text(failure: Failure) -> str:
    return f"{failure.type_name}: {failure.message}"
