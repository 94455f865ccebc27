"""`WorkerThreads`: calls of one tick start as one group; a slow call never holds the others.

The env server runs every sync env call here. A group of quick calls runs on one thread (one
hand-off each way instead of one per call); once a group is older than `spread_s` each call
still waiting gets its own thread, so a hung env delays the calls queued behind it by at most
that. Results, errors, `Overloaded` past the limit, orphans and cancelled calls each have a test.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from steprl.hosting.threads import Overloaded, WorkerThreads, call_env, is_async


def test_quick_calls_of_one_tick_run_in_order_on_one_thread() -> None:
    threads = WorkerThreads(limit=64, spread_s=5.0)
    seen: list[tuple[int, int]] = []

    def work(i: int) -> int:
        seen.append((i, threading.get_ident()))
        return i * i

    async def go() -> list[int]:
        return await asyncio.gather(*(threads.run(work, i) for i in range(16)))

    assert asyncio.run(go()) == [i * i for i in range(16)]
    assert [i for i, _ in seen] == list(range(16))  # drained in submission order
    assert len({ident for _, ident in seen}) == 1  # one thread, one hand-off
    assert threads.alive == 0


def test_a_hung_call_does_not_hold_up_the_calls_queued_behind_it() -> None:
    threads = WorkerThreads(limit=64, spread_s=0.02)
    release = threading.Event()
    idents: dict[str, int] = {}

    def hang() -> str:
        idents["hang"] = threading.get_ident()
        release.wait(10)
        return "late"

    def quick(i: int) -> int:
        idents[f"q{i}"] = threading.get_ident()
        return i

    async def go() -> tuple[list[int], bool]:
        hung = asyncio.ensure_future(threads.run(hang))
        rest = [asyncio.ensure_future(threads.run(quick, i)) for i in range(5)]  # same tick
        answers = await asyncio.wait_for(asyncio.gather(*rest), timeout=5)
        still_hung = not hung.done()
        release.set()
        assert await hung == "late"
        return answers, still_hung

    answers, still_hung = asyncio.run(go())
    assert answers == [0, 1, 2, 3, 4] and still_hung
    assert all(idents[f"q{i}"] != idents["hang"] for i in range(5))  # they were spread out
    assert threads.alive == 0


def test_results_reach_the_loop_before_a_slow_call_in_the_group_ends() -> None:
    threads = WorkerThreads(limit=8, spread_s=0.01)
    release = threading.Event()

    async def go() -> bool:
        first = asyncio.ensure_future(threads.run(lambda: 1))
        slow = asyncio.ensure_future(threads.run(lambda: release.wait(10)))  # same group, after `first`
        assert await asyncio.wait_for(first, timeout=5) == 1
        running = not slow.done()
        release.set()
        await slow
        return running

    assert asyncio.run(go())


def test_an_error_reaches_only_its_own_caller() -> None:
    threads = WorkerThreads(limit=8)

    def boom() -> None:
        raise ValueError("env bug")

    async def go() -> list[object]:
        return await asyncio.gather(
            threads.run(lambda: "a"), threads.run(boom), threads.run(lambda: "c"), return_exceptions=True
        )

    a, err, c = asyncio.run(go())
    assert (a, c) == ("a", "c") and isinstance(err, ValueError) and str(err) == "env bug"


def test_calls_past_the_limit_are_overloaded_and_the_rest_run() -> None:
    threads = WorkerThreads(limit=3, spread_s=0.01)
    release = threading.Event()

    async def go() -> list[object]:
        calls = [threads.run(release.wait, 10) for _ in range(5)]
        gathered = asyncio.gather(*calls, return_exceptions=True)
        await asyncio.sleep(0.05)
        assert threads.alive == 3
        release.set()
        return await gathered

    out = asyncio.run(go())
    assert out[:3] == [True, True, True]
    assert all(isinstance(o, Overloaded) for o in out[3:])
    assert threads.alive == 0


def test_a_call_cancelled_before_it_started_never_runs() -> None:
    threads = WorkerThreads(limit=8, spread_s=30.0)  # never spread: the second call waits
    release = threading.Event()
    ran: list[str] = []

    async def go() -> None:
        first = asyncio.ensure_future(threads.run(lambda: release.wait(10)))
        second = asyncio.ensure_future(threads.run(lambda: ran.append("second")))
        await asyncio.sleep(0.05)
        second.cancel()  # its caller gave up (a handler deadline) while it waited for the thread
        await asyncio.sleep(0)
        release.set()
        await first
        await asyncio.sleep(0.05)

    asyncio.run(go())
    assert ran == [] and threads.alive == 0


def test_a_late_result_goes_to_the_orphan_callback() -> None:
    threads = WorkerThreads(limit=8)
    release = threading.Event()
    orphans: list[str] = []

    async def go() -> None:
        def build() -> str:
            release.wait(10)
            return "env built too late"

        with pytest.raises(TimeoutError):
            await asyncio.wait_for(threads.run(build, orphan=orphans.append), timeout=0.05)
        release.set()
        for _ in range(100):
            if orphans:
                break
            await asyncio.sleep(0.01)

    asyncio.run(go())
    assert orphans == ["env built too late"]


def test_async_env_methods_are_awaited_on_the_loop_and_detection_is_per_function() -> None:
    class Env:
        async def step(self, action: str) -> str:
            return f"async {action} on {threading.current_thread().name}"

        def reset(self) -> str:
            return threading.current_thread().name

    threads = WorkerThreads(limit=2)

    async def go() -> tuple[str, str]:
        env = Env()
        return await call_env(threads, env.step, "a"), await call_env(threads, env.reset)

    stepped, reset_on = asyncio.run(go())
    assert stepped == "async a on MainThread" and reset_on == "steprl-env-call"
    assert is_async(Env().step) and not is_async(Env().reset)
