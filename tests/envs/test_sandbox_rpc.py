"""Host calls from a sandbox session (`steprl.envs.sandbox.Rpc`): the protocol, its bounds, its failures.

The cell side is the in-sandbox `sandbox_host` module; the host side is the session's cell
splitter and the handler. Forged frames (the marker is readable in /sandbox/main.py) may only
break the forger's own session. Timing enters only as generous anti-hang bounds.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from steprl.envs.sandbox import ErrorKind, Rpc, RpcError, Sandbox, SandboxLimits, probe_capabilities
from steprl.envs.sandbox.capture import CellStream

CAPS = probe_capabilities()
_MISSING = [r for g in ("bwrap", "user_namespace", "pid_namespace", "net_namespace") if (r := CAPS.reason(g))]
SANDBOXED = pytest.mark.skipif(bool(_MISSING), reason="; ".join(_MISSING))
LIMITS = SandboxLimits(wall_s=5.0, output_bytes=4096)


def echo(request: Any) -> Any:
    if request == "refuse":
        raise RpcError("refused on purpose")
    if isinstance(request, dict) and "size" in request:
        return "y" * request["size"]
    return {"echo": request}


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def uid_alive(uid: int) -> bool:
    """Whether any non-zombie process runs as outside uid `uid`."""
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            lines = status.read_text().splitlines()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in lines if ":" in line)
        if fields.get("Uid", "").split()[:1] == [str(uid)] and not fields.get("State", "").strip().startswith(
            "Z"
        ):
            return True
    return False


def wait_for(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.fixture(scope="module")
def box() -> Sandbox:
    return Sandbox(LIMITS)


def test_rpc_limits_are_validated() -> None:
    for bad in (dict(max_calls=0), dict(max_request_bytes=-1), dict(max_response_bytes=True)):
        with pytest.raises(ValueError, match="int >= 1"):
            Rpc(echo, **bad)


# --- the cell splitter, without a sandbox ---------------------------------------------------------------


def test_request_frames_split_anywhere_are_taken_out_of_the_output() -> None:
    marker = b"\x1eabc\x1e"
    stream = b"one " + marker + b"?7\n[1,2,3]" + b"two " + marker + b"?2\n{}" + b"three" + marker + b"0\n"
    for split in range(1, len(stream) + 1):  # every chunk size, so every frame is split somewhere
        got: list[bytes] = []
        cell = CellStream(marker, got.append, max_request=64)
        out = cell.start(1024)
        for i in range(0, len(stream), split):
            cell.feed(stream[i : i + split])
        assert got == [b"[1,2,3]", b"{}"] and cell.status == 0 and cell.violation is None, split
        assert out.text() == "one two three", split


def test_many_frames_in_one_chunk_and_malformed_frames() -> None:
    marker = b"\x1eabc\x1e"
    got: list[bytes] = []
    cell = CellStream(marker, got.append, max_request=64)
    cell.start(1024)
    cell.feed((marker + b"?2\n[]") * 5000 + marker + b"1\n")  # no recursion limit in the way
    assert len(got) == 5000 and cell.status == 1
    for bad in (b"?abc\n", b"?99\n", b"?" + b"1" * 30):
        cell = CellStream(marker, got.append, max_request=64)
        out = cell.start(1024)
        cell.feed(b"before" + marker + bad + b"after" + marker + b"0\n")
        assert cell.violation and cell.status is None and out.text() == "before", bad
    plain = CellStream(marker)  # without host calls a "?" frame is no request (as before)
    plain.start(1024)
    plain.feed(marker + b"?2\n[]")
    assert plain.status == ord("?") - ord("0")


# --- through a real sandbox ---------------------------------------------------------------------------------


@SANDBOXED
def test_a_cell_calls_the_host_and_goes_on(box: Sandbox) -> None:
    seen: list[Any] = []

    def handler(request: Any) -> Any:
        seen.append(request)
        return echo(request)

    with box.session(LIMITS, rpc=Rpc(handler)) as s:
        res = s.run("import sandbox_host as h\nprint('a')\nprint(h.call([1, 'x', None]))\nprint('b')")
        assert res.ok and res.stdout == "a\n{'echo': [1, 'x', None]}\nb\n" and res.rpc_calls == 1
        assert seen == [[1, "x", None]]
        refused = s.run("try:\n    h.call('refuse')\nexcept h.RpcError as e:\n    print('caught', e)")
        assert refused.stdout == "caught refused on purpose\n"
        uncaught = s.run("h.call('refuse')")
        assert (
            uncaught.exit_code == 1
            and last_line(uncaught.stderr) == "sandbox_host.RpcError: refused on purpose"
        )
        big = s.run("r = h.call({'size': 200_000})\nprint(len(r), set(r))")  # more than a pipe buffer
        assert big.stdout == "200000 {'y'}\n"
        threads = s.run(
            "import threading\nout = []\n"
            "ts = [threading.Thread(target=lambda i=i: out.append(h.call(i)['echo'])) for i in range(8)]\n"
            "[t.start() for t in ts]\n[t.join() for t in ts]\nprint(sorted(out))"
        )
        assert threads.stdout == "[0, 1, 2, 3, 4, 5, 6, 7]\n" and threads.rpc_calls == 8
        assert s.run("print(h.call('still here'))").stdout == "{'echo': 'still here'}\n"
    with box.session(LIMITS) as plain:  # no rpc: no module
        assert last_line(plain.run("import sandbox_host").stderr).startswith("ModuleNotFoundError")


@SANDBOXED
def test_bounds_on_count_and_size(box: Sandbox) -> None:
    rpc = Rpc(echo, max_calls=3, max_request_bytes=1000, max_response_bytes=5000)
    with box.session(LIMITS, rpc=rpc) as s:
        res = s.run(
            "import sandbox_host as h\nfor i in range(5):\n    try:\n        print(h.call(i)['echo'])\n"
            "    except h.RpcError as e:\n        print(e)"
        )
        assert res.stdout.splitlines() == ["0", "1", "2"] + ["too many calls in one cell (max 3)"] * 2
        assert res.rpc_calls == 3
        assert s.run("print(h.call(9)['echo'])").stdout == "9\n"  # the budget is per cell
        assert last_line(s.run("h.call('x' * 2000)").stderr) == (
            "sandbox_host.RpcError: request too large (2002 bytes, max 1000)"
        )
        assert last_line(s.run("h.call({'size': 6000})").stderr).startswith(
            "sandbox_host.RpcError: reply too large"
        )
        assert (
            last_line(s.run("h.call({1})").stderr) == "TypeError: Object of type set is not JSON serializable"
        )
        assert s.alive


FORGE = """
import os, re
nonce = re.search(rb'b"([0-9a-f]{32})"', open("/sandbox/main.py", "rb").read()).group(1)
marker = b"\\x1e" + nonce + b"\\x1e"
os.write(1, b"out\\n" + FRAMES)
"""


@SANDBOXED
@pytest.mark.parametrize(
    "frames",
    [
        "(marker + b'?2\\n[]') * 20000",  # requests that never read their replies
        "marker + b'?abc\\n'",  # a broken header
        "marker + b'?999999999\\n'",  # over the request size
    ],
)
def test_forged_frames_kill_only_the_forgers_interpreter(frames: str) -> None:
    uid = random.randrange(400_000, 4_000_000)
    box = Sandbox(LIMITS, uid_range=(uid, uid))
    with box.session(LIMITS, rpc=Rpc(echo)) as s, Sandbox(LIMITS).session(LIMITS, rpc=Rpc(echo)) as other:
        assert s.run("x = 1").ok
        res = s.run(FORGE.replace("FRAMES", frames))
        assert res.error is ErrorKind.PROTOCOL_ERROR and not s.alive
        assert "broke the host-call protocol" in res.stderr and res.duration_s < LIMITS.wall_s
        assert s.run("print(x)").error is ErrorKind.SESSION_DEAD
        assert other.run("import sandbox_host as h; print(h.call(1))").stdout == "{'echo': 1}\n"
    assert wait_for(lambda: not uid_alive(uid), 5.0)


@SANDBOXED
def test_a_failing_handler_propagates_and_ends_the_session() -> None:
    uid = random.randrange(400_000, 4_000_000)
    box = Sandbox(LIMITS, uid_range=(uid, uid))

    def broken(request: Any) -> Any:
        raise KeyError("the database is gone")

    with box.session(LIMITS, rpc=Rpc(broken)) as s:
        with pytest.raises(KeyError, match="the database is gone"):
            s.run("import sandbox_host as h\nh.call(1)")
        assert not s.alive and s.run("1").error is ErrorKind.SESSION_DEAD
    assert wait_for(lambda: not uid_alive(uid), 5.0)
    with box.session(LIMITS, rpc=Rpc(lambda request: {1, 2})) as s, pytest.raises(TypeError):
        s.run("import sandbox_host as h\nh.call(1)")  # a reply that is no JSON: the host's bug


@SANDBOXED
def test_the_prelude_runs_in_every_interpreter(box: Sandbox) -> None:
    prelude = "import sandbox_host\ndef twice(v):\n    return sandbox_host.call(v)['echo'] * 2\n"
    with box.session(SandboxLimits(wall_s=1.0), rpc=Rpc(echo), prelude=prelude, auto_restart=True) as s:
        first = s.run("print(twice(21))")
        assert first.stdout == "42\n" and first.rpc_calls == 1
        assert s.run("while True:\n    pass").error is ErrorKind.TIMEOUT
        again = s.run("print(twice('ab'))")  # a fresh interpreter, prelude included
        assert again.stdout == "abab\n" and again.stderr.startswith("[interpreter restarted")
    with pytest.raises(RuntimeError, match="prelude failed.*ZeroDivisionError"):
        box.session(LIMITS, prelude="1 / 0")
