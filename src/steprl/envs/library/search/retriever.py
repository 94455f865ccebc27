"""BM25 retrieval over a generated corpus, with `bm25s`; any `Retriever` can back the env.

A retriever maps (query, k) to at most k documents, best first. `BM25Retriever` scores the
whole corpus with `bm25s` (Lucene BM25, k1=1.5, b=0.75) and breaks ties by document id, so
results are deterministic; documents that share no term with the query are never returned
(a query of unknown words gets no documents). `local_retriever(seed)` builds the index once
per corpus and keeps it in memory for every env instance of the process. The same interface
is served over HTTP by `server.py` (`HttpRetriever`).

Tokenisation (index and queries alike): lowercase alphanumeric runs minus bm25s's English
stop words and question words, so a whole question ("Where was Zorvan born?") is a usable
query too.

`bm25s` is the ``search`` extra: without it the env is still registered and its tasks still
stream, but building the local retriever (or a `SearchEnv` that would use one) raises
`MissingExtra` naming the extra.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

from steprl.envs.library.search.corpus import Corpus, Doc, corpus_for
from steprl.extras import require

_WORD = re.compile(r"[a-z0-9]+")
_QUESTION_WORDS = frozenset({"who", "what", "where", "which", "when", "does", "did", "do"})
MAX_K = 50  # more documents than a policy could read in one observation
_FEATURE = "env 'search'"


@runtime_checkable
class Retriever(Protocol):
    """At most `k` documents for `query`, best first."""

    def search(self, query: str, k: int) -> list[Doc]: ...


def require_bm25s() -> ModuleType:
    """The `bm25s` module, or `MissingExtra`: "env 'search' needs the search extra: ..."."""
    return require("bm25s", extra="search", feature=_FEATURE)


@functools.cache
def _stopwords() -> frozenset[str]:
    stopwords = require("bm25s.stopwords", extra="search", feature=_FEATURE)
    return frozenset(stopwords.STOPWORDS_EN) | _QUESTION_WORDS


def tokenize(text: str) -> list[str]:
    """Index terms of `text`: lowercase alphanumeric runs that are not stop words."""
    stop = _stopwords()
    return [w for w in _WORD.findall(text.lower()) if w not in stop]


def check_k(k: object) -> int:
    """`k` as an int in 1..MAX_K, or a ValueError saying so."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise ValueError(f"k must be an integer in 1..{MAX_K}, got {k!r}.")
    return k


class BM25Retriever:
    """BM25 over `docs` (index built once, here; `search` is thread-safe)."""

    def __init__(self, docs: Sequence[Doc]) -> None:
        bm25s = require_bm25s()
        if not docs:
            raise ValueError("BM25Retriever needs at least one document.")
        self.docs: tuple[Doc, ...] = tuple(docs)
        self._bm25: Any = bm25s.BM25()
        # create_empty_token=False: a query with no known term is answered here, not by bm25s.
        self._bm25.index([tokenize(d.text) for d in self.docs], create_empty_token=False, show_progress=False)
        self._lock = threading.Lock()  # bm25s objects are not documented as thread-safe

    @classmethod
    def from_corpus(cls, corpus: Corpus) -> BM25Retriever:
        return cls(corpus.docs)

    def search(self, query: str, k: int) -> list[Doc]:
        """The top-`k` documents sharing a term with `query`, by score then document id."""
        check_k(k)
        if not isinstance(query, str):
            raise TypeError(f"query must be str, got {type(query).__name__}.")
        with self._lock:
            ids = self._bm25.get_tokens_ids(tokenize(query))
            if not ids:
                return []
            scores = self._bm25.get_scores_from_ids(ids)
        ranked = sorted((i for i in range(len(self.docs)) if scores[i] > 0), key=lambda i: (-scores[i], i))
        return [self.docs[i] for i in ranked[:k]]


@functools.lru_cache(maxsize=8)
def local_retriever(corpus_seed: int = 0) -> BM25Retriever:
    """The in-process BM25 retriever of the default-sized corpus `corpus_seed` (built once)."""
    return BM25Retriever.from_corpus(corpus_for(corpus_seed))
