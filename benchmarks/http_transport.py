"""What each HTTP env-transport mechanism buys: the client's options switched off one at a time.

One loopback env server, several clients, interleaved over `--rounds` (a shared machine is
noisy: compare numbers of one run). Each cell runs `--episodes` episodes of `--steps` steps,
`--concurrency` at once, and times every step; printed: median over rounds of p50 and p99 step
latency over in-process.

    .venv/bin/python benchmarks/http_transport.py [--rounds 5] [--concurrency 16]

Variants: `default` (coalesced, keep-alive `PlainHttp`, streamed answers); `httpx` (the batch
over httpx instead of `PlainHttp`); `no-stream` (each batch answered whole); `per-call` (no
coalescing: one request per call). Envs: `echo` (a no-op step: pure transport cost) and
`mixed` (echo where one episode in 16 takes 50 ms per step, as a slow sandbox call would;
latency of the other episodes' steps: what streaming is for).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import time
from itertools import islice
from pathlib import Path

from steprl.envs.base import Env, maybe_await
from steprl.envs.library.echo import EchoEnv
from steprl.envs.registry import ENVS, get_spec, make_tasks, register
from steprl.hosting.backend import EnvBackend, InProcessBackend
from steprl.hosting.coalesce import Coalescers
from steprl.hosting.http_backend import HttpEnvBackend
from steprl.hosting.local_server import LocalEnvServer
from steprl.types import Task

SLOW_S = 0.05


def is_slow(task: Task) -> bool:
    return int(task.id.rsplit("-", 1)[1]) % 16 == 0


class MixedEcho(EchoEnv):
    """Echo whose slow episodes (one in 16) take `SLOW_S` per step."""

    def reset(self, task: Task, seed: int):  # type: ignore[no-untyped-def]
        self.slow = is_slow(task)
        return super().reset(task, seed)

    def step(self, action: str):  # type: ignore[no-untyped-def]
        if self.slow:
            time.sleep(SLOW_S)
        return super().step(action)


# Imported by the server too (`--plugin http_transport`): it registers the mixed env there.
if "mixed_echo" not in ENVS:
    register(dataclasses.replace(get_spec("echo"), name="mixed_echo", factory=MixedEcho))


async def _run(backend: EnvBackend, tasks: list[Task], concurrency: int, steps: int) -> list[float]:
    latencies: list[float] = []
    slots = asyncio.Semaphore(concurrency)

    async def one(task: Task) -> None:
        async with slots:
            env: Env = backend.make_env(task)
            try:
                await maybe_await(env.reset(task, task.seed))
                for _ in range(steps):
                    t0 = time.perf_counter()
                    await maybe_await(env.step(f"<say>{task.answer}</say>"))
                    if not is_slow(task):  # the mixed env's slow episodes are the cause, not the measure
                        latencies.append(time.perf_counter() - t0)
            finally:
                await maybe_await(env.close())

    await asyncio.gather(*(one(t) for t in tasks))
    return latencies


def _cell(backend: EnvBackend, tasks: list[Task], concurrency: int, steps: int) -> tuple[float, float]:
    asyncio.run(_run(backend, tasks[:16], 4, steps))  # warm-up: connections, threads
    lat = sorted(asyncio.run(_run(backend, tasks, concurrency, steps)))
    return 1e3 * statistics.median(lat), 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--episodes", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    here = str(Path(__file__).parent)  # the server imports this file as its plugin
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    tasks = list(islice(make_tasks("echo", "train", 0, turns=args.steps + 1), args.episodes))
    variants = {
        "default": {},
        "httpx": {"plain_http": False},
        "no-stream": {"stream": False},
        "per-call": None,
    }
    cells: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with LocalEnvServer(plugins=("http_transport",), max_instances=4 * args.concurrency) as server:
        for _ in range(args.rounds):
            for env in ("echo", "mixed_echo"):
                base = _cell(InProcessBackend(env, {}), tasks, args.concurrency, args.steps)
                for name, options in variants.items():
                    backend = HttpEnvBackend(server.url, server.token, env, coalesce=options is not None)
                    if options:
                        backend.coalescers = Coalescers(**options)
                    p50, p99 = _cell(backend, tasks, args.concurrency, args.steps)
                    cells.setdefault((env, name), []).append((p50 - base[0], p99 - base[1]))
    print(f"\nHTTP over in-process, concurrency {args.concurrency}, median of {args.rounds} rounds")
    print(f"{'env':<11} {'variant':<10} {'p50 ms':>9} {'p99 ms':>9}")
    for (env, name), xs in cells.items():
        p50 = statistics.median(x[0] for x in xs)
        p99 = statistics.median(x[1] for x in xs)
        print(f"{env:<11} {name:<10} {p50:>+9.3f} {p99:>+9.3f}")


if __name__ == "__main__":
    main()
