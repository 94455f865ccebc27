"""Every sampling seed of a run, in one place, keyed by what is sampled, not by when.

An episode's seed is a function of (stream seed, task index, sample index), and each turn's
of (episode seed, turn). The task index is the task's position in its stream (the train split
counted from the start of the run), so the tokens sampled for a task do not depend on the RL
step, the batch it came in, the backend, a resume, or (later) an asynchronous producer that
rolls it out early. The engine's own seed stays the run seed for the whole run.
"""

from __future__ import annotations

_MASK63 = (1 << 63) - 1


def derive(*parts: int) -> int:
    """A 63-bit seed from integer parts: splitmix64 folded over them (distinct tuples give
    unrelated seeds; no arithmetic formula whose collisions have to be reasoned about)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (p & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 29
    return x & _MASK63


def episode_seed(stream_seed: int, task_index: int, sample: int) -> int:
    """Seed of sample `sample` of the task at `task_index` (env reset and, per turn, sampling)."""
    return derive(stream_seed, task_index, sample)


def turn_seed(episode: int, turn: int) -> int:
    """Sampling seed of one turn: rollouts do not depend on env timing or batch company."""
    return derive(episode, turn)


def group_id(stream_seed: int, task_index: int) -> str:
    """The id of a task's group of samples (advantages are normalised within it)."""
    return f"{stream_seed}-{task_index}"


def eval_stream_seed(run_seed: int) -> int:
    """Seed of every held-out evaluation of a run (the warm start's, each one during training,
    `steprl eval`): the same tasks with the same per-task seeds each time, so a task's episodes
    at two evaluations differ only by the policy (a paired comparison: the learning diff of the
    report sets them side by side, and a change in held-out success is not sampling noise).
    The warm start's seed of older runs; their later evaluations drew new samples each time."""
    return 777 + 1_000_000 * run_seed


def eval_task_seed(run_seed: int) -> int:
    """Seed of the held-out task stream (the env's eval split)."""
    return 10_000 + run_seed


def demo_seed(seed: int, index: int) -> int:
    """Seed of SFT demonstration `index` (scripted strategies; unchanged so cached warm starts stay valid)."""
    return seed * 1_000_003 + index
