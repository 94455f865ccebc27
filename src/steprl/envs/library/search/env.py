"""`SearchEnv`: Search-R1's protocol (search, read, answer) over a generated corpus.

One action per turn (generation stops at ``</search>`` or ``</answer>``)::

    <think>...</think>          optional; whole think blocks are ignored
    <search>Zorvan born</search>  ->  <information>Zorvan was born in Quellor. ...</information>
    <answer>Quellor</answer>      ->  episode over; outcome = EM (or F1) against the gold answer

Differences from Search-R1 (Jin et al., 2025; `search_r1/llm_agent/generation.py`), all for a
tiny char-level policy with a few hundred tokens of context:

* documents are bare sentences joined by a space, not ``Doc i(Title: ...) text`` blocks, and no
  blank lines surround ``<information>``; the default `top_k` is 2 (Search-R1: 3);
* the invalid-action message is shortened from "My previous action is invalid. If I want to
  search, I should put the query between <search> and </search>. If I want to give the final
  answer, I should put the answer between <answer> and </answer>. Let me try again." to
  `INVALID_ACTION_MESSAGE` (pass ``invalid_message=SEARCH_R1_INVALID_MESSAGE`` for the original);
  each invalid action also costs `format_penalty`, and after `max_invalid_actions` of them one
  more ends the episode with ``info["policy_error"] = True``;
* a search that cannot run (empty query, no searches left) is answered ``<error>why</error>``;
* only the action's own ``<answer>`` is scored, never the prompt's or an observation's, so
  Search-R1's "at least two answer tags" rule is not needed;
* after `max_turns` steps without an answer the episode is truncated (outcome 0).

Retrieved documents are observations: the agent loop tokenizes them once into
`Step.observation_ids`, which never enter the policy loss (Search-R1's retrieved-token
masking, ``state_masking=true``, is the default here, not an option).

Reward components: ``outcome`` (EM or F1 of the answer, 0 otherwise), ``format``
(`format_penalty` per invalid action) and ``cost`` (`search_cost` per search, `turn_cost`
per step); they sum to the step reward.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from steprl.envs.base import NO_TOOLS, Observation, ToolSpec, Transition
from steprl.envs.library.search.retriever import Retriever, check_k, local_retriever, require_bm25s
from steprl.envs.library.search.scoring import exact_match, f1_score
from steprl.envs.parsing import ActionKind, ActionSyntax, FinalAnswer, InvalidAction
from steprl.envs.rewards import RewardBreakdown, RewardConfig, step_rewards
from steprl.types import Task

SYSTEM_PROMPT = (
    "Answer the question. You may think in <think>...</think>. Search with <search>query</search>; "
    "results come back as <information>...</information>. Finish with <answer>name</answer>."
)
INVALID_ACTION_MESSAGE = "Invalid action. Use <search>query</search> or <answer>text</answer>."
SEARCH_R1_INVALID_MESSAGE = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> "
    "and </search>. If I want to give the final answer, I should put the answer between <answer> "
    "and </answer>. Let me try again.\n"
)
MAX_QUERY_CHARS = 200
SYNTAX = ActionSyntax(tag_tools={"search": "query"})  # no JSON calls: stop at </search>, </answer>


@functools.lru_cache(maxsize=8)
def _http_retriever(url: str, timeout: float) -> Retriever:
    """One client (one connection pool) per server for the whole process."""
    from steprl.envs.library.search.server import HttpRetriever

    return HttpRetriever(url, timeout=timeout)


class SearchEnv:
    """Implements `Env` for question answering with a `search` tool (see the module docstring).

    Args:
        retriever: "local" (in-process BM25 of the task's corpus) or "http" (a server at `url`,
            made with `create_app` / `serve_retriever`), or any `Retriever` object.
        url: the server's base URL, for ``retriever="http"``.
        top_k: documents per search.
        max_searches: searches allowed per episode; one more is answered with an error.
        max_turns: steps per episode; the episode is truncated after that many.
        reward: "em" (exact match after normalisation) or "f1" (token F1) as the outcome.
        format_penalty, search_cost, turn_cost: shaping terms, each <= 0 (see `RewardConfig`).
        max_invalid_actions: invalid actions tolerated; one more ends the episode (policy error).
        corpus_seed: the corpus a local retriever searches; None takes the task's
            (``task.params["corpus_seed"]``); an int must match it.
        timeout: seconds per HTTP request.
        invalid_message: the observation after an invalid action.
    """

    tools: Mapping[str, ToolSpec] = NO_TOOLS  # none for a chat template: the system prompt says how to act

    def __init__(
        self,
        *,
        retriever: Literal["local", "http"] | Retriever = "local",
        url: str | None = None,
        top_k: int = 2,
        max_searches: int = 4,
        max_turns: int = 8,
        reward: Literal["em", "f1"] = "em",
        format_penalty: float = -0.1,
        search_cost: float = 0.0,
        turn_cost: float = 0.0,
        max_invalid_actions: int = 3,
        corpus_seed: int | None = None,
        timeout: float = 5.0,
        invalid_message: str = INVALID_ACTION_MESSAGE,
    ) -> None:
        check_k(top_k)
        if reward not in ("em", "f1"):
            raise ValueError(f"reward must be 'em' or 'f1', got {reward!r}.")
        for name, value in (("max_searches", max_searches), ("max_invalid_actions", max_invalid_actions)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}.")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}.")
        if retriever == "http":
            if not url:
                raise ValueError("retriever='http' needs url='http://127.0.0.1:PORT' (see serve_retriever).")
            self._retriever: Retriever | None = _http_retriever(url, float(timeout))
        elif retriever == "local":
            require_bm25s()  # without the search extra, fail here rather than at the first reset
            self._retriever = None  # the task's corpus, chosen at reset
        elif isinstance(retriever, Retriever):
            self._retriever = retriever
        else:
            raise ValueError(f"retriever must be 'local', 'http' or a Retriever, got {retriever!r}.")
        self._local = retriever == "local"
        self.top_k = top_k
        self.max_searches = max_searches
        self.max_turns = max_turns
        self.reward = reward
        self.rewards = RewardConfig(
            format_penalty=format_penalty, tool_call_cost=search_cost, turn_cost=turn_cost
        )
        self.max_invalid_actions = max_invalid_actions
        self.corpus_seed = corpus_seed
        self.invalid_message = invalid_message
        self.stop_strings: Sequence[str] = SYNTAX.stop_strings
        self.system_prompt: str = SYSTEM_PROMPT
        self._task: Task | None = None
        self._golds: tuple[str, ...] = ()
        self._done = True
        self._turn = self._searches = self._invalid = 0

    @property
    def retriever(self) -> Retriever | None:
        """The retriever in use (for a local one, that of the current task's corpus)."""
        return self._retriever

    def reset(self, task: Task, seed: int) -> Observation:
        """Start an episode on `task`; the first observation is the question."""
        if task.answer is None:
            raise ValueError(f"task {task.id!r} has no gold answer; search tasks come from make_tasks().")
        task_corpus = int(task.params.get("corpus_seed", 0))
        if self.corpus_seed is not None and self.corpus_seed != task_corpus:
            raise ValueError(
                f"task {task.id!r} is about corpus_seed={task_corpus} but the env searches "
                f"corpus_seed={self.corpus_seed}; set env.params.corpus_seed to the task_params' value."
            )
        if self._local:
            self._retriever = local_retriever(task_corpus)
        self._task, self._done = task, False
        self._golds = tuple(task.params.get("answers", ())) or (task.answer,)
        self._turn = self._searches = self._invalid = 0
        return Observation(text=task.prompt, info={"task_id": task.id, "seed": seed})

    def step(self, action: str) -> Transition:
        """Answer one action: search, answer, or an invalid action (never raises for model text)."""
        if self._task is None or self._done:
            raise RuntimeError(
                "SearchEnv.step() called before reset() or after the episode ended; call reset(task, seed)."
            )
        self._turn += 1
        parsed = SYNTAX.parse(action)
        if isinstance(parsed, FinalAnswer):
            em, f1 = exact_match(parsed.text, self._golds), f1_score(parsed.text, self._golds)
            self._done = True
            outcome = em if self.reward == "em" else f1
            return self._transition(
                "", step_rewards("answer", self.rewards, outcome=outcome), "answer", em=em, f1=f1
            )
        if isinstance(parsed, InvalidAction):
            self._invalid += 1
            give_up = self._invalid > self.max_invalid_actions
            self._done = give_up
            return self._transition(
                "" if give_up else self.invalid_message,
                step_rewards("invalid", self.rewards),
                "invalid",
                error=parsed.reason,
                policy_error=give_up,
            )
        return self._search(str(parsed.arguments["query"]).strip())

    def close(self) -> None:
        """Nothing to release (retrievers are shared); safe to call any number of times."""
        self._task, self._done = None, True

    def _search(self, query: str) -> Transition:
        rewards = step_rewards("tool_call", self.rewards)
        error = None
        if not query:
            error = "empty query"
        elif len(query) > MAX_QUERY_CHARS:
            error = f"query too long (max {MAX_QUERY_CHARS} chars)"
        elif self._searches >= self.max_searches:
            error = "no searches left; answer now"
        if error is not None:
            return self._transition(f"<error>{error}</error>", rewards, "tool_call", valid=False, error=error)
        self._searches += 1
        if self._retriever is None:  # unreachable: set in __init__ or reset
            raise RuntimeError("SearchEnv has no retriever; call reset(task, seed) first.")
        docs = self._retriever.search(query, self.top_k)  # a server failure propagates: infra_failed
        text = " ".join(d.text for d in docs) if docs else "No results."
        return self._transition(
            f"<information>{text}</information>",
            rewards,
            "tool_call",
            valid=True,
            doc_ids=[d.id for d in docs],
        )

    def _transition(
        self,
        observation: str,
        rewards: RewardBreakdown,
        kind: ActionKind,
        *,
        valid: bool | None = None,
        error: str | None = None,
        policy_error: bool = False,
        **extra: Any,
    ) -> Transition:
        terminated = self._done
        truncated = not terminated and self._turn >= self.max_turns
        if truncated:
            self._done, observation = True, ""
        info: Mapping[str, Any] = {
            "reward_components": rewards.as_dict(),
            "action_kind": kind,
            "tool_call_valid": valid,
            "tool_name": "search" if kind == "tool_call" else None,
            "error": error,
            "policy_error": policy_error,
            "turn": self._turn,
            "searches": self._searches,
            "invalid_actions": self._invalid,
            **extra,
        }
        return Transition(observation, rewards.total, terminated, truncated, info)
