"""The apps task stream: templates instantiated on seeded worlds, split by a stable hash.

Each task draws a world (data seed in ``range(worlds)``), a template, and the template's
arguments from that world's data. Its `Task.params` hold everything the verifier needs as
plain JSON data: the template name, the world, the prompt's arguments, the expected changes
and the number of calls the expert needs; `Task.answer` is the expected answer of a question
(None for tasks that only change state).

Each prompt belongs to exactly one split (sha256 of its text mod 5 == 0 -> "eval"), so train
and eval are disjoint whatever the seed; the stream is a pure function of its arguments.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from typing import Literal

from steprl.envs.library.apps.templates import TEMPLATES, Template
from steprl.envs.library.apps.world import build_world
from steprl.types import Task

Split = Literal["train", "eval"]
ENV_NAME = "apps"
_MAX_REJECTIONS = 10_000  # consecutive draws that fail before giving up


def split_of(prompt: str) -> Split:
    """The split a prompt belongs to: sha256(text) mod 5 == 0 -> "eval" (stable across runs)."""
    digest = hashlib.sha256(prompt.encode("utf-8")).digest()
    return "eval" if int.from_bytes(digest[:8], "big") % 5 == 0 else "train"


def make_task(
    template: Template, world_seed: int, rng: random.Random, task_id: str, seed: int
) -> Task | None:
    """One task of `template` on world `world_seed` (None when the draw does not fit the world)."""
    instance = template.sample(build_world(world_seed), rng)
    if instance is None:
        return None
    return Task(
        id=task_id,
        prompt=template.prompt(instance.args),
        env=ENV_NAME,
        seed=seed,
        answer=instance.answer,
        params={
            "template": template.name,
            "world": world_seed,
            "args": dict(instance.args),
            "changes": [c.to_dict() for c in instance.changes],
            "num_calls": template.calls,
        },
    )


def make_tasks(
    split: str,
    seed: int,
    n: int | None = None,
    *,
    worlds: int = 4,
    templates: Sequence[str] | None = None,
) -> Iterator[Task]:
    """`n` tasks of `split` (infinitely many when None), the same ones for the same arguments.

    Args:
        worlds: data seeds 0..worlds-1 to draw from (each is a different set of people,
            emails and events).
        templates: restrict to these template names (default: all of `TEMPLATES`).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}.")
    if worlds < 1:
        raise ValueError(f"worlds must be >= 1, got {worlds}.")
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0 or None, got {n}.")
    names = list(TEMPLATES) if templates is None else list(templates)
    unknown = sorted(set(names) - set(TEMPLATES))
    if unknown or not names:
        raise ValueError(f"unknown templates {unknown}; choose among {sorted(TEMPLATES)}.")
    return _stream(split, seed, n, worlds, [TEMPLATES[name] for name in names])


def _stream(split: str, seed: int, n: int | None, worlds: int, templates: list[Template]) -> Iterator[Task]:
    rng = random.Random(f"steprl-apps-tasks:{seed}")
    index = rejected = 0
    while n is None or index < n:
        template, world = rng.choice(templates), rng.randrange(worlds)
        task_seed = (seed * 1_000_003 + index) % 2**31
        task = make_task(template, world, rng, f"{ENV_NAME}-{split}-{seed}-{index}", task_seed)
        if task is None or split_of(task.prompt) != split:
            rejected += 1
            if rejected > _MAX_REJECTIONS:
                raise RuntimeError(
                    f"no {split!r} task found in {_MAX_REJECTIONS} draws from templates "
                    f"{[t.name for t in templates][:5]}...; allow more templates or worlds."
                )
            continue
        rejected = 0
        yield task
        index += 1
