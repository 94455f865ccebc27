"""What `check-env` rejects never trains (issue 23, item 9): the agent loop validates every
`Transition` with the checker's own function (`envs/contract.py`); an invalid one ends its
trajectory `infra_failed`, counted by reason (`infra/invalid/<reason>`), the first of each
reason logged in one line. And what the contract no longer requires (`reward_components`,
`action_kind`) passes both, with the reward taken as the outcome."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import pytest

from cli_runs import ROOT, run_steprl, train_hang_env
from steprl.engines.base import SamplingParams
from steprl.engines.scripted import ScriptedEngine
from steprl.envs.base import Env, Observation, Transition
from steprl.envs.check import EnvCheckError, check_spec
from steprl.envs.contract import REASONS, transition_problem
from steprl.envs.registry import EnvSpec, get_spec, make_tasks
from steprl.models import tiny
from steprl.rollout.chat import PlainFormat
from steprl.rollout.context import AppendOnly
from steprl.rollout.loop import Budgets, run_episode
from steprl.types import EndReason, Task

GOOD = {"reward_components": {"outcome": 1.0}, "action_kind": "answer"}


class Answers(Env):
    """ "ok" ends the episode with `answer` (a Transition, valid or not); anything else is shown
    an error. Without `answer`: reward 1 and no info at all (no components, no action kind)."""

    def __init__(self, answer: Any = None) -> None:
        self.answer = answer

    def reset(self, task: Task, seed: int) -> Observation:
        return Observation(task.prompt)

    def step(self, action: str) -> Transition:
        if action != "ok":
            return Transition("<error>say ok</error>", 0.0, False)
        return self.answer if self.answer is not None else Transition("", 1.0, True)

    def close(self) -> None:
        pass


def _spec(answer: Any = None) -> EnvSpec:
    calc = get_spec("calculator")

    def tasks(split: str, seed: int, **_: Any) -> Iterator[Task]:
        for t in calc.tasks(split, seed):
            yield Task(t.id, t.prompt, "answers", t.seed)

    return EnvSpec(
        "answers",
        lambda: Answers(answer),
        tasks,
        {"expert": lambda task, h, rng: "ok", "random": lambda task, h, rng: "x"},
        max_turns=2,
    )


def _episode(env: Env, prompt: str | None = None):
    tok = tiny.build_tokenizer()
    task = next(make_tasks("calculator", "train", 0))
    task = task if prompt is None else dataclasses.replace(task, prompt=prompt)
    return asyncio.run(
        run_episode(
            env,
            task,
            engine=ScriptedEngine(["ok"], lambda s: tok.encode(s, add_special_tokens=False)),
            fmt=PlainFormat(tok),
            rule=AppendOnly(),
            sampling=SamplingParams(),
            budgets=Budgets(max_turns=2, max_tokens_per_turn=8),
            group_id="g",
            seed=0,
        )
    )


@pytest.mark.parametrize(
    ("answer", "reason", "says"),
    [
        # the case: a str reward trained as float("0") while the format penalty vanished
        (
            Transition("", "0", True, info={"reward_components": {"outcome": 0.0, "format": -0.4}}),  # type: ignore[arg-type]
            "reward_type",
            "reward='0' (str); it must be a finite float",
        ),
        (Transition("", float("nan"), True, info=GOOD), "reward_not_finite", "reward=nan"),
        (Transition("", True, True, info=GOOD), "reward_type", "reward=True (bool)"),
        (Transition("", 1.0, "yes", info=GOOD), "done_type", "both must be bool"),  # type: ignore[arg-type]
        (Transition(None, 1.0, True, info=GOOD), "observation_type", "it must be str"),  # type: ignore[arg-type]
        (Transition("", 0.5, True, info=GOOD), "components_sum", "sum of reward_components"),
        (
            Transition("", 1.0, True, info={"reward_components": {"outcome": "1"}}),
            "reward_components",
            "finite",
        ),
        ("a string", "not_a_transition", "step() returned str"),
        # issue 44 item 10: a lone surrogate was a tokenizer TypeError in every episode
        (
            Transition("odd \ud800 text", 1.0, True, info=GOOD),
            "text_not_unicode",
            "step()'s observation has a lone surrogate '\\ud800' at index 4",
        ),
    ],
)
def test_what_check_env_rejects_ends_the_trajectory_infra_failed_with_its_reason(answer, reason, says):
    assert reason in REASONS
    problem = transition_problem(answer)
    assert problem is not None and problem.reason == reason and says in problem.message
    with pytest.raises(EnvCheckError, match="finite float|must be|sum of|returned|finite"):
        check_spec(_spec(answer), n_tasks=1)  # the checker says the same ...
    traj = _episode(Answers(answer))  # ... and the loop does not train on it
    assert traj.end is EndReason.INFRA_FAILED and not traj.trainable
    assert traj.info["invalid"] == reason and says in str(traj.info["error"])
    assert traj.steps == () and traj.outcome_reward == 0.0  # no step carries a wrong value


def test_an_env_without_reward_components_or_action_kind_passes_and_its_reward_is_the_outcome():
    report = check_spec(_spec(), n_tasks=2)
    assert report.expert_success_rate == 1.0
    traj = _episode(Answers())
    assert traj.end is EndReason.ANSWERED and traj.outcome_reward == 1.0
    assert traj.steps[-1].info["reward_components"] == {"outcome": 1.0}


@pytest.mark.e2e
def test_a_str_reward_through_training_is_infra_failed_counted_and_said_once(tmp_path):
    rc, out = train_hang_env(
        tmp_path,
        "env.params={bad_on: train, reward_as: str}",  # every training episode; eval is fine
        "runtime.failure_budget=1.0",  # the run goes on: the point is what each step counts
        "trainer.total_steps=2",
    )
    assert rc == 0, out
    said = [line for line in out.splitlines() if "infra/invalid/reward_type" in line]
    assert len(said) == 1 and said[0].startswith("WARNING step 1: env 'hang'"), out  # once per run
    assert "ContractError: reward='0.0' (str); it must be a finite float" in said[0]
    rows = [
        json.loads(line) for line in (tmp_path / "calculator_tiny" / "metrics.jsonl").read_text().splitlines()
    ]
    for row in rows[1:]:
        assert (
            row["end/infra_failed"] == 4
            and row["infra/invalid"] == 4
            and row["infra/invalid/reward_type"] == 4
        )
        assert row["train/rows"] == 0 and row["traj/trainable"] == 0  # nothing trained with a wrong value


class OddText(Answers):
    """`Answers` whose reset observation or system prompt carries `text` (else it shows the task's
    prompt)."""

    def __init__(self, where: str, text: str) -> None:
        super().__init__()
        self.where, self.text = where, text
        self.system_prompt = text if where == "system_prompt" else ""

    def reset(self, task: Task, seed: int) -> Observation:
        return Observation(self.text if self.where == "reset" else task.prompt)


@pytest.mark.parametrize(
    ("where", "says"),
    [
        ("reset", "reset()'s observation has a lone surrogate '\\udfff' at index 3"),
        ("system_prompt", "the env's system_prompt has a lone surrogate '\\udfff' at index 3"),
        ("prompt", "task 'calculator-train-0-0''s prompt has a lone surrogate '\\udfff' at index 3"),
    ],
)
def test_env_text_with_a_lone_surrogate_ends_infra_failed_naming_the_field_and_the_character(where, says):
    """Issue 44 item 10: was `TypeError: TextEncodeInput must be Union[...]` from the tokenizer."""

    def episode(text: str):  # "prompt": a task (e.g. a task file's row with a "\ud800" escape)
        return _episode(OddText(where, text), prompt=text if where == "prompt" else None)

    traj = episode("abc\udfffdef")
    assert traj.end is EndReason.INFRA_FAILED and traj.info["invalid"] == "text_not_unicode"
    assert says in str(traj.info["error"]) and str(traj.info["error"]).isascii()  # printable as is
    assert episode("abc \U0001f600 \u00e9").end is EndReason.ANSWERED  # a valid pair, no lone half


def test_check_env_says_which_field_holds_a_lone_surrogate_in_one_line():
    """`steprl check-env` on an env whose step() observations carry U+D800 (tests/faulty_envs.py)."""
    rc, out = run_steprl(
        ["check-env", "bad_text", "--plugin", "faulty_envs", "--tasks", "2"],
        ROOT,
        pythonpath=[ROOT / "tests"],
    )
    assert rc == 1 and "Traceback" not in out, out
    last = out.splitlines()[-1]
    assert (
        "env 'bad_text'" in last and "step()'s observation has a lone surrogate '\\ud800' at index 4" in last
    )
