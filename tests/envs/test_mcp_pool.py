"""The MCP reuse pool (`mcp_pool.MCPPool`) with real servers: warm sessions across event loops,
`max_servers`, dead servers discarded, cancellation, and no orphan processes in any case."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from mcp import StdioServerParameters

from steprl.envs.adapters.mcp_env import MCPToolEnv
from steprl.envs.adapters.mcp_pool import MCPPool, close_pools
from steprl.envs.adapters.mcp_session import MCPStartError, MCPTransportError
from steprl.envs.adapters.mcp_yaml import make_mcp_env
from steprl.errors import UserError
from steprl.types import Task

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

SERVER = Path(__file__).with_name("mcp_test_server.py")
PARAMS = StdioServerParameters(command=sys.executable, args=[str(SERVER)])
TASK = Task(id="t", prompt="2 plus 3?", env="mcp-test", answer="5")
TIME = {"command": "mcp-server-time", "args": ["--local-timezone", "UTC"], "reuse": True}
TIME_TASK = Task(
    id="tokyo",
    prompt="It is 23:30 in Asia/Tokyo. What time is it in Asia/Kolkata?",
    env="mcp",
    answer="20:00",
)


def _servers(pattern: str) -> set[int]:
    """Live (not zombie) child processes of this process whose command line contains `pattern`."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == os.getpid() and state != "Z" and pattern in cmdline:
            found.add(int(entry))
    return found


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _result(text: str) -> str:
    return text.removeprefix("<result>").removesuffix("</result>")


async def _pid_episode(env: MCPToolEnv) -> int:
    await env.reset(TASK, 0)
    pid = int(_result((await env.step(_call("pid"))).observation))
    assert (await env.step("<answer>5</answer>")).reward == 1.0
    await env.close()
    return pid


@pytest.fixture(autouse=True)
def _no_orphans():
    before = _servers(str(SERVER)) | _servers("mcp-server-time")
    yield
    close_pools()
    assert _servers(str(SERVER)) | _servers("mcp-server-time") <= before


def _verify(answer: str, task: Task) -> float:
    return 1.0 if answer.strip() == task.answer else 0.0


def test_time_server_is_started_once_across_event_loops_then_closed():
    env = make_mcp_env(**TIME)
    assert env.pool is not None and make_mcp_env(**TIME).pool is env.pool  # one pool per process

    async def episode(env: MCPToolEnv) -> float:
        await env.reset(TIME_TASK, 0)
        out = await env.step(
            _call("convert_time", source_timezone="Asia/Tokyo", time="23:30", target_timezone="Asia/Kolkata")
        )
        assert '"datetime":' in out.observation and "T20:00:00+05:30" in out.observation
        final = await env.step("<answer>20:00</answer>")
        await env.close()
        return final.reward

    # The trainer runs each step in a new event loop (asyncio.run): the servers outlive them.
    rewards = [asyncio.run(episode(env if i % 2 else make_mcp_env(**TIME))) for i in range(4)]
    assert rewards == [1.0] * 4 and env.pool.started == 1 and len(_servers("mcp-server-time")) == 1

    async def concurrent() -> list[float]:
        return await asyncio.gather(*(episode(make_mcp_env(**TIME, max_servers=2)) for _ in range(5)))

    assert asyncio.run(concurrent()) == [1.0] * 5
    wide = make_mcp_env(**TIME, max_servers=2).pool
    assert wide is not env.pool and wide is not None and wide.started <= 2 and wide.live <= 2
    assert len(_servers("mcp-server-time")) <= 3
    close_pools()
    assert not _servers("mcp-server-time")
    assert env.pool.closed and make_mcp_env(**TIME).pool is not env.pool  # a closed pool is replaced


def test_dead_and_broken_servers_are_discarded_not_reused():
    pool = MCPPool(PARAMS, max_servers=2)
    env = MCPToolEnv(PARAMS, _verify, pool=pool)
    first = asyncio.run(_pid_episode(env))
    assert asyncio.run(_pid_episode(env)) == first and pool.started == 1  # warm
    os.kill(first, signal.SIGKILL)  # dies while idle: the ping before lending finds out
    second = asyncio.run(_pid_episode(env))
    assert second != first and pool.started == 2 and pool.live == 1

    async def crash() -> None:
        await env.reset(TASK, 0)
        with pytest.raises(MCPTransportError):
            await env.step(_call("crash"))
        await env.close()  # handed back as broken: closed, not kept

    asyncio.run(crash())
    assert pool.live == 0 and _gone(second)
    assert asyncio.run(_pid_episode(env)) not in (first, second) and pool.started == 3
    pool.close()
    pool.close()
    assert pool.live == 0


