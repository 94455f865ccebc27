"""A generated knowledge base of fictional entities: one short document per fact.

Real corpora (Wikipedia, as in Search-R1) cannot be downloaded here and are far too long for
the embedded char-level policy, so the corpus is generated: made-up names built from
syllables ("Zorvan", "Quellor"), four entity types and seven functional relations, each fact
written as one short sentence ("Zorvan was born in Quellor."). Every name is new to any
pretrained model, so questions can only be answered by searching.

Relations (subject type -> object type) and their document templates are in `RELATIONS`.
Each relation has a keyword that occurs in its documents ("born", "founded", ...): the query
"Zorvan born" ranks "Zorvan was born in Quellor." first under BM25 (checked in the tests).

`build_corpus(seed)` is a pure function of its arguments (its own `random.Random(seed)`)
and is cached, so building it again costs nothing.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

ENTITY_TYPES = ("person", "company", "city", "country")


@dataclass(frozen=True)
class Relation:
    """A functional relation: every subject of `subject_type` has exactly one object.

    `doc` is the fact's document, `question` asks for the object, `noun` names the object
    inside a longer question ("the birthplace of {s}"), and `keyword` is the word the expert
    adds to the subject to search for the document ("Zorvan born").
    """

    name: str
    subject_type: str
    object_type: str
    doc: str
    question: str
    noun: str
    keyword: str


RELATIONS: Mapping[str, Relation] = MappingProxyType(
    {
        r.name: r
        for r in (
            Relation("born_in", "person", "city", "{s} was born in {o}.", "Where was {s} born?",
                     "the birthplace of {s}", "born"),
            Relation("works_for", "person", "company", "{s} works for {o}.", "Who does {s} work for?",
                     "the employer of {s}", "works"),
            Relation("founded_by", "company", "person", "{s} was founded by {o}.", "Who founded {s}?",
                     "the founder of {s}", "founded"),
            Relation("based_in", "company", "city", "{s} is based in {o}.", "Where is {s} based?",
                     "the base of {s}", "based"),
            Relation("city_in", "city", "country", "{s} is a city in {o}.", "In which country is {s}?",
                     "the country of {s}", "city"),
            Relation("capital", "country", "city", "The capital of {s} is {o}.",
                     "What is the capital of {s}?", "the capital of {s}", "capital"),
            Relation("ruled_by", "country", "person", "{s} is ruled by {o}.", "Who rules {s}?",
                     "the ruler of {s}", "ruled"),
        )
    }
)  # fmt: skip

#: Words no generated name may equal (relation keywords and template words).
RESERVED = frozenset(
    word.lower().strip(".?{}")
    for r in RELATIONS.values()
    for text in (r.doc, r.question, r.noun, r.keyword)
    for word in text.split()
)

_ONSETS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_CODAS = "lnrs"


@dataclass(frozen=True)
class Doc:
    """One document: its index in the corpus and its text (a single sentence)."""

    id: int
    text: str


@dataclass(frozen=True)
class Fact:
    """`subject --relation--> object`, written as document `doc_id`."""

    relation: str
    subject: str
    object: str
    doc_id: int


@dataclass(frozen=True)
class CorpusConfig:
    """How many entities of each type; the defaults give 240 documents."""

    seed: int = 0
    people: int = 60
    companies: int = 30
    cities: int = 40
    countries: int = 10

    def __post_init__(self) -> None:
        for name in ("people", "companies", "cities", "countries"):
            if getattr(self, name) < 2:
                raise ValueError(f"CorpusConfig.{name} must be >= 2, got {getattr(self, name)}.")
        if self.cities < self.countries:
            raise ValueError(
                f"every country needs a capital: cities ({self.cities}) must be >= countries "
                f"({self.countries})."
            )


@dataclass(frozen=True)
class Corpus:
    """The entities by type, the facts, and one document per fact (`docs[i].id == i`)."""

    config: CorpusConfig
    entities: Mapping[str, tuple[str, ...]]
    facts: tuple[Fact, ...]
    docs: tuple[Doc, ...]
    _index: Mapping[tuple[str, str], Fact] = field(repr=False, compare=False)

    def fact(self, subject: str, relation: str) -> Fact:
        """The fact giving `relation` of `subject` (KeyError if the subject has none)."""
        return self._index[(subject, relation)]

    def object_of(self, subject: str, relation: str) -> str:
        return self.fact(subject, relation).object

    def entity_type(self, name: str) -> str:
        for kind, names in self.entities.items():
            if name in names:
                return kind
        raise KeyError(f"{name!r} is not an entity of this corpus")


def make_name(rng: random.Random) -> str:
    """A two-syllable made-up name such as "Zorvan": consonant-vowel(-coda) + consonant-vowel-coda."""
    first = rng.choice(_ONSETS) + rng.choice(_VOWELS) + (rng.choice(_CODAS) if rng.random() < 0.5 else "")
    second = rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
    return (first + second).capitalize()


def _unique_names(rng: random.Random, count: int) -> list[str]:
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < count:
        name = make_name(rng)
        if name.lower() not in seen and name.lower() not in RESERVED:
            seen.add(name.lower())
            names.append(name)
    return names


@functools.lru_cache(maxsize=16)
def build_corpus(config: CorpusConfig = CorpusConfig()) -> Corpus:
    """The corpus for `config` (deterministic in `config.seed`; cached)."""
    rng = random.Random(config.seed)
    sizes = {
        "person": config.people,
        "company": config.companies,
        "city": config.cities,
        "country": config.countries,
    }
    names = _unique_names(rng, sum(sizes.values()))
    entities: dict[str, tuple[str, ...]] = {}
    start = 0
    for kind in ENTITY_TYPES:
        entities[kind] = tuple(names[start : start + sizes[kind]])
        start += sizes[kind]
    people, companies, cities, countries = (entities[k] for k in ENTITY_TYPES)

    # Each country gets at least one city (its capital, the first); the rest are spread at random.
    country_of = {city: countries[i] for i, city in enumerate(cities[: len(countries)])}
    country_of.update({city: rng.choice(countries) for city in cities[len(countries) :]})
    triples: list[tuple[str, str, str]] = []
    for person in people:
        triples.append(("born_in", person, rng.choice(cities)))
        triples.append(("works_for", person, rng.choice(companies)))
    for company in companies:
        triples.append(("founded_by", company, rng.choice(people)))
        triples.append(("based_in", company, rng.choice(cities)))
    for city in cities:
        triples.append(("city_in", city, country_of[city]))
    for i, country in enumerate(countries):
        triples.append(("capital", country, cities[i]))
        triples.append(("ruled_by", country, rng.choice(people)))
    rng.shuffle(triples)  # document order carries no information

    facts = tuple(Fact(rel, s, o, i) for i, (rel, s, o) in enumerate(triples))
    docs = tuple(Doc(f.doc_id, RELATIONS[f.relation].doc.format(s=f.subject, o=f.object)) for f in facts)
    index = MappingProxyType({(f.subject, f.relation): f for f in facts})
    return Corpus(config, MappingProxyType(entities), facts, docs, index)


def corpus_for(seed: int) -> Corpus:
    """The default-sized corpus of `seed` (cached)."""
    return build_corpus(CorpusConfig(seed=seed))
