"""The process side of `env_procs.py`: a zygote that forks one child process per env instance.

`EnvProcesses` starts a Python that runs `main(FD)`; FD is its end of a Unix socket pair with
the trainer (the control channel). The first message sets it up (the trainer's `sys.path`, the
plugins, the env's name, params and pickled factory); then it answers two requests:

* ``("fork",)`` followed by one socket (`multiprocessing.reduction.sendfds`): fork a child that
  builds one env and serves its calls on that socket; answered with the child's pid;
* ``("kill", pid)``: SIGKILL that child and reap it (only a child not yet reaped, so a pid that
  was reused is never signalled); answered once it is gone.

Forking from this small single-threaded process costs milliseconds (a spawned interpreter that
imports the env costs ~0.5 s), and each instance in a process of its own means a call past its
deadline is stopped by killing exactly its episode's process. The zygote ignores SIGINT (a
Ctrl-C reaches the whole process group; the trainer decides) and exits when the trainer closes
the channel or dies; its children die with it (PR_SET_PDEATHSIG) or at the EOF of their socket.

A child answers ``(method, args)`` with ``("ok", result, meta)`` or ``("error", failure)``: the
env's exception, pickled where it can be (else its type and text), never raised here.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import inspect
import os
import pickle
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler, recvfds
from types import MappingProxyType
from typing import Any

from steprl.envs.base import Env, ToolInfo, tool_infos


def read_only(items: dict[Any, Any]) -> MappingProxyType[Any, Any]:
    return MappingProxyType(items)


def _mapping_proxy(proxy: MappingProxyType[Any, Any]) -> tuple[Any, ...]:
    return read_only, (dict(proxy),)


# Observations, transitions and tasks keep empty defaults as read-only mappings, which pickle
# cannot carry; registered for the channels' pickler only (`Connection.send` uses it), both sides.
ForkingPickler.register(MappingProxyType, _mapping_proxy)


@dataclass(frozen=True)
class Setup:
    """What the zygote needs to build the env: sent by the trainer as its first message."""

    sys_path: tuple[str, ...]  # the trainer's, so a factory pickled by reference imports here
    plugins: tuple[str, ...]
    env: str
    params: dict[str, Any]
    factory: bytes | None  # pickled by reference; None: look `env` up in the registry


@dataclass(frozen=True)
class Meta:
    """What the agent loop reads from an env besides its calls (sent at create and each reset)."""

    system_prompt: str
    stop_strings: tuple[str, ...]
    tools: tuple[ToolInfo, ...]
    class_name: str  # the env's own, for messages (the trainer holds a `ProcessEnv`)

    @classmethod
    def of(cls, env: Env) -> Meta:
        return cls(str(env.system_prompt), tuple(env.stop_strings), tool_infos(env), type(env).__name__)


@dataclass(frozen=True)
class Failure:
    """An exception the env raised: pickled when it pickles, and always its type and text."""

    pickled: bytes | None
    type_name: str
    message: str


def failure(exc: BaseException) -> Failure:
    try:
        pickled: bytes | None = pickle.dumps(exc)
    except Exception:  # an exception that holds a socket, a lock, a lambda
        pickled = None
    return Failure(pickled, type(exc).__name__, str(exc) or traceback.format_exc(limit=1))


def _die_with_parent() -> None:
    """SIGKILL this process when its parent (the zygote) exits (Linux; elsewhere the EOF of its
    socket ends a child that is waiting for a call)."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def resolve(setup: Setup) -> Callable[..., Env]:
    sys.path[:] = list(setup.sys_path)
    from steprl.envs.registry import get_spec, load_plugins

    load_plugins(setup.plugins)
    if setup.factory is not None:
        factory: Callable[..., Env] = pickle.loads(setup.factory)
        return factory
    return get_spec(setup.env, setup.params).factory


def _serve_instance(conn: Connection, factory: Callable[..., Env], params: dict[str, Any]) -> None:
    """A child's life: build the env, answer its calls until `close` (or the socket's EOF)."""
    loop: asyncio.AbstractEventLoop | None = None
    try:
        env = factory(**params)
        conn.send(("ok", None, Meta.of(env)))
    except BaseException as exc:
        conn.send(("error", failure(exc)))
        return
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            result = getattr(env, method)(*args)
            if inspect.isawaitable(result):  # an env may return an awaitable (the Env protocol)
                loop = loop or asyncio.new_event_loop()
                result = loop.run_until_complete(_awaited(result))
            reply: tuple[Any, ...] = ("ok", result, Meta.of(env) if method == "reset" else None)
        except BaseException as exc:
            reply = ("error", failure(exc))
        try:
            conn.send(reply)
        except Exception as exc:  # a result that does not pickle: the env broke the contract
            conn.send(("error", failure(TypeError(f"its {method}() answer cannot be sent: {exc}"))))
        if method == "close":
            return


async def _awaited(value: Any) -> Any:
    return await value


def _fork(
    control: Connection, sock: socket.socket, factory: Callable[..., Env], params: dict[str, Any]
) -> int:
    (fd,) = recvfds(sock, 1)
    pid = os.fork()
    if pid == 0:  # the child: never returns into the zygote's loop
        code = 0
        try:
            _die_with_parent()
            control.close()  # the zygote's channel is not this child's
            sock.close()
            _serve_instance(Connection(fd), factory, params)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(fd)
    return pid


def _reap(children: set[int]) -> None:
    for pid in list(children):
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == 0:
                continue
        children.discard(pid)


def _kill(children: set[int], pid: int) -> None:
    if pid in children:  # not reaped yet: the pid is still this child's
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        children.discard(pid)


def main(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    conn = Connection(os.dup(fd))
    try:
        setup: Setup = conn.recv()
        factory = resolve(setup)
    except BaseException as exc:
        conn.send(("error", failure(exc)))
        return
    conn.send(("ok", os.getpid()))
    children: set[int] = set()
    try:
        while True:
            if conn.poll(1.0):
                request = conn.recv()
                if request[0] == "fork":
                    pid = _fork(conn, sock, factory, setup.params)
                    children.add(pid)
                    conn.send(pid)
                else:
                    _kill(children, request[1])
                    conn.send(True)
            _reap(children)
    except (EOFError, OSError):  # the trainer closed the channel, or died
        pass
    finally:
        for pid in list(children):
            _kill(children, pid)
