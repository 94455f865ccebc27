"""Scripted search policies: `expert`, `one_search`, `guess`, `random` (see `STRATEGIES`).

Action texts are the canonical strings a tiny char-level model is fine-tuned on, exactly:
``<search>Zorvan born</search>`` and ``<answer>Quellor</answer>`` (no think block, no spaces
around tags). Policies read only the task, the history and their `rng`.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence

from steprl.envs.library.search.corpus import RELATIONS, corpus_for
from steprl.envs.policy import Policy
from steprl.types import Task

_INFORMATION = re.compile(r"<information>(.*)</information>", re.DOTALL)


def read_object(observation: str, subject: str, relation: str) -> str | None:
    """The object of `subject --relation-->` stated in an `<information>` observation, if any."""
    found = _INFORMATION.fullmatch(observation.strip())
    if found is None:
        return None
    left, right = RELATIONS[relation].doc.split("{o}")
    pattern = re.escape(left.format(s=subject)) + r"([A-Za-z]+)" + re.escape(right)
    match = re.search(r"(?<![A-Za-z])" + pattern, found.group(1))
    return match.group(1) if match else None


def _chain_progress(task: Task, history: Sequence[tuple[str, str]]) -> tuple[int, str | None]:
    """(hops resolved so far, the entity to search next): walks the chain through the observations."""
    entity: str | None = str(task.params["subject"])
    relations = list(task.params["relations"])
    hop = 0
    for _, observation in history:
        if hop < len(relations) and entity is not None:
            found = read_object(observation, entity, relations[hop])
            if found is not None:
                entity, hop = found, hop + 1
    return hop, entity


def expert(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """Search "<entity> <keyword>" hop by hop, reading each bridge entity back, then answer.

    Its queries are the task's `gold_queries`; it never reads the gold answer.
    """
    relations = list(task.params["relations"])
    hop, entity = _chain_progress(task, history)
    if hop < len(relations):
        return f"<search>{entity} {RELATIONS[relations[hop]].keyword}</search>"
    return f"<answer>{entity}</answer>"


def one_search(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """Search once, then answer what that search found: right on 1-hop, wrong on multi-hop."""
    hop, entity = _chain_progress(task, history)
    if hop == 0 and not history:
        relation = RELATIONS[list(task.params["relations"])[0]]
        return f"<search>{task.params['subject']} {relation.keyword}</search>"
    return f"<answer>{entity}</answer>"


def guess(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """Answer at once, with no search: a random entity of the answer's type (a plausible guess)."""
    corpus = corpus_for(int(task.params.get("corpus_seed", 0)))
    names = corpus.entities[str(task.params.get("answer_type", "person"))]
    return f"<answer>{rng.choice(names)}</answer>"


_JUNK = 'abcdefghijklmnopqrstuvwxyzZQ <>/?.{}":,'


def random_policy(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """Random junk, random tags, random (sometimes valid) searches and answers."""
    corpus = corpus_for(int(task.params.get("corpus_seed", 0)))
    kinds = sorted(corpus.entities)

    def junk() -> str:
        return "".join(rng.choice(_JUNK) for _ in range(rng.randint(0, 16)))

    def entity() -> str:
        return rng.choice(corpus.entities[rng.choice(kinds)])

    def words() -> str:
        return " ".join(
            rng.choice([*task.prompt.rstrip("?").split(), entity()]) for _ in range(rng.randint(1, 3))
        )

    options = (
        junk,
        lambda: f"<search>{junk()}</search>",
        lambda: f"<search>{words()}</search>",
        lambda: f"<answer>{entity()}</answer>",
        lambda: f"<answer>{junk()}</answer>",
        lambda: f"<search>{junk()}",
        lambda: f"<think>{junk()}</think><search>{words()}</search>",
        lambda: f"<search>{words()}</search><answer>{entity()}</answer>",
        lambda: f"<tool_call>{junk()}</tool_call>",
        lambda: "<search></search>",
    )
    return rng.choice(options)()


STRATEGIES: Mapping[str, Policy] = {
    "expert": expert,
    "one_search": one_search,
    "guess": guess,
    "random": random_policy,
}
