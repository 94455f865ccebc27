"""The code-interpreter environment (ToRL protocol) over a sandboxed Python runner.

One episode: the model may run up to `max_executions` programs (each action ending at the
output marker executes its last python block in the sandbox and sees the output), then answers.
Reward: +1 correct / -1 wrong (ToRL), optionally -0.5 if any execution failed; an action that is
neither a program nor an answer gets a format penalty and an error observation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from steprl.envs.base import NO_TOOLS, Observation, ToolSpec, Transition
from steprl.envs.library.code_interpreter.protocol import (
    OUTPUT_MARKER,
    extract_answer,
    extract_program,
    format_output,
)
from steprl.types import Task

#: Longer actions are invalid before any scan (as `ActionSyntax.max_chars` for tag actions).
MAX_ACTION_CHARS = 32_768

SYSTEM_PROMPT = (
    "Solve the problem. You may run Python: write ```python\\n<code>\\n``` followed by ```output and "
    "the output is shown. Give the final answer as <answer>integer</answer>."
)


@dataclass(frozen=True)
class RunOutput:
    stdout: str
    error: str | None  # stderr of a failed run (traceback), None when it succeeded
    timed_out: bool = False


class CodeRunner(Protocol):
    """Executes model code confined (see `CodeRunners` in `runners.py`); one per episode."""

    def run(self, code: str) -> RunOutput: ...

    def close(self) -> None: ...


class RunnerFactory(Protocol):
    def __call__(self) -> CodeRunner: ...


class CodeInterpreterEnv:
    stop_strings: Sequence[str] = (OUTPUT_MARKER, "</answer>")
    system_prompt: str = SYSTEM_PROMPT
    tools: Mapping[str, ToolSpec] = NO_TOOLS  # none for a chat template: the system prompt says how to act

    def __init__(
        self,
        runner_factory: RunnerFactory,
        *,
        max_executions: int = 2,
        exec_error_penalty: float = 0.0,
        format_penalty: float = -0.1,
        max_invalid_actions: int = 2,
        max_output_tokens: int = 64,
    ) -> None:
        if exec_error_penalty > 0 or format_penalty > 0:
            raise ValueError("penalties are added to the reward, so they must be <= 0 (e.g. -0.5)")
        self.runner_factory = runner_factory
        self.max_executions = max_executions
        self.exec_error_penalty = exec_error_penalty
        self.format_penalty = format_penalty
        self.max_invalid_actions = max_invalid_actions
        self.max_output_tokens = max_output_tokens
        self._runner: CodeRunner | None = None
        self._task: Task | None = None

    def reset(self, task: Task, seed: int) -> Observation:
        self.close()
        self._task = task
        self._executions = 0
        self._invalid = 0
        self._had_error = False
        self._runner = self.runner_factory()
        return Observation(task.prompt)

    def step(self, action: str) -> Transition:
        if self._task is None or self._runner is None:
            raise RuntimeError("step() before reset(): the harness must reset the env first")
        if len(action) > MAX_ACTION_CHARS:
            return self._invalid_action(f"action too long (max {MAX_ACTION_CHARS} chars)")
        if action.rstrip().endswith(OUTPUT_MARKER):
            return self._execute(action)
        answer = extract_answer(action)
        if answer is None:
            return self._invalid_action("end with ```output to run code, or give <answer>n</answer>")
        correct = answer.strip() == (self._task.answer or "").strip()
        components = {
            "outcome": 1.0 if correct else -1.0,
            "format": 0.0,
            "cost": self.exec_error_penalty if self._had_error else 0.0,
        }
        return Transition(
            "",
            sum(components.values()),
            True,
            info={
                "reward_components": components,
                "action_kind": "answer",
                "tool_call_valid": None,
                "tool_name": None,
                "error": None,
                "policy_error": False,
                "success": correct,
            },
        )

    def _execute(self, action: str) -> Transition:
        assert self._runner is not None
        program = extract_program(action)
        if program is None:
            return self._invalid_action("no complete ```python block before ```output")
        if self._executions >= self.max_executions:
            obs = format_output("", "tool budget used up; give <answer>n</answer>")
            return self._transition(obs, valid=False, error="budget")
        self._executions += 1
        out = self._runner.run(program)
        failed = out.error is not None or out.timed_out
        self._had_error |= failed
        error = "Timeout: the program ran too long" if out.timed_out else out.error
        obs = format_output(out.stdout, error, max_tokens=self.max_output_tokens)
        return self._transition(obs, valid=not failed, error=error)

    def _transition(self, obs: str, *, valid: bool, error: str | None) -> Transition:
        components = {"outcome": 0.0, "format": 0.0, "cost": 0.0}
        return Transition(
            obs,
            0.0,
            False,
            info={
                "reward_components": components,
                "action_kind": "tool_call",
                "tool_call_valid": valid,
                "tool_name": "python",
                "error": error,
                "policy_error": False,
            },
        )

    def _invalid_action(self, reason: str) -> Transition:
        self._invalid += 1
        over = self._invalid > self.max_invalid_actions
        components = {"outcome": 0.0, "format": self.format_penalty, "cost": 0.0}
        return Transition(
            f"<error>{reason}</error>",
            self.format_penalty,
            over,
            info={
                "reward_components": components,
                "action_kind": "invalid",
                "tool_call_valid": None,
                "tool_name": None,
                "error": reason,
                "policy_error": over,
            },
        )

    def close(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            runner.close()
