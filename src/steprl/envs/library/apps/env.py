"""`AppsEnv`: an AppWorld-like environment of stateful apps (contacts, email, calendar).

Every reset copies the task's golden world database into a private in-memory database
(`db.episode_db`); the agent calls the apps' API and ends with ``<answer>...</answer>``, at
which point the task's unit tests run over the final state (`checks.run_tests`). The outcome
reward is the fraction of tests passed; the answer step's ``info`` carries each test's result,
``success`` and the final ``state_hash``.

Executors (both reach the API through `Apps.call`, one entry point):

* ``executor="json"``: one JSON function call per turn,
  ``<tool_call>{"name": "contacts_search", "arguments": {"query": "Alice"}}</tool_call>``;
* ``executor="python"`` (AppWorld's code actions, `code_actions.py`): a fenced python block
  ending at the output marker, e.g. ``print(apis.contacts_search(query="Alice"))``, run in a
  bubblewrap sandbox with one interpreter per episode; each API call the snippet makes is
  forwarded to the host. Its observation is the snippet's output (and error), as in the code
  env; a sandbox failure raises `InfraError` (the trajectory ends `infra_failed`).
"""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Callable, Mapping
from typing import Any, Literal

from steprl.envs.base import Observation, Transition
from steprl.envs.library.apps.api import APPS, FUNCTIONS, Apps
from steprl.envs.library.apps.checks import Change, Report, run_tests
from steprl.envs.library.apps.code_actions import CodeActions
from steprl.envs.library.apps.db import episode_db, golden_snapshot, snapshot, state_hash
from steprl.envs.library.code_interpreter.protocol import OUTPUT_MARKER, extract_program
from steprl.envs.rewards import RewardConfig, step_rewards
from steprl.envs.sandbox import SandboxLimits
from steprl.envs.tool_env import FunctionTool, ToolEnv
from steprl.types import Task

Executor = Literal["json", "python"]

FORMAT_HINT = (
    'call one function as <tool_call>{"name": ..., "arguments": {...}}</tool_call> '
    "or finish with <answer>...</answer>"
)
PYTHON_FORMAT_HINT = (
    f"run code as ```python\\n...\\n``` then {OUTPUT_MARKER}, or finish with <answer>...</answer>"
)


def system_prompt(show_api: bool = True, executor: Executor = "json") -> str:
    """The instructions: the apps, how to call them, how to finish (and the API, if shown)."""
    lines = ["You are a personal assistant with access to the user's apps: " + ", ".join(APPS) + "."]
    if executor == "python":
        lines += [
            "Act by writing Python that calls the apps' API, e.g.",
            '```python\nprint(apis.contacts_search(query="Alice"))\n```',
            f'then {OUTPUT_MARKER}: the output is shown. call("contacts_search", query="Alice") is the '
            "same; a failed call raises ApiError. Variables persist between your code blocks.",
        ]
    else:
        lines += [
            "Call one function per turn, e.g.",
            '<tool_call>{"name": "contacts_search", "arguments": {"query": "Alice"}}</tool_call>',
            "A result comes back as <result>JSON</result>, a mistake as <error>...</error>.",
        ]
    if show_api:
        lines.append("Functions:")
        lines.extend(f"- {f.doc}" for f in FUNCTIONS)
    elif executor == "python":
        lines.append('Call apis.api_docs(app="contacts") (or email, calendar) to list the functions.')
    else:
        lines.append('Call api_docs with {"app": "contacts"} (or email, calendar) to list the functions.')
    lines.append("Change only what the task asks for. When done, reply <answer>done</answer>;")
    lines.append("for a question, reply <answer>the answer</answer>.")
    return "\n".join(lines)


def _tool(apps: Apps, name: str, description: str, parameters: dict[str, Any]) -> FunctionTool:
    fn: Callable[..., str] = lambda **arguments: apps.call(name, arguments)  # noqa: E731
    return FunctionTool(name=name, description=description, parameters=parameters, fn=fn)