def test_max_servers_makes_episodes_wait_and_a_cancelled_wait_leaks_nothing():
    pool = MCPPool(PARAMS, max_servers=1)

    async def scenario() -> None:
        held = await pool.acquire()
        waiting = asyncio.create_task(pool.acquire())
        await asyncio.sleep(0.3)
        assert not waiting.done()  # the only server is lent
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await pool.release(held)
        await pool.release(held)  # twice: a no-op
        pids = await asyncio.gather(*(_pid_episode(MCPToolEnv(PARAMS, _verify, pool=pool)) for _ in range(3)))
        assert len(set(pids)) == 1  # three episodes took turns on one server

    asyncio.run(scenario())
    assert pool.started == 1 and pool.live == 1
    pool.close()


def test_close_with_a_lent_session_stops_its_server():
    pool = MCPPool(PARAMS, max_servers=1)
    env = MCPToolEnv(PARAMS, _verify, pool=pool)

    async def start() -> int:
        await env.reset(TASK, 0)
        return int(_result((await env.step(_call("pid"))).observation))

    pid = asyncio.run(start())
    pool.close()  # the episode still holds its session
    assert _gone(pid)

    async def after() -> None:
        with pytest.raises(MCPTransportError, match="closed"):
            await env.step(_call("add", a=1, b=2))
        await env.close()
        with pytest.raises(MCPTransportError, match="closed"):
            await pool.acquire()

    asyncio.run(after())


def test_a_server_that_fails_to_start_frees_its_slot():
    broken = StdioServerParameters(
        command=sys.executable, args=["-c", "import sys; sys.stderr.write('boom: bad flag\\n'); sys.exit(3)"]
    )
    pool = MCPPool(broken, max_servers=1)
    for _ in range(2):  # the slot came back: the second attempt does not wait
        with pytest.raises(MCPStartError, match="boom: bad flag") as caught:
            asyncio.run(pool.acquire())
        assert isinstance(caught.value, UserError)
    assert pool.live == 0 and pool.started == 0
    pool.close()


def test_servers_exit_when_the_parent_is_killed(tmp_path):
    script = textwrap.dedent(
        f"""
        import asyncio, sys, time
        from mcp import StdioServerParameters
        from steprl.envs.adapters.mcp_pool import MCPPool
        pool = MCPPool(StdioServerParameters(command=sys.executable, args=[{str(SERVER)!r}]))
        async def main():
            session = await pool.acquire()
            from steprl.envs.adapters.mcp_session import run_in
            print(await run_in(session.loop, session.call("pid", {{}})), flush=True)
        asyncio.run(main())
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert not _gone(pid)
        parent.send_signal(signal.SIGKILL)  # no atexit, no cleanup: only the closed stdin pipe
        parent.wait(10)
        deadline = time.monotonic() + 10
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(pid), "the MCP server outlived its killed parent"
    finally:
        parent.kill()
        parent.wait()


def test_close_pools_at_exit_leaves_no_server(tmp_path):
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        from mcp import StdioServerParameters
        from steprl.envs.adapters.mcp_pool import MCPPool
        from steprl.envs.adapters.mcp_session import run_in
        pool = MCPPool(StdioServerParameters(command=sys.executable, args=[{str(SERVER)!r}]))
        async def main():
            session = await pool.acquire()
            print(await run_in(session.loop, session.call("pid", {{}})), flush=True)
        asyncio.run(main())
        """  # exits holding a lent session: the atexit hook closes the pool
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert _gone(int(out.stdout))


def test_a_shared_pool_is_closed_at_exit(tmp_path):
    """The pool the `mcp` family builds (`shared_pool`, held only by the module) is closed by
    the atexit hook too: a run's reused servers do not outlive it."""
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        from mcp import StdioServerParameters
        from steprl.envs.adapters.mcp_pool import shared_pool
        from steprl.envs.adapters.mcp_session import run_in
        pool = shared_pool(StdioServerParameters(command=sys.executable, args=[{str(SERVER)!r}]),
                           max_servers=1, call_timeout_s=10.0, startup_timeout_s=30.0)
        async def main():
            session = await pool.acquire()
            print(await run_in(session.loop, session.call("pid", {{}})), flush=True)
            await pool.release(session)
        asyncio.run(main())
        del pool  # only the module's table holds it now
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert _gone(int(out.stdout))
