"""A fresh MCP server per episode vs the reuse pool: the wall time of generating demonstration
episodes of the time server (configs/mcp_time.yaml's env: reset, the expert's `convert_time`
call, the answer, close), sequentially and with several episodes at once. A script that prints
numbers, not a timed test.

    .venv/bin/python benchmarks/mcp_reuse.py [--episodes 500] [--fresh-episodes 40] [--concurrency 8]

Episodes run in chunks of `--chunk`, one ``asyncio.run`` per chunk, as the trainer runs one per
step (the pool's servers outlive each loop). A fresh server costs about a second of CPU (an
interpreter and the SDK's imports), so the fresh-server runs default to fewer episodes and
their time for `--episodes` is extrapolated from their median; the pool runs do all of them.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from itertools import islice

from steprl.envs.adapters.mcp_pool import close_pools
from steprl.envs.adapters.mcp_yaml import make_mcp_env, mcp_spec
from steprl.envs.policy import Policy
from steprl.envs.task_file import TaskFile, with_task_file
from steprl.types import Task

TASKS = "configs/tasks/time_tasks.jsonl"
PARAMS = {
    "command": "mcp-server-time",
    "args": ["--local-timezone", "UTC"],
    "include_tools": ["convert_time"],
}


async def _episode(params: dict[str, object], task: Task, expert: Policy) -> float:
    start = time.perf_counter()
    env = make_mcp_env(**params)
    history: list[tuple[str, str]] = []
    await env.reset(task, task.seed)
    reward, rng = 0.0, random.Random(task.seed)
    for _ in range(4):
        action = expert(task, history, rng)
        out = await env.step(action)
        history.append((action, out.observation))
        if out.terminated:
            reward = out.reward
            break
    await env.close()
    if reward != 1.0:
        raise RuntimeError(f"the expert failed task {task.id}: {history}")
    return time.perf_counter() - start


def run(reuse: bool, n: int, concurrency: int, chunk: int, max_servers: int) -> tuple[float, list[float]]:
    params = {**PARAMS, "reuse": reuse, "max_servers": max_servers}
    spec = with_task_file(mcp_spec(params), TaskFile(TASKS))
    tasks = list(islice(spec.tasks("train", 0), n))
    expert = spec.strategies["expert"]

    async def step(batch: list[Task]) -> list[float]:
        gate = asyncio.Semaphore(concurrency)

        async def one(task: Task) -> float:
            async with gate:
                return await _episode(params, task, expert)

        return await asyncio.gather(*(one(t) for t in batch))

    durations: list[float] = []
    start = time.perf_counter()
    for i in range(0, n, chunk):
        durations += asyncio.run(step(tasks[i : i + chunk]))
    wall = time.perf_counter() - start
    close_pools()
    return wall, durations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=500)
    parser.add_argument("--fresh-episodes", type=int, default=40, help="episodes actually run per fresh mode")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=32, help="episodes per asyncio.run (a trainer step)")
    parser.add_argument("--max-servers", type=int, default=4, help="the pool's live servers")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    print(f"{'mode':<28} {'episodes':>8} {'wall s':>8} {'median ep s':>12} {f'{args.episodes} eps s':>10}")
    for reuse in (False, True):
        for concurrency in (1, args.concurrency):
            n = args.episodes if reuse else min(args.episodes, args.fresh_episodes)
            walls, medians = [], []
            for _ in range(args.repeats):
                wall, durations = run(reuse, n, concurrency, args.chunk, args.max_servers)
                walls.append(wall)
                medians.append(statistics.median(durations))
            wall = statistics.median(walls)
            name = (
                f"pool (max_servers {args.max_servers})" if reuse else "fresh server"
            ) + f", x{concurrency}"
            print(
                f"{name:<28} {n:>8} {wall:>8.1f} {statistics.median(medians):>12.3f} "
                f"{wall * args.episodes / n:>10.1f}"
            )


if __name__ == "__main__":
    main()
