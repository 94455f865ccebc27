"""`admission`: a live set of tasks admitted by the learner's pass rate on their shape, retired
when mastered, replaced from the env's stream without restarting the run (resume-exact).

Built for synthesized envs (`steprl synth`), whose train split is a generator of new validated
tasks that never ends, and whose tasks carry a DAG `shape` (`task.params["shape"]`); on any
other env a task's shape is its env key.

* **Active set**: up to `active` tasks, served round-robin (each serve a new stream position,
  so new episode seeds).
* **Retire**: a task whose last `window` trained groups all reached a mean success of
  `retire_at` or more leaves the set (mastered) and is counted in `source/retired`; one whose
  last `window` groups all failed every episode leaves it too (`source/parked`: beyond the
  learner for now, and a group of equal rewards teaches GRPO nothing).
* **Admit**: the set is refilled from the stream; a candidate is admitted unless its shape's
  pass rate (the mean of its tasks' last group means, over the last `window` x `active` groups
  of that shape) is above `band[1]` (a shape the learner has mastered) or below `band[0]` (one
  it cannot do yet), or, while the set's expected pass rate (trained tasks: their last group;
  new ones: their shape's rate) is outside the band's middle half, would move it further out:
  the candidate is passed over (the stream is asked for the next), so the set is refilled with
  the shapes still being learned, on the side it needs, which keeps the admitted pass rate
  inside the band from both sides. After `max_skips` refusals in a row a candidate is
  admitted anyway (a stream of such shapes only must not stall the run): the one **nearest the
  band's middle** among those passed over (`reserve`: the last `active` of them, ranked by their
  shape's current rate), on probation unless `probe: none`. A learner that is below the band on
  every shape still does some of them sometimes; this serves its best shapes and keeps the tasks
  it is measured to solve sometimes. Until a candidate is admitted on its shape's rate again,
  each admission pulls one candidate and admits it if it is admissible, else the reserve's
  nearest, rather than pass over another `max_skips`.
* **Probation** (`probe`): a candidate may be admitted on what its own first group measures
  rather than on its shape's rate: it is served once, and its first group decides. Inside the
  band it is admitted; above or below it the task leaves at once (`source/rejected`) and the next
  candidate takes its place. `probe: unseen` (the default) does this for candidates of a shape
  with no rate yet, which is every candidate of the first set: nothing is known of the learner
  before its first groups, and a set admitted blind starts wherever the stream put it. `probe:
  all` does it for every candidate (and `unseen` also for one admitted from the reserve, whose
  shape's rate says it is outside the band): the set is then made of tasks measured to be solved
  sometimes, but a small model at T=1 solves most tasks always or never, so most candidates
  are rejected, admitted tasks are soon mastered, and the admitted set runs thin (measured in
  docs/synthesis.md). `probe: none` admits on shape rates alone. A probation group is trained
  like any other (under GRPO a group of equal rewards has no advantage). prime-rl's difficulty
  pools and DAPO's dynamic sampling filter the same way, per batch, after the fact; here it
  decides what the set keeps.
* **Logged** every step (`metrics`): `source/active`, `source/admitted`, `source/retired`,
  `source/parked`, `source/skipped` (of which `source/skipped_hard` below the band),
  `source/admitted_anyway` (of the skipped, those admitted from the reserve: the stream showed nothing in
  the band for this learner), `source/probation` and `source/rejected` (with `probe`),
  `source/pass_rate` (the admitted tasks' mean last group success: the admitted pass rate,
  which the band is for; tasks on probation are not admitted yet), `source/in_band` (1 when it
  lies in `band`), and `source/shape_rate/<shape>` per shape rated so far (the rate candidates of
  that shape are admitted or passed over on).

Its state: the next position, how many stream tasks were read (a resume re-reads the stream and
skips them: the split is a pure function of the seed), the active tasks, each one's recent
group means, each shape's recent means, the tasks on probation (and which of them are out), the
reserve and whether admissions draw on it (`dry`), the counters and the re-queued tasks.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

from steprl.diagnostics.metrics import is_success
from steprl.training.sources.splits import TaskSplits
from steprl.training.state import task_dict, task_from_dict
from steprl.types import Group, Task

#: `probe`: which candidates are admitted on their own first group (see the module docstring)
PROBES = ("unseen", "all", "none")


def shape_of(task: Task) -> str:
    return str(task.params.get("shape", task.env))


class AdmissionSource:
    def __init__(
        self,
        tasks: TaskSplits,
        seed: int = 0,
        active: int = 32,
        band: list[float] | None = None,
        retire_at: float = 0.9,
        window: int = 2,
        max_skips: int = 200,
        probe: str = "unseen",
    ) -> None:
        band = [0.2, 0.8] if band is None else list(band)
        if len(band) != 2 or not 0.0 <= band[0] < band[1] <= 1.0:
            raise ValueError(f"band: needs [low, high] with 0 <= low < high <= 1, got {band}")
        low, high = float(band[0]), float(band[1])
        if active < 1 or window < 1 or max_skips < 0 or not 0.0 < retire_at <= 1.0:
            raise ValueError("active >= 1, window >= 1, max_skips >= 0 and retire_at in (0, 1]")
        if probe not in PROBES:
            raise ValueError(f"probe: one of {', '.join(PROBES)}, got {probe!r}")
        self._splits, self.seed, self.probe = tasks, seed, probe
        self.size, self.band, self.retire_at, self.window, self.max_skips = (
            active,
            (low, high),
            retire_at,
            window,
            max_skips,
        )
        self._stream: Iterator[Task] = tasks()
        self.read = 0  # stream tasks read so far
        self.cursor = 0  # the next position
        self.active: list[Task] = []
        self.history: dict[str, deque[float]] = {}  # task id -> its last `window` group means
        self.shapes: dict[str, deque[float]] = {}  # shape -> its tasks' recent group means
        self.admitted = self.retired = self.skipped = self.parked = self.skipped_hard = 0
        self.rejected = self.anyway = 0  # anyway: admitted from the reserve, after `max_skips`
        self.probation: set[str] = set()  # ids of active tasks whose first group decides
        self.out: set[str] = set()  # of those, the ones served whose group has not come back
        self.reserve: list[Task] = []  # the last `active` candidates passed over (stream order)
        self.dry = False  # `max_skips` refusals in a row, nothing admissible since: see _refill
        self.exhausted = False
        self._requeued: list[tuple[int, Task]] = []

    # -- serving ---------------------------------------------------------------------------
    def next(self) -> tuple[int, Task] | None:
        if self._requeued:
            index, task = self._requeued.pop(0)
        else:
            self._refill()
            if not self.active:
                return None
            # round-robin, passing over a task on probation whose one group is still out (several
            # steps in flight, or a set smaller than a step): its first group decides alone
            n = len(self.active)
            order = (self.active[(self.cursor + j) % n] for j in range(n))
            task = next((t for t in order if t.id not in self.out), self.active[self.cursor % n])
            index = self.cursor
            self.cursor += 1
        if task.id in self.probation:
            self.out.add(task.id)
        return index, task

    def requeue(self, index: int, task: Task) -> None:
        self.out.discard(task.id)
        bisect.insort(self._requeued, (index, task), key=lambda p: p[0])

    def _pull(self) -> Task | None:
        task = next(self._stream, None)
        if task is None:
            self.exhausted = True
            return None
        self.read += 1
        return task

    def shape_rate(self, shape: str) -> float | None:
        means = self.shapes.get(shape)
        return sum(means) / len(means) if means else None

    def _projected(self) -> list[float]:
        """The active set's expected success per task: a trained task's last group mean, a new
        one's shape rate (unknown shapes left out)."""
        out = []
        for t in self.active:
            known = self.history.get(t.id)
            rate = known[-1] if known else self.shape_rate(shape_of(t))
            if rate is not None:
                out.append(rate)
        return out

    def _nearest(self) -> Task:
        """Take the reserve's candidate whose shape's rate is nearest the band's middle (ties: the
        first passed over). Only rated candidates are passed over, and a shape's rate never
        becomes unknown again, so every rate here is known."""
        middle = sum(self.band) / 2
        rates = [self.shape_rate(shape_of(t)) for t in self.reserve]
        far = [abs((middle if r is None else r) - middle) for r in rates]
        return self.reserve.pop(far.index(min(far)))

    def _admit(self, task: Task, rate: float | None, *, fallback: bool) -> None:
        self.active.append(task)
        self.anyway += fallback
        probe = self.probe == "all" or (self.probe == "unseen" and (rate is None or fallback))
        if probe:
            self.probation.add(task.id)
        else:
            self.admitted += 1

    def _refill(self) -> None:
        skips = 0
        low, high = self.band
        # steer only outside the band's middle half: inside it, no candidate is passed over
        calm = (low + (high - low) / 4, high - (high - low) / 4)
        while len(self.active) < self.size:
            pulled = self._pull()
            if pulled is None:
                if self.dry and self.reserve:  # the stream ended: what it passed over is left
                    self._admit(self._nearest(), None, fallback=True)
                    continue
                return
            task, rate = pulled, self.shape_rate(shape_of(pulled))
            outside = rate is not None and not self.band[0] <= rate <= self.band[1]
            # steer: while the set's expected rate is outside the band's middle half, a
            # candidate of a shape known to push it further out is passed over (the set's mean
            # is what the band is for)
            projected = self._projected()
            now = sum(projected) / len(projected) if projected else None
            wrong_way = (
                rate is not None
                and now is not None
                and ((now > calm[1] and rate > now) or (now < calm[0] and rate < now))
            )
            if not (outside or wrong_way):
                self.dry = False
                self._admit(task, rate, fallback=False)
                skips = 0
                continue
            # passed over (it may still be admitted from the reserve: `admitted_anyway` counts
            # those, a part of `skipped`)
            self.reserve = [*self.reserve, task][-self.size :]
            self.skipped += 1
            self.skipped_hard += rate is not None and rate < self.band[0]
            skips += 1
            if skips > self.max_skips or self.dry:
                # max_skips refusals in a row: the stream holds nothing in the band for this
                # learner; from now on each admission pulls one candidate, and admits the
                # reserve's nearest (so the ranking stays over the last `active` passed over)
                self.dry = True
                self._admit(self._nearest(), None, fallback=True)
                skips = 0

    # -- learning from what was trained -----------------------------------------------------
    def observe(self, group: Group) -> None:
        self.out.discard(group.task.id)  # back: a task on probation may be served again
        # the pass rate is the share of successes (`is_success`: the env's verdict, else the full
        # reward), not the mean return: a format penalty must not make a pass rate negative
        wins = [float(is_success(t)) for t in group.trajectories if t.trainable]
        if not wins:
            return  # infra failures only: nothing learned, the task stays
        mean = sum(wins) / len(wins)
        task = group.task
        self.shapes.setdefault(shape_of(task), deque(maxlen=self.window * self.size)).append(mean)
        if all(t.id != task.id for t in self.active):
            return  # retired while this group was in flight: its history went with it
        if task.id in self.probation:  # its first group: admitted inside the band, else out
            self.probation.discard(task.id)
            if not self.band[0] <= mean <= self.band[1]:
                self.rejected += 1
                self._leave(task.id)
                return
            self.admitted += 1
        self.history.setdefault(task.id, deque(maxlen=self.window)).append(mean)
        recent = self.history[task.id]
        mastered = len(recent) == self.window and min(recent) >= self.retire_at
        hopeless = len(recent) == self.window and max(recent) == 0.0
        if mastered or hopeless:
            self.retired += mastered
            self.parked += hopeless
            self._leave(task.id)

    def _leave(self, task_id: str) -> None:
        ids = [t.id for t in self.active]
        del self.active[ids.index(task_id)]
        self.history.pop(task_id, None)
        self.out.discard(task_id)
        self._refill()  # replaced at once: the logged set is the one served next

    def pass_rate(self) -> float | None:
        """The admitted tasks' mean last group success (tasks not yet trained, and tasks on
        probation, left out)."""
        last = [self.history[t.id][-1] for t in self.active if t.id in self.history]
        return sum(last) / len(last) if last else None

    def metrics(self) -> dict[str, float]:
        out = {
            "source/active": float(len(self.active)),
            "source/admitted": float(self.admitted),
            "source/retired": float(self.retired),
            "source/parked": float(self.parked),
            "source/skipped": float(self.skipped),
            "source/skipped_hard": float(self.skipped_hard),
            "source/admitted_anyway": float(self.anyway),
        }
        if self.probe != "none":
            out["source/probation"] = float(len(self.probation))
            out["source/rejected"] = float(self.rejected)
        for shape in sorted(self.shapes):  # what the admissions are decided on, per shape
            if (by_shape := self.shape_rate(shape)) is not None:
                out[f"source/shape_rate/{shape}"] = by_shape
        rate = self.pass_rate()
        if rate is not None:
            out["source/pass_rate"] = rate
            out["source/in_band"] = float(self.band[0] <= rate <= self.band[1])
        return out

    # -- checkpoint -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "read": self.read,
            "cursor": self.cursor,
            "active": [task_dict(t) for t in self.active],
            "history": {k: list(v) for k, v in self.history.items()},
            "shapes": {k: list(v) for k, v in self.shapes.items()},
            "counts": [
                *(self.admitted, self.retired, self.skipped, self.parked, self.skipped_hard, self.rejected),
                self.anyway,
            ],
            "probation": sorted(self.probation),
            "out": sorted(self.out),
            "exhausted": self.exhausted,
            "reserve": [task_dict(t) for t in self.reserve],
            "dry": self.dry,
            "requeued": [(i, task_dict(t)) for i, t in self._requeued],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._stream = self._splits()
        self.read = 0
        for _ in range(int(state["read"])):  # the split is a pure function of the seed: skip
            if self._pull() is None:
                break
        self.cursor, self.exhausted = int(state["cursor"]), bool(state["exhausted"])
        self.active = [task_from_dict(t) for t in state["active"]]
        self.history = {str(k): deque(map(float, v), maxlen=self.window) for k, v in state["history"].items()}
        self.shapes = {
            str(k): deque(map(float, v), maxlen=self.window * self.size) for k, v in state["shapes"].items()
        }
        counts = [*map(int, state["counts"]), 0, 0, 0, 0][:7]  # older checkpoints: fewer counts
        self.admitted, self.retired, self.skipped, self.parked, self.skipped_hard, self.rejected = counts[:6]
        self.anyway = counts[6]
        self.probation = {str(i) for i in state.get("probation", [])}
        self.out = {str(i) for i in state.get("out", [])}
        self._requeued = [(int(i), task_from_dict(t)) for i, t in state["requeued"]]
        self.reserve = [task_from_dict(t) for t in state.get("reserve", [])]
        self.dry = bool(state.get("dry", False))


__all__ = ["PROBES", "AdmissionSource", "shape_of"]