class AppsEnv(ToolEnv):
    """Stateful apps behind JSON function calls or python snippets; one private database per episode.

    Args:
        executor: "json" (function calls) or "python" (sandboxed code actions; see the module
            docstring and `code_actions.py`).
        show_api_in_prompt: list every function in the system prompt; when False the agent
            discovers them with `api_docs` (as in AppWorld).
        max_turns: end the episode as truncated after this many steps without an answer (the
            tests still run and are reported in ``info``, but earn no reward); None leaves the
            turn budget to the agent loop.
        max_invalid_actions, format_penalty, tool_call_cost, turn_cost, max_observation_chars:
            as in `ToolEnv` / `RewardConfig` (a python snippet is priced as one tool call).
        code_limits: python executor only: per-snippet sandbox limits (wall clock, memory,
            output; a `SandboxLimits` or a mapping of fields such as ``{"wall_s": 2}``),
            clamped to `code_actions.PYTHON_LIMITS`.
        max_api_calls_per_cell: python executor only: API calls one snippet may make; the
            next ones raise `ApiError` in the snippet.
    """

    def __init__(
        self,
        *,
        executor: Executor = "json",
        show_api_in_prompt: bool = True,
        max_turns: int | None = None,
        max_invalid_actions: int = 3,
        format_penalty: float = -0.1,
        tool_call_cost: float = 0.0,
        turn_cost: float = 0.0,
        max_observation_chars: int = 2048,
        code_limits: SandboxLimits | Mapping[str, Any] | None = None,
        max_api_calls_per_cell: int = 20,
    ) -> None:
        if executor not in ("json", "python"):
            raise ValueError(f"executor must be 'json' or 'python', got {executor!r}.")
        if max_turns is not None and max_turns < 1:
            raise ValueError(f"max_turns must be >= 1 or None, got {max_turns}.")
        self.apps = Apps()
        tools = (
            [_tool(self.apps, f.name, f.doc, f.parameters) for f in FUNCTIONS] if executor == "json" else []
        )
        super().__init__(
            tools,
            self._verify,
            system_prompt=system_prompt(show_api_in_prompt, executor),
            rewards=RewardConfig(
                format_penalty=format_penalty, tool_call_cost=tool_call_cost, turn_cost=turn_cost
            ),
            max_invalid_actions=max_invalid_actions,
            tag_tools={},  # JSON calls only: one format for every function
            format_hint=FORMAT_HINT if executor == "json" else PYTHON_FORMAT_HINT,
            max_observation_chars=max_observation_chars,
        )
        self.executor: Executor = executor
        self.code: CodeActions | None = None
        if executor == "python":
            self.code = CodeActions(
                self.apps,
                limits=code_limits,
                max_api_calls=max_api_calls_per_cell,
                max_observation_chars=max_observation_chars,
            )
            self.stop_strings = (OUTPUT_MARKER, *self.syntax.stop_strings)
        self.max_turns = max_turns
        self.db: sqlite3.Connection | None = None
        self.report: Report | None = None  # the tests of the last finished episode

    def reset(self, task: Task, seed: int) -> Observation:
        """Copy the task's golden world into a fresh private database and show the prompt."""
        world = task.params.get("world")
        if isinstance(world, bool) or not isinstance(world, int) or "changes" not in task.params:
            raise ValueError(
                f"task {task.id!r} lacks params 'world' (int) and 'changes'; build apps tasks with "
                "steprl.envs.library.apps.make_tasks."
            )
        self._close_db()
        self.db = episode_db(world)
        self.apps.attach(self.db)
        self.report = None
        return super().reset(task, seed)

    def step(self, action: str) -> Transition:
        """Answer one action: a call (JSON or python snippet, by executor) or the final answer."""
        if self.code is not None and isinstance(action, str) and action.rstrip().endswith(OUTPUT_MARKER):
            transition = self._run_code(action)
        else:
            transition = super().step(action)
        if transition.terminated and transition.info.get("action_kind") == "answer":
            transition = self._with_report(transition)
        elif not transition.terminated and self.max_turns is not None and self._turn >= self.max_turns:
            self._done = True
            self.report = self._run_tests(None)
            transition = self._with_report(dataclasses.replace(transition, truncated=True))
        if self._done and self.code is not None:
            self.code.close()  # the episode is over: free its interpreter now
        return transition

    def close(self) -> None:
        """Drop the episode database (and interpreter); safe to call any number of times."""
        super().close()
        self._close_db()

    def state_hash(self) -> str:
        """The hash of the current episode database (equal to the world's baseline after reset)."""
        if self.db is None:
            raise RuntimeError("no episode database; call reset(task, seed) first.")
        return state_hash(self.db)

    def _close_db(self) -> None:
        if self.code is not None:
            self.code.close()  # variables never outlive their episode
        if self.db is not None:
            self.db.close()
        self.db = None
        self.apps.attach(None)

    def _run_code(self, action: str) -> Transition:
        """One python snippet (see `code_actions.py`); priced as one tool call."""
        assert self.code is not None
        if self._task is None or self._done:
            raise RuntimeError(
                "AppsEnv.step() called before reset() or after the episode ended; call reset(task, seed)."
            )
        self._turn += 1
        if len(action) > self.syntax.max_chars:
            return self._invalid_action(f"action too long (max {self.syntax.max_chars} chars)")
        program = extract_program(action)
        if program is None:
            return self._invalid_action(f"no complete ```python block before {OUTPUT_MARKER}")
        cell = self.code.run(program)
        transition = self._transition(
            cell.observation,
            step_rewards("tool_call", self.rewards),
            kind="tool_call",
            tool="python",
            valid=cell.error is None,
            error=cell.error,
        )
        info = {**transition.info, "api_calls": cell.api_calls, "interpreter_restarted": cell.restarted}
        return dataclasses.replace(transition, info=info)

    def _run_tests(self, answer: str | None) -> Report:
        task = self._task
        if task is None or self.db is None:
            raise RuntimeError("AppsEnv has no episode to test; call reset(task, seed) first.")
        changes = [Change.from_dict(c) for c in task.params["changes"]]
        return run_tests(
            changes,
            golden_snapshot(int(task.params["world"])),
            snapshot(self.db),
            answer=answer,
            expected_answer=task.answer,
        )

    def _verify(self, answer: str, task: Task) -> float:
        self.report = self._run_tests(answer)
        return self.report.score

    def _with_report(self, transition: Transition) -> Transition:
        report = self.report
        if report is None:
            return transition
        info = dict(transition.info)
        info["tests"] = [(t.name, t.passed) for t in report.tests]
        info["success"] = report.success
        info["state_hash"] = self.state_hash()
        return dataclasses.replace(transition, info=info)
