"""`RayRolloutPool`: the agent loop on N `RolloutWorker` Ray actors, each with its own engine.

Each worker holds a full copy of the policy (an `HFEngine` on CPU), the prompt format (with its
tokenizer) and the context rule, all pickled into the actor once at start. It runs the ordinary
`steprl.rollout.loop.rollout_groups` on a contiguous share of the tasks, exactly as the trainer
does in-process (on the actor's event loop). Hence with ONE worker the groups are
bit-identical to in-process rollouts with the same engine seed, weights and torch thread count
(tested). With N workers, each share is rolled out with `first_index` = its first task's
position, so group ids and per-episode sampling seeds are those of one process rolling out the
whole batch: the same tokens as in-process (log-probs equal up to float rounding).

With cross-policy sampling (`engines/snapshots.py`) each worker's engine holds K versions,
rotated by the same `sync_weights` calls as in-process, so each worker holds the same snapshots;
a rebuilt worker replays the last K updates (and a resume's snapshots) to hold them too.

What it costs: N model copies in memory (N x K with cross-policy snapshots); one `ray.put` of
each weight bucket per `sync_weights` (each worker then reads its own copy, a bucket at a time); the model and
the latest weights stay in the object store so a dead worker can be rebuilt. If a worker dies
mid-rollout, its share comes back as `infra_failed` trajectories (trajectories in == out) and a
fresh worker, with the current weights and seed, takes its place.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import ray
import torch
from ray.exceptions import GetTimeoutError, RayError, RayTaskError

from steprl.engines.base import Generation, SamplingParams
from steprl.engines.delta import DeltaEncoder
from steprl.engines.hf import EngineSettings, HFEngine, probe_answer
from steprl.engines.transports import collective
from steprl.engines.transports.collective import GroupAddress
from steprl.engines.transports.ray_store import RayHandle, RayObjectStore
from steprl.engines.weights import AnyUpdate, WeightSyncError, WeightUpdate, as_update
from steprl.envs.base import Env
from steprl.envs.registry import get_spec, load_plugins
from steprl.hosting.ray_backend import ensure_ray
from steprl.rollout.chat import PromptFormat
from steprl.rollout.context import ContextRule
from steprl.rollout.loop import Budgets, RolloutSetup, failed_group, rollout_groups
from steprl.rollout.weight_group import WeightGroup
from steprl.rollout.worker_envs import WorkerEnvs, worker_envs
from steprl.types import Group, Task


class RolloutWorker:
    """One rollout actor: engine + env source + the agent loop. An async actor: every call runs
    on the actor's one event loop, so many `rollout` calls decode together in its engine and an
    `update_weights` lands between two decode steps of the rollouts in flight."""

    def __init__(
        self,
        model: torch.nn.Module,
        fmt: PromptFormat,
        *,
        pad_token_id: int,
        envs: WorkerEnvs,
        factories: Mapping[str, Callable[..., Env]],
        rule: ContextRule,
        sampling: SamplingParams,
        budgets: Budgets,
        engine_settings: EngineSettings,
        version: int,
        torch_threads: int,
    ) -> None:
        torch.set_num_threads(torch_threads)
        load_plugins(envs.plugins)
        self.engine = HFEngine.with_settings(  # on CPU (the worker's share of CPUs)
            model, engine_settings, eos_token_id=fmt.eos_token_id, pad_token_id=pad_token_id, version=version
        )
        make_env, self._backends = worker_envs(envs, factories)
        self.setup = RolloutSetup(make_env, self.engine, fmt, rule, sampling, budgets)

    async def rollout(
        self, tasks: Sequence[Task], group_size: int, seed: int, first_index: int
    ) -> list[Group]:
        return await rollout_groups(tasks, group_size, self.setup, seed=seed, first_index=first_index)

    async def update_weights(self, handle: RayHandle | AnyUpdate, version: int) -> bool:
        """Apply `version` (a pool's handle: its buckets read from the object store in order,
        one at a time) unless this worker already holds a newer one (checked on arrival: a late
        message never rolls the weights back). True if applied."""
        if version < self.engine.version:
            return False
        update = RayObjectStore().receive(handle) if isinstance(handle, RayHandle) else handle
        self.engine.update_weights(update, version)
        return True

    async def join_weights_group(self, address: GroupAddress, rank: int) -> None:
        """Join the pool's weights group (`runtime.weight_sync: broadcast`) as `rank`."""
        self._weights_group = collective.join(address, rank)

    async def receive_weights(self) -> int:
        """The update being broadcast on the weights group, loaded bucket by bucket as it comes
        (each checked: order, checksums). Returns its version."""
        update = collective.receive(self._weights_group)
        self.engine.update_weights(update, update.version)
        return update.version

    async def export_weights(self) -> RayHandle:
        """This worker's current weights in the object store: what a replaced peer copies
        between two broadcasts (sealed buckets, the tied head once)."""
        model = self.engine.model
        return RayObjectStore().send(WeightUpdate.of_tensors(model.state_dict(), self.engine.version))

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, seed: int | None
    ) -> Generation:
        """One request to this worker's engine: every request of a `PoolEngine` (evaluation when
        the trainer holds no engine)."""
        return await self.engine.generate(prompt_ids, sampling, seed=seed)

    async def probe(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        """The weight-sync probe (`training/loop/sync_check.py`) on this worker's current weights."""
        return await probe_answer(self.engine, prompt_ids, sampling)

    async def load_snapshots(self, state: Mapping[str, Any]) -> None:
        """A resume's cross-policy snapshots (`HFEngine.load_snapshots`)."""
        self.engine.load_snapshots(state)

    async def version(self) -> int:
        return self.engine.version

    async def pid(self) -> int:
        return os.getpid()


_RolloutWorkerActor = ray.remote(RolloutWorker)


def _without_capture_hooks(model: torch.nn.Module) -> torch.nn.Module:
    """`model`, or a copy without the forward hooks transformers 5 installs the first time a
    model runs with `output_hidden_states` (the learner's path): they are local functions, which
    pickle cannot ship to a worker, and transformers installs them again when needed."""

    def capture(hook: Any) -> bool:
        return "output_capturing_hook" in getattr(hook, "__qualname__", "")

    if not any(capture(h) for m in model.modules() for h in m._forward_hooks.values()):
        return model
    clean = copy.deepcopy(model)
    for m in clean.modules():
        for key in [k for k, h in m._forward_hooks.items() if capture(h)]:
            del m._forward_hooks[key]
    return clean


class RayRolloutPool:
    """`num_workers` rollout actors behind a synchronous, in-order `rollout_groups`."""

    def __init__(
        self,
        model: torch.nn.Module,
        fmt: PromptFormat,
        *,
        pad_token_id: int,
        num_workers: int,
        envs: WorkerEnvs,
        rule: ContextRule,
        sampling: SamplingParams,
        budgets: Budgets,
        engine_settings: EngineSettings,
        version: int = 0,
        cpus_per_worker: float = 1.0,
        torch_threads: int | None = None,
        rollout_timeout_s: float | None = None,
        start_timeout_s: float = 300.0,
        sync_timeout_s: float = 300.0,
        weight_sync: Literal["ray", "broadcast"] = "ray",
        weight_delta: bool = False,
    ) -> None:
        """`model` is copied into each worker (pickled once into the object store); each
        worker's engine has the run's `engine_settings`, as the in-process engine does.
        `rollout_timeout_s` bounds one `rollout_groups` call per worker; a worker past it is
        killed and replaced, its share `infra_failed` (None: no deadline beyond the env's)."""
        if num_workers < 1:
            raise ValueError(f"runtime.rollout_workers must be >= 1 for a RayRolloutPool, got {num_workers}.")
        # resolved here, then shipped to the workers
        factories = {r.key: get_spec(r.name, r.params).factory for r in envs.routes}
        ensure_ray()
        self.num_workers = num_workers
        self.rollout_timeout_s = rollout_timeout_s
        #: (worker index, why) for every worker replaced after dying or passing the deadline
        self.replaced: list[tuple[int, str]] = []
        self._version = version
        # what a rebuilt worker replays, in order, to hold what the others hold: the latest
        # weights; with cross-policy snapshots the last K versions' (and a resume's snapshots)
        self._replay: list[tuple[str, Any, int]] = []
        self._spawn_version = version
        cp = engine_settings.cross_policy
        self._keep = cp.snapshots if cp is not None else 1
        self._model_ref = ray.put(_without_capture_hooks(model))
        self._kwargs: dict[str, Any] = {
            "fmt": fmt,
            "pad_token_id": pad_token_id,
            "envs": envs,
            "factories": factories,
            "rule": rule,
            "sampling": sampling,
            "budgets": budgets,
            "engine_settings": engine_settings,
            "torch_threads": torch_threads or max(1, int(cpus_per_worker)),
        }
        self._start_timeout_s, self._sync_timeout_s = start_timeout_s, sync_timeout_s
        self._turn = -1  # the worker the last `generate` went to (round robin)
        # broadcast: full weights by a gloo group with the learner (adapters still by the store)
        self._group = WeightGroup(_group_host(), sync_timeout_s) if weight_sync == "broadcast" else None
        # delta: each sync the XOR against the version the workers hold (engines/delta.py)
        dtypes = {k: v.dtype for k, v in model.state_dict().items()}
        self._delta = DeltaEncoder(dtypes) if weight_delta else None
        self._syncing = False  # a sync in progress re-sends to a replaced worker itself
        self._replacing = threading.RLock()  # the rollout thread and the trainer's both replace
        self._orphan: str | None = None  # a replaced worker that could not get the weights
        self._options = {"num_cpus": cpus_per_worker, "scheduling_strategy": "SPREAD", "max_restarts": 0}
        self._workers = [self._spawn(k) for k in range(num_workers)]
        try:  # fail here, once, rather than as infra failures every step
            ray.get([w.pid.remote() for w in self._workers], timeout=start_timeout_s)
        except (GetTimeoutError, RayError) as exc:
            self.close()
            raise RuntimeError(
                f"{num_workers} rollout workers ({cpus_per_worker:g} CPU each) did not start within "
                f"{start_timeout_s:g}s: {exc}\nCheck `ray status` for free CPUs and that steprl is "
                "installed on every node."
            ) from None

    @property
    def version(self) -> int:
        return self._version

    def rollout_groups(
        self, tasks: Sequence[Task], group_size: int, *, seed: int, first_index: int = 0
    ) -> list[Group]:
        """`group_size` episodes of every task, split over the workers; groups in task order.
        `first_index`: the stream position of `tasks[0]` (it keys the episode seeds)."""
        self._check_orphan()
        tasks = list(tasks)
        shares = _split(len(tasks), self.num_workers)
        refs = [
            (k, lo, hi, self._workers[k].rollout.remote(tasks[lo:hi], group_size, seed, first_index + lo))
            for k, (lo, hi) in enumerate(shares)
            if hi > lo
        ]
        deadline = None if self.rollout_timeout_s is None else time.monotonic() + self.rollout_timeout_s
        groups: list[Group] = []
        for k, lo, hi, ref in refs:
            try:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                groups += ray.get(ref, timeout=timeout)
            except (GetTimeoutError, RayError) as exc:
                why = f"rollout worker {k} failed: {type(exc).__name__}"
                base = first_index + lo
                groups += [
                    failed_group(task, base + i, group_size, seed, why) for i, task in enumerate(tasks[lo:hi])
                ]
                self._replace(k, type(exc).__name__)
        return groups

    def start_group(self, task: Task, group_size: int, *, seed: int, index: int) -> tuple[Any, Any]:
        """Start one group on a worker (round robin by stream index, so a run's groups spread
        the same way each time): ((slot, actor), the ObjectRef of its `[Group]`)."""
        self._check_orphan()
        slot = index % self.num_workers
        worker = self._workers[slot]
        return (slot, worker), worker.rollout.remote([task], group_size, seed, index)

    def replace_dead(self, worker: tuple[int, Any], why: str) -> None:
        """Replace the worker of a failed call, once (its other calls fail with it)."""
        slot, actor = worker
        self._replace(slot, why, actor)

    def sync_weights(self, update: AnyUpdate, version: int) -> int | None:
        """Push new weights to every worker through the object store (`WEIGHT_SYNC["ray"]`:
        each bucket `ray.put` once, on CPU; each worker reads them in order). With LoRA, the
        adapters only; each worker merges them into its base copy. A rebuilt worker starts
        from the base and gets the latest update, which is all it needs: merges are from W0,
        not cumulative. With `weight_sync: broadcast`, full weights go by the weights group
        (`rollout/weight_group.py`) instead, to every worker at once; a worker that dies or
        hangs on the way is replaced and the update sent again. With `weight_delta`, full
        weights go as deltas against the workers' version (`engines/delta.py`); returns the
        bytes a worker received then (None: the update's own)."""
        update = as_update(update, version)
        if self._group is not None and update.adapter is None:
            self._sync_by_group(update)
            self._version, self._orphan = version, None
            return None
        if self._delta is not None and update.adapter is None:
            update = self._delta.encode(update)
        handle = RayObjectStore().send(update)
        self._version = version
        # a delta replays to nobody: a worker started later gets the encoder's full copy (None)
        self._remember(("update_weights", None if update.delta_from is not None else handle, version))
        self._broadcast("update_weights", lambda k: (handle, version))
        if self._delta is not None:  # every worker holds it now: the next delta is against it
            self._delta.commit()
            return update.nbytes  # in the engines' dtype
        return None

    def _sync_by_group(self, update: WeightUpdate) -> None:
        assert self._group is not None
        self._syncing = True
        try:
            for _ in range(3):  # a dead worker found, replaced inside a broadcast, then a last try
                workers = list(self._workers)  # as they were (the rollout thread may replace one)
                failed = self._group.sync(update, workers)
                if not failed:
                    return
                for k, (why, dead) in failed.items():
                    if dead:
                        self._replace(k, why, workers[k])
            raise WeightSyncError(
                f"the weight sync to version {update.version} failed three times by broadcast: "
                + "; ".join(f"rollout worker {k} {why}" for k, (why, _) in failed.items())
            )
        finally:
            self._syncing = False

    def _copy_from_peer(self, index: int) -> None:
        """A worker replaced between two broadcasts copies the current weights from another
        (its `export_weights`): the learner is busy with the next update and may hold newer ones."""
        for k, peer in enumerate(self._workers):
            if k == index:
                continue
            try:
                wait = self._sync_timeout_s
                handle = ray.get(peer.export_weights.remote(), timeout=wait)
                ray.get(self._workers[index].update_weights.remote(handle, self._version), timeout=wait)
                return
            except (GetTimeoutError, RayError):
                continue
        self._orphan = (
            f"rollout worker {index} was replaced and no other worker could give it version "
            f"{self._version} (runtime.weight_sync: broadcast sends weights only at a sync); "
            "resume from the last checkpoint, or use runtime.weight_sync: ray"
        )

    def _check_orphan(self) -> None:
        if self._orphan is not None:
            raise WeightSyncError(self._orphan)

    def load_snapshots(self, state: Mapping[str, Any]) -> None:
        """A resume's cross-policy snapshots to every worker (before the current weights)."""
        ref = ray.put(dict(state))
        self._replay, self._spawn_version = (
            [("load_snapshots", ref, int(state["version"]))],
            int(state["version"]),
        )
        self._broadcast("load_snapshots", lambda k: (ref,))

    def _remember(self, entry: tuple[str, Any, int]) -> None:
        if self._keep == 1:
            self._replay, self._spawn_version = [entry], entry[2]
            return
        self._replay.append(entry)
        versions = sorted({v for m, _, v in self._replay if m == "update_weights"})
        if len(versions) > self._keep:  # the oldest version is out of every snapshot: start after it
            first = versions[-self._keep]
            self._replay = [e for e in self._replay if e[0] == "update_weights" and e[2] >= first]
            self._spawn_version = first

    def worker_pids(self) -> list[int]:
        return [int(p) for p in ray.get([w.pid.remote() for w in self._workers])]

    def close(self) -> None:
        """Kill the workers (env actors they own die with them). Idempotent."""
        for w in self._workers:
            ray.kill(w, no_restart=True)

    def probe(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> dict[str, Generation]:
        """Each worker's answer to the weight-sync probe; a worker that dies or passes the sync
        deadline is replaced (it starts with the current weights) and gives no answer."""
        answers = self._broadcast("probe", lambda k: (list(prompt_ids), sampling))
        return {f"rollout worker {k}": gen for k, gen in answers.items()}

    def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams, seed: int | None) -> Any:
        """One request on the next worker in turn: the ObjectRef of its `Generation`."""
        self._turn = (self._turn + 1) % self.num_workers
        return self._workers[self._turn].generate.remote(list(prompt_ids), sampling, seed)

    def _broadcast(self, method: str, args: Callable[[int], tuple[Any, ...]]) -> dict[int, Any]:
        """`method` on every worker, each answer within the sync deadline. A worker that dies or
        hangs is rebuilt with the current weights; a weight bucket refused in flight (its
        checksum, its order) stops the run: re-sending the same objects cannot mend it."""
        refs = [getattr(w, method).remote(*args(k)) for k, w in enumerate(self._workers)]
        deadline = time.monotonic() + self._sync_timeout_s
        answers = {}
        for k, ref in enumerate(refs):
            try:
                answers[k] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                if isinstance(cause, WeightSyncError):
                    raise WeightSyncError(f"rollout worker {k}: {cause}") from None
                self._replace(k, type(exc).__name__)
            except (GetTimeoutError, RayError) as exc:  # dead, or past the deadline: rebuilt
                self._replace(k, type(exc).__name__)
        return answers

    def _spawn(self, index: int) -> Any:
        worker: Any = _RolloutWorkerActor.options(**self._options).remote(
            self._model_ref, version=self._spawn_version, **self._kwargs
        )
        # an async actor runs calls as their arguments arrive, not in submission order: several
        # (cross-policy snapshots rotate with each) go one at a time, and before any rollout
        for method, ref, version in self._replay:
            if ref is None and self._delta is not None:  # after a delta: what the others hold, whole
                ref = RayObjectStore().send(self._delta.full())
            call = (
                worker.load_snapshots.remote(ref)
                if method == "load_snapshots"
                else worker.update_weights.remote(ref, version)
            )
            if len(self._replay) > 1:
                try:
                    ray.get(call, timeout=self._start_timeout_s)
                except (GetTimeoutError, RayError):
                    break  # a worker that cannot start fails its next call, and is replaced then
        return worker

    def _replace(self, index: int, why: str, actor: Any = None) -> None:
        """A fresh worker in slot `index` (only if it still holds `actor`, when given: the
        rollout thread and a sync may both find the same dead worker)."""
        with self._replacing:
            if actor is not None and self._workers[index] is not actor:
                return
            self._replace_now(index, why)

    def _replace_now(self, index: int, why: str) -> None:
        ray.kill(self._workers[index], no_restart=True)
        self._workers[index] = self._spawn(index)
        self.replaced.append((index, why))
        if self._group is not None:  # the group lost a member; between syncs, a peer's weights
            self._group.stale()
            if not self._syncing and self._version != self._spawn_version:
                self._copy_from_peer(index)


def _group_host() -> str:
    """Where the weights group's store listens: loopback on one node, else this node's address."""
    return "127.0.0.1" if len(ray.nodes()) <= 1 else ray.util.get_node_ip_address()


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) shares of n items whose sizes differ by at most one."""
    bounds = [n * k // parts for k in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))
