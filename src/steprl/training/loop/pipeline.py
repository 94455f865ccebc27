"""The rollout pipeline: producers run episodes from the task stream while the learner trains.

    task source ──admit──▶ producer (engine + envs, in a thread or on Ray workers) ──▶ finished
    groups (a bounded queue) ──take──▶ learner ──publish(version)──▶ producer's engines

Versions and staleness (`rollout.max_staleness` = k, counted in policy versions):

- The policy version is the number of weight publications: one per trained RL step, however many
  optimizer steps (`trainer.epochs` x `trainer.mini_batches` = m) that step takes. So a sample
  trained at staleness s is up to s*m + m-1 optimizer steps old; `staleness/optimizer_steps_max`
  reports that bound for each step, and decoupled PPO's proximal policy (the weights at the start
  of the step) is what absorbs it.
- A token's version is that of the weights that sampled it (weights change between decode steps,
  so one turn may span versions: a partial rollout). A trajectory's staleness when trained at
  version v is v - (its oldest token's version).
- Admission control (AReaL's rule): each time the learner asks for a step's groups, the producer
  may hold up to (k+1) x `tasks_per_step` groups in flight or finished. A group admitted at version
  u is then at most k steps behind if groups are consumed in order.
- Eviction when consumed: the learner takes the oldest finished groups first; one whose staleness
  is over k (it was overtaken while its episodes ran) is dropped, counted, and its task given
  back to the task source (`requeue`), which re-issues it first, to run again on the current
  weights. No task is lost or trained twice (but by a health rollback with `replay`, on purpose).
  Every group trained is shown to the source (`observe`), in stream order, so the order a
  learning source sees never depends on timing.
- k = 0 is synchronous training on this same path: the window opens only when the learner asks,
  so the step's tasks all run on the current weights while the learner waits, exactly as before.

What is in flight or queued at a checkpoint is `pending()`: those tasks are saved in `TrainState`,
given back to the (restored) source on resume and re-issued first, with their own stream
positions (so their episode seeds).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from steprl.diagnostics.metrics import is_success
from steprl.engines.base import Generation, SamplingParams
from steprl.engines.weights import WeightUpdate
from steprl.training.sources import TaskSource
from steprl.types import Group, Task

T = TypeVar("T")
#: (stream index, finished group): how a producer hands a group back (from any thread)
Done = Callable[[int, Group], None]
#: what happens to the task of a group evicted as too stale (`rollout.max_staleness`): requeue:
#: it runs again, first, on the current weights (long episodes may be overtaken again, and are
#: trained less: docs/async.md measures it); age_priority: the same, and the learner then waits
#: for that re-run before it publishes again, so it is trained (at staleness 0), never overtaken
Eviction = Literal["requeue", "age_priority"]
EVICTION: tuple[Eviction, ...] = ("requeue", "age_priority")


class Producer(Protocol):
    """Runs groups of episodes somewhere, continuously, and takes new weights between decode steps."""

    def start(self, items: Sequence[tuple[int, Task]], done: Done, *, max_turns: int | None = None) -> None:
        """Begin `group_size` episodes of each (stream position, task), all in one go (so
        which requests share the engine's first batch never depends on thread timing); call
        `done` once per group. `max_turns`: their turn cap (None: the configured one)."""
        ...

    def publish(self, weights: WeightUpdate, version: int) -> int | None:
        """New weights for every engine copy; episodes in flight continue on them. Returns the
        bytes one engine received where the transport changed them (a delta), else None."""
        ...

    def probe(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> dict[str, Generation]:
        """Each engine copy's answer to the weight-sync probe, by a name for the one-line error
        (`sync_check.py`); a copy that died and was replaced may be missing."""
        ...

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` where the in-process engine lives (evaluation)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Finished:
    index: int  # stream position of the task
    group: Group
    admitted: int  # the policy version when the group was admitted

    @property
    def oldest(self) -> int:
        """The version of the group's oldest sampled token (its admission version if none)."""
        return min((v for t in self.group.trajectories for v in t.token_versions), default=self.admitted)


@dataclass
class _Counters:
    """What happened since the learner's previous take (reset by `take_metrics`)."""

    evicted: int = 0
    admitted: int = 0
    version_errors: int = 0
    producer_idle_s: float = 0.0
    since: float = 0.0


class Pipeline:
    """Admission, the queue of finished groups, eviction, weight publication, pending work."""

    def __init__(
        self,
        tasks: TaskSource,
        producer: Producer,
        *,
        tasks_per_step: int,
        max_staleness: int,
        version: int,
        pending: Sequence[tuple[int, Task]] = (),
        eviction: Eviction = "requeue",
        snapshot_lag: int = 0,
    ) -> None:
        self.tasks = tasks
        #: cross-policy sampling (`engines/snapshots.py`) samples turns on purpose up to
        #: this many versions behind the current one: allowed on top of `max_staleness`
        self.snapshot_lag = snapshot_lag
        self.producer = producer
        self.max_staleness = max_staleness
        self.window = (max_staleness + 1) * tasks_per_step  # the bound on the queue + in flight
        self.version = version
        self._cv = threading.Condition()
        self._in_flight: dict[int, tuple[Task, int]] = {}  # index -> (task, admission version)
        self._finished: list[Finished] = []
        for index, task in pending:  # a resume: re-issued first
            tasks.requeue(index, task)
        now = time.perf_counter()
        self._idle_since: float | None = now
        self._counters = _Counters(since=now)
        #: what an evicted group's task gets (EVICTION): with age_priority, the positions of the
        #: re-runs the learner waits for (each trained in the take that evicted it, at staleness 0)
        self.eviction, self._owed = eviction, set[int]()
        #: the groups taken since the last `take_metrics`, each with the version it trains at
        self.taken: list[tuple[Finished, int]] = []
        #: the turn cap of the tasks admitted from now on (a horizon curriculum's; None: the
        #: configured one). Fixed at admission: a group admitted ahead keeps the cap it ran under.
        self.max_turns: int | None = None
        #: the oldest version a trained token may come from (a rollback's: the policy it undid
        #: must not be trained on, however fresh its groups are by `max_staleness`)
        self.floor = 0
        #: the tasks the last step took (rolled out; trained, or filtered out), by stream position
        self.step_tasks: list[tuple[int, Task]] = []

    # ---- the learner's side -------------------------------------------------------------------

    def take(self, n: int) -> list[Group]:
        """`n` finished groups (fewer only if the task stream ran out), oldest first by the
        version of their oldest token, returned in stream order. Opens the admission window
        first, so at k = 0 this is exactly a synchronous rollout of the next `n` tasks."""
        picked: list[Finished] = []
        with self._cv:
            self._top_up()
            while len(picked) < n:
                self._finished.sort(key=lambda f: (f.index not in self._owed, f.oldest, f.index))
                # (age_priority: a place kept for each owed re-run still running)
                while self._finished and len(picked) + len(self._owed & self._in_flight.keys()) < n:
                    f = self._finished.pop(0)
                    too_old = self.version - f.oldest > self.max_staleness + self.snapshot_lag
                    too_old = too_old or f.oldest < self.floor - self.snapshot_lag
                    if too_old or not self._versions_ok(f):
                        self._counters.evicted += 1  # overtaken while it ran: run it again
                        if self.eviction == "age_priority":
                            self._owed.add(f.index)
                        self.tasks.requeue(f.index, f.group.task)
                        self._top_up()
                    else:
                        picked.append(f)
                if len(picked) >= n or not (self._in_flight or self._finished):
                    break  # done, or the source ran out with nothing left to wait for
                self._cv.wait()
            self._owed -= {f.index for f in picked}
        picked.sort(key=lambda f: f.index)
        for f in picked:
            self.tasks.observe(f.group)
        self.taken += [(f, self.version) for f in picked]  # the weights they are trained from
        return [f.group for f in picked]

    def publish(self, weights: WeightUpdate, version: int) -> int | None:
        """The learner's new weights to every engine as `version` (the bytes an engine got,
        where the transport changed them)."""
        sent = self.producer.publish(weights, version)
        with self._cv:
            self.version = version
        return sent

    def roll_back(self, weights: WeightUpdate, version: int) -> None:
        """Restored weights (a health rollback) as the new `version`: groups queued or in flight
        that the undone versions sampled are evicted and run again, at any `max_staleness`."""
        self.publish(weights, version)
        with self._cv:
            self.floor = version

    def replay(self, items: Sequence[tuple[int, Task]]) -> None:
        """Serve these tasks again, before any new one (a rollback that replays its steps)."""
        with self._cv:
            for index, task in items:
                self.tasks.requeue(index, task)

    def pending(self) -> list[tuple[int, Task]]:
        """Tasks admitted but not yet trained (in flight or queued), in stream order. (An evicted
        task is back in the task source, whose state the checkpoint holds.)"""
        with self._cv:
            items = [(i, t) for i, (t, _) in self._in_flight.items()]
            items += [(f.index, f.group.task) for f in self._finished]
        return sorted(items, key=lambda p: p[0])

    def depth(self) -> tuple[int, int]:
        """(finished groups queued, groups in flight) now."""
        with self._cv:
            return len(self._finished), len(self._in_flight)

    def take_metrics(self, optimizer_steps: int) -> dict[str, float]:
        """Staleness, queue and idle metrics of the step just taken (`taken`), then reset."""
        with self._cv:
            now = time.perf_counter()
            c = self._counters
            idle = c.producer_idle_s + (now - self._idle_since if self._idle_since is not None else 0.0)
            self._idle_since = now if self._idle_since is not None else None
            self._counters = _Counters(since=now)
            queued, in_flight = len(self._finished), len(self._in_flight)
        out = staleness_metrics(self.taken, self.max_staleness, optimizer_steps)
        out |= horizon_metrics(self.taken, self.max_turns)
        self.step_tasks = [(f.index, f.group.task) for f, _ in self.taken]
        self.taken = []
        return out | {
            "async/queue_depth": float(queued),
            "async/in_flight": float(in_flight),
            "async/admitted_groups": float(c.admitted),
            "async/evicted_groups": float(c.evicted),  # each one's task was re-queued
            "async/version_errors": float(c.version_errors),
            "time/producer_idle_share": idle / max(now - c.since, 1e-9),
        }

    # ---- the producer's side ------------------------------------------------------------------

    def _done(self, index: int, group: Group) -> None:
        with self._cv:
            _, admitted = self._in_flight.pop(index)
            self._finished.append(Finished(index, group, admitted))
            if not self._in_flight:
                self._idle_since = time.perf_counter()
            self._cv.notify_all()

    def _top_up(self) -> None:
        """Admit tasks from the source (it gives re-queued ones first) while fewer than `window`
        are in flight or queued."""
        admitted: list[tuple[int, Task]] = []
        while len(self._in_flight) + len(self._finished) < self.window:
            item = self.tasks.next()
            if item is None:
                break
            index, task = item
            if self._idle_since is not None:
                self._counters.producer_idle_s += time.perf_counter() - self._idle_since
                self._idle_since = None
            self._in_flight[index] = (task, self.version)
            self._counters.admitted += 1
            admitted.append((index, task))
        if admitted:
            if self.max_turns is None:
                self.producer.start(admitted, self._done)
            else:
                self.producer.start(admitted, self._done, max_turns=self.max_turns)

    def _versions_ok(self, f: Finished) -> bool:
        """Every token of a returned group was sampled by a version published since its admission
        (a worker that missed an update, or reports one it never got, is caught here)."""
        versions = [v for t in f.group.trajectories for v in t.token_versions]
        ok = all(f.admitted - self.snapshot_lag <= v <= self.version for v in versions)
        if not ok:
            self._counters.version_errors += 1
        return ok

    def close(self) -> None:
        self.producer.close()


def staleness_metrics(
    taken: Sequence[tuple[Finished, int]], max_staleness: int, optimizer_steps: int
) -> dict[str, float]:
    """Histograms (fractions per staleness 0..k) at trajectory and token level, their means, the
    versions a trajectory spans, and the optimizer-step bound of the oldest sample. `taken`:
    (group, the version it is trained at)."""
    traj, tokens, spans = [], [], []
    for f, version in taken:
        for t in f.group.trajectories:
            versions = t.token_versions or (f.admitted,)
            traj.append(version - min(versions))
            tokens += [version - v for v in t.token_versions]
            spans.append(max(versions) - min(versions) + 1)
    out: dict[str, float] = {}
    for name, values in (("traj", traj), ("token", tokens)):
        n = max(len(values), 1)
        for s in range(max_staleness + 1):
            out[f"staleness/{name}_{s}"] = sum(v == s for v in values) / n
        out[f"staleness/{name}_mean"] = sum(values) / n
    worst = max(traj, default=0)
    out["staleness/traj_max"] = float(worst)
    out["staleness/optimizer_steps_max"] = float(worst * optimizer_steps + optimizer_steps - 1)
    out["async/versions_spanned_mean"] = sum(spans) / max(len(spans), 1)
    out["async/versions_spanned_max"] = float(max(spans, default=0))
    return out


def horizon_metrics(taken: Sequence[tuple[Finished, int]], cap: int | None) -> dict[str, float]:
    """What a horizon curriculum reads (`training/controllers/horizon_gated.py`) and the report
    shows: the cap of the tasks admitted now (None: the trained episodes' mean cap), and, over the
    episodes that ran under the current `cap` (a stale sample ran under its own; None: all), the
    success rate and the share the cap cut off."""
    trajs = [t for f, _ in taken for t in f.group.trajectories if t.trainable]
    at_cap = [t for t in trajs if cap is None or t.info.get("turn_cap") == cap]
    n = max(len(at_cap), 1)
    mean_cap = sum(float(t.info.get("turn_cap", 0)) for t in trajs) / max(len(trajs), 1)
    return {
        "curriculum/max_turns": float(cap) if cap is not None else mean_cap,
        "curriculum/episodes_at_cap": float(len(at_cap)),
        "curriculum/success_at_cap": sum(is_success(t) for t in at_cap) / n,
        "curriculum/cut_by_cap_frac": sum(bool(t.info.get("cut_by_cap")) for t in at_cap) / n,
    }


def describe_pending(pending: Sequence[tuple[int, Task]]) -> str:
    """One line for the tasks admitted but not trained when a run ends (an asynchronous run
    admits up to `max_staleness` steps ahead): how many, and their stream positions as ranges."""
    indices = sorted(i for i, _ in pending)
    runs = [[i for _, i in g] for _, g in itertools.groupby(enumerate(indices), lambda p: p[1] - p[0])]
    spans = ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
    return (
        f"{len(indices)} task{'s' * (len(indices) != 1)} admitted but not trained (stream indices "
        f"{spans}): in flight or queued when the run ended; the checkpoint keeps them, and a "
        "resumed or extended run (trainer.total_steps) trains them first"
    )
