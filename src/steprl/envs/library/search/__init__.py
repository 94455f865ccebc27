"""The search environment: Search-R1-style multi-hop question answering over a generated corpus.

`SPEC` describes it for the registry (it is registered there as "search"). Modules:
`corpus` (fictional entities and one-sentence documents), `questions` (k-hop questions with
gold queries), `tasks` (`make_tasks`, hash-based splits), `retriever` (BM25 with bm25s),
`server` (the retriever over HTTP), `scoring` (EM / F1), `env` (`SearchEnv`) and `policies`.
"""

from steprl.envs.library.search.corpus import (
    RELATIONS,
    Corpus,
    CorpusConfig,
    Doc,
    Fact,
    Relation,
    build_corpus,
    corpus_for,
)
from steprl.envs.library.search.env import (
    INVALID_ACTION_MESSAGE,
    SEARCH_R1_INVALID_MESSAGE,
    SYSTEM_PROMPT,
    SearchEnv,
)
from steprl.envs.library.search.policies import (
    STRATEGIES,
    expert,
    guess,
    one_search,
    random_policy,
    read_object,
)
from steprl.envs.library.search.questions import Question, compose, draw_question, follow
from steprl.envs.library.search.retriever import BM25Retriever, Retriever, local_retriever, tokenize
from steprl.envs.library.search.scoring import exact_match, f1_score, normalize_answer
from steprl.envs.library.search.server import (
    HttpRetriever,
    RetrieverError,
    create_app,
    serve_retriever,
)
from steprl.envs.library.search.tasks import make_tasks, split_of
from steprl.envs.spec import EnvSpec

SPEC = EnvSpec(
    name="search",
    factory=SearchEnv,
    tasks=make_tasks,
    strategies=STRATEGIES,
    max_turns=8,
    description="Search-R1-style multi-hop QA: BM25 search over a generated corpus, EM reward",
)


__all__ = [
    "INVALID_ACTION_MESSAGE",
    "RELATIONS",
    "SEARCH_R1_INVALID_MESSAGE",
    "SPEC",
    "STRATEGIES",
    "SYSTEM_PROMPT",
    "BM25Retriever",
    "Corpus",
    "CorpusConfig",
    "Doc",
    "Fact",
    "HttpRetriever",
    "Question",
    "Relation",
    "Retriever",
    "RetrieverError",
    "SearchEnv",
    "build_corpus",
    "compose",
    "corpus_for",
    "create_app",
    "draw_question",
    "exact_match",
    "expert",
    "f1_score",
    "follow",
    "guess",
    "local_retriever",
    "make_tasks",
    "normalize_answer",
    "one_search",
    "random_policy",
    "read_object",
    "serve_retriever",
    "split_of",
    "tokenize",
]
