"""Where a pipeline's episodes run (`pipeline.Producer`): in this process, or on Ray rollout workers.

`LocalProducer` runs one asyncio loop in a background thread: the in-process engine's scheduler
and every episode live there, so rollouts go on while the learner trains in the main thread
(torch releases the GIL in its kernels). New weights are applied *on* that loop, which the
engine's scheduler yields to between decode steps: never inside a forward pass.

`RayProducer` sends each group to the least-loaded `RolloutWorker` actor (an async actor, so
one worker runs many groups at once and takes weight updates while they decode) and collects
finished groups in a waiter thread. Weights go out once per version (`ray.put`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from steprl.engines.base import Generation, SamplingParams
from steprl.engines.hf import HFEngine, probe_answer
from steprl.engines.weights import WeightUpdate
from steprl.rollout.loop import RolloutSetup, failed_group, rollout_groups
from steprl.training.loop.pipeline import Done
from steprl.types import Task

T = TypeVar("T")


class LocalProducer:
    """The agent loop on a background event loop, with the trainer's engine and env pool."""

    def __init__(self, setup: RolloutSetup, engine: HFEngine, *, group_size: int, seed: int) -> None:
        self.setup, self.engine, self.group_size, self.seed = setup, engine, group_size, seed
        self._loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name="steprl-rollouts", daemon=True)
        self._thread.start()

    def start(self, items: Sequence[tuple[int, Task]], done: Done, *, max_turns: int | None = None) -> None:
        # the turn cap fixed at admission (a horizon curriculum's), however late the episodes run
        setup = self.setup
        if max_turns is not None:
            setup = replace(setup, budgets=replace(setup.budgets, max_turns=max_turns))

        async def one(index: int, task: Task) -> None:
            try:
                groups = await rollout_groups(
                    [task], self.group_size, setup, seed=self.seed, first_index=index
                )
                group = groups[0]
            except Exception as exc:  # rollout_groups catches env errors; this is a bug guard
                group = failed_group(task, index, self.group_size, self.seed, f"{type(exc).__name__}: {exc}")
            done(index, group)

        def schedule() -> None:  # on the loop, all at once, in the order they were admitted
            for index, task in items:
                t = self._loop.create_task(one(index, task))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)

        self._loop.call_soon_threadsafe(schedule)

    def publish(self, weights: WeightUpdate, version: int) -> int | None:
        async def apply() -> None:
            self.engine.update_weights(weights, version=version)

        self.run(apply())
        return None

    def probe(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> dict[str, Generation]:
        """The engine's answer to the weight-sync probe, beside the episodes in flight."""
        return {"the engine": self.run(probe_answer(self.engine, prompt_ids, sampling))}

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        """Cancel what is in flight (the pending tasks are in the checkpoint) and stop the loop."""
        if not self._loop.is_running():
            return

        async def cancel() -> None:  # episodes and the engine's scheduler alike
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in others:
                t.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            self.engine.reset_scheduler()  # the engine may serve another loop after this one

        try:
            asyncio.run_coroutine_threadsafe(cancel(), self._loop).result(timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)


class RayProducer:
    """Groups on Ray rollout workers (`steprl.rollout.ray_workers.RayRolloutPool`)."""

    def __init__(self, pool: Any, engine: HFEngine, *, group_size: int, seed: int) -> None:
        self.pool, self.engine, self.group_size, self.seed = pool, engine, group_size, seed
        self._lock = threading.Lock()
        self._refs: dict[Any, tuple[int, Task, Any, Done]] = {}  # ref -> (index, task, worker, done)
        self._stop = threading.Event()
        self._waiter = threading.Thread(target=self._wait, name="steprl-ray-rollouts", daemon=True)
        self._waiter.start()

    def start(self, items: Sequence[tuple[int, Task]], done: Done, *, max_turns: int | None = None) -> None:
        if max_turns is not None:  # the config refuses it (trainer.curriculum with rollout workers)
            raise NotImplementedError("a per-task turn cap (trainer.curriculum) on Ray rollout workers")
        with self._lock:
            for index, task in items:
                worker, ref = self.pool.start_group(task, self.group_size, seed=self.seed, index=index)
                # `worker`: (slot, actor), to replace that actor once if it died
                self._refs[ref] = (index, task, worker, done)

    def publish(self, weights: WeightUpdate, version: int) -> int | None:
        self.engine.update_weights(weights, version=version)  # the trainer's copy (separate: none)
        sent: int | None = self.pool.sync_weights(weights, version=version)
        return sent

    def probe(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> dict[str, Generation]:
        """Every rollout worker's answer to the probe, and the trainer's evaluation copy's (none
        with `runtime.placement: separate`: its engine is the pool's)."""
        answers = self.pool.probe(prompt_ids, sampling)
        if getattr(self.engine, "pool", None) is not self.pool:
            answers["the trainer's engine"] = asyncio.run(probe_answer(self.engine, prompt_ids, sampling))
        return answers

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run(coro)  # evaluation: on the trainer's engine, or (separate) the workers'

    def _wait(self) -> None:
        import ray

        while not self._stop.is_set():
            with self._lock:
                refs = list(self._refs)
            if not refs:
                self._stop.wait(0.01)
                continue
            ready, _ = ray.wait(refs, num_returns=1, timeout=0.1)
            for ref in ready:
                with self._lock:
                    index, task, worker, done = self._refs.pop(ref)
                try:
                    group = ray.get(ref)[0]
                except Exception as exc:  # a dead worker: its groups fail, a fresh one replaces it
                    why = f"rollout worker {worker[0]} failed: {type(exc).__name__}"
                    group = failed_group(task, index, self.group_size, self.seed, why)
                    self.pool.replace_dead(worker, type(exc).__name__)
                done(index, group)

    def close(self) -> None:
        self._stop.set()
        self._waiter.join(timeout=30)


__all__ = ["LocalProducer", "RayProducer"]
