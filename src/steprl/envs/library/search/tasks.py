"""Deterministic question-answering tasks over the generated corpus (1 to 3 hops).

The prompt is the bare question ("Where was Zorvan born?"), the answer its gold entity, and
`Task.params` carries what the scripted policies and the env need: `hops`, `relations`,
`subject`, `gold_queries`, `answer_type` and `corpus_seed`. Each question belongs to exactly
one split, decided by a stable hash of its text (about 20% go to "eval"), so train and eval
are disjoint whatever the seed. The stream is a pure function of its arguments: it uses its
own `random.Random(seed)`, never the global RNG.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from typing import Literal

from steprl.envs.library.search.corpus import Corpus, corpus_for
from steprl.envs.library.search.questions import draw_question
from steprl.types import Task

Split = Literal["train", "eval"]
ENV_NAME = "search"
MAX_HOPS = 3
_MAX_REJECTIONS = 100_000  # consecutive draws outside the split before giving up


def split_of(question: str) -> Split:
    """The split of a question: sha256(text) mod 5 == 0 -> "eval" (stable across runs)."""
    digest = hashlib.sha256(question.encode("utf-8")).digest()
    return "eval" if int.from_bytes(digest[:8], "big") % 5 == 0 else "train"


def make_tasks(
    split: str,
    seed: int,
    n: int | None = None,
    *,
    hops: Sequence[int] = (1, 2),
    corpus_seed: int = 0,
) -> Iterator[Task]:
    """`n` tasks of `split` (infinitely many when `n` is None), the same ones for the same seed.

    The number of hops of each task is drawn uniformly from `hops` (values in 1..3);
    `corpus_seed` picks the generated corpus (the env must search the same one).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}.")
    hop_choices = tuple(hops)
    if not hop_choices or any(isinstance(h, bool) or h not in range(1, MAX_HOPS + 1) for h in hop_choices):
        raise ValueError(f"hops must be a non-empty list of values in 1..{MAX_HOPS}, got {hops!r}.")
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0 or None, got {n}.")
    return _stream(split, seed, n, hop_choices, corpus_for(corpus_seed))


def _stream(split: str, seed: int, n: int | None, hops: tuple[int, ...], corpus: Corpus) -> Iterator[Task]:
    rng = random.Random(seed)
    index = 0
    rejected = 0
    while n is None or index < n:
        question = draw_question(corpus, rng, rng.choice(hops))
        if question is None or split_of(question.text) != split:
            rejected += 1
            if rejected > _MAX_REJECTIONS:
                raise RuntimeError(f"no {split!r} question found in {_MAX_REJECTIONS} draws (hops={hops}).")
            continue
        rejected = 0
        yield Task(
            id=f"{ENV_NAME}-{split}-{seed}-{index}",
            prompt=question.text,
            env=ENV_NAME,
            seed=(seed * 1_000_003 + index) % 2**31,
            answer=question.answer,
            params={
                "hops": question.hops,
                "relations": list(question.relations),
                "subject": question.subject,
                "gold_queries": list(question.gold_queries),
                "answer_type": corpus.entity_type(question.answer),
                "corpus_seed": corpus.config.seed,
            },
        )
        index += 1
