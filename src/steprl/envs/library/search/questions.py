"""Multi-hop questions over the generated corpus, each with its gold answer and gold queries.

A k-hop question follows a chain of k relations from a start entity, and composes their
templates from the inside out::

    1 hop  born_in                      "Where was Zorvan born?"
    2 hops born_in, city_in             "In which country is the birthplace of Zorvan?"
    3 hops works_for, founded_by, born_in
                                        "Where was the founder of the employer of Zorvan born?"

The expert's gold queries are "<subject> <keyword>" per hop ("Zorvan born", "Quellor city"),
where each subject after the first is the previous hop's answer (the bridge entity), which
the searcher only learns from the retrieved document: a k-hop question needs k searches.
Chains that visit an entity twice are not drawn (their answer would be in the question).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from steprl.envs.library.search.corpus import RELATIONS, Corpus


@dataclass(frozen=True)
class Question:
    """A k-hop question: its text, gold answer, and the expert's path to it."""

    text: str
    answer: str
    subject: str  # the start entity, named in the question
    relations: tuple[str, ...]  # the chain, innermost (first searched) first
    entities: tuple[str, ...]  # subject, bridge entities..., answer (len = hops + 1)
    gold_queries: tuple[str, ...]  # one per hop
    gold_doc_ids: tuple[int, ...]  # the document each gold query must retrieve

    @property
    def hops(self) -> int:
        return len(self.relations)


def compose(subject: str, relations: tuple[str, ...]) -> str:
    """The question text for a chain (see the module docstring)."""
    phrase = subject
    for name in relations[:-1]:
        phrase = RELATIONS[name].noun.format(s=phrase)
    return RELATIONS[relations[-1]].question.format(s=phrase)


def follow(corpus: Corpus, subject: str, relations: tuple[str, ...]) -> Question | None:
    """The question for `relations` from `subject`, or None if the chain revisits an entity."""
    entities = [subject]
    doc_ids = []
    queries = []
    for name in relations:
        fact = corpus.fact(entities[-1], name)
        if fact.object in entities:
            return None
        queries.append(f"{entities[-1]} {RELATIONS[name].keyword}")
        doc_ids.append(fact.doc_id)
        entities.append(fact.object)
    return Question(
        text=compose(subject, relations),
        answer=entities[-1],
        subject=subject,
        relations=relations,
        entities=tuple(entities),
        gold_queries=tuple(queries),
        gold_doc_ids=tuple(doc_ids),
    )


def draw_question(corpus: Corpus, rng: random.Random, hops: int) -> Question | None:
    """A random chain of `hops` relations from a random subject (None when it revisits an entity)."""
    if hops < 1:
        raise ValueError(f"hops must be >= 1, got {hops}.")
    first = rng.choice(sorted(RELATIONS))
    kind = RELATIONS[first].subject_type
    subject = rng.choice(corpus.entities[kind])
    chain = [first]
    kind = RELATIONS[first].object_type
    while len(chain) < hops:
        nxt = rng.choice(sorted(n for n, r in RELATIONS.items() if r.subject_type == kind))
        chain.append(nxt)
        kind = RELATIONS[nxt].object_type
    return follow(corpus, subject, tuple(chain))
