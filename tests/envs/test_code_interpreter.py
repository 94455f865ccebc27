"""The code-interpreter env (ToRL protocol) over the real bubblewrap sandbox."""

import random
from itertools import islice

import pytest

from steprl.envs.check import check_spec
from steprl.envs.library.code_interpreter import SPEC, make_env
from steprl.envs.library.code_interpreter.protocol import extract_answer, extract_program, format_output
from steprl.envs.library.code_interpreter.tasks import make_tasks
from steprl.envs.sandbox import probe_capabilities

needs_sandbox = pytest.mark.skipif(
    not probe_capabilities().usable, reason=f"sandbox unavailable: {probe_capabilities().problems}"
)

RUN = "```python\n{}\n```\n```output"


def test_extract_program_takes_the_last_complete_block():
    assert extract_program("```python\na=1\n```\ntext ```python\nprint(2)\n```\n```output") == "print(2)\n"
    assert extract_program("```python\nprint(1)\n```output") is None  # unclosed block: no program
    assert extract_program("no code ```output") is None


def test_extract_answer_prefers_answer_tag_then_boxed():
    assert extract_answer("so \\boxed{12} or <answer> 7 </answer>") == "7"
    assert extract_answer("the result is \\boxed{12}") == "12"
    assert extract_answer("nothing") is None


def test_format_output_last_error_line_and_head_tail():
    assert format_output("", "Traceback...\n  File x\nNameError: name 'a' is not defined") == (
        "\nNameError: name 'a' is not defined\n```\n"
    )
    long = "".join(str(i % 10) for i in range(300))
    text = format_output(long, None, max_tokens=20).strip("\n`")
    assert text == long[:10] + "..." + long[-10:]
    assert format_output("", None) == "\n(no output)\n```\n"


def test_tasks_deterministic_disjoint_and_correct():
    a = list(islice(make_tasks("train", 3), 50))
    assert a == list(islice(make_tasks("train", 3), 50))
    evals = {t.prompt for t in islice(make_tasks("eval", 3), 200)}
    assert not evals & {t.prompt for t in islice(make_tasks("train", 3), 1000)}
    for t in a:  # the reference program really computes the answer
        assert str(eval(t.params["program"][6:-1])) == t.answer  # our own template text, not model text


@needs_sandbox
def test_check_spec_expert_solves_and_guessing_fails():
    report = check_spec(SPEC, n_tasks=10)
    assert report.expert_success_rate == 1.0
    assert report.strategy_success["guess"] < 0.3


@needs_sandbox
def test_rewards_budget_errors_and_penalty():
    task = next(make_tasks("train", 0))
    env = make_env(max_executions=1, exec_error_penalty=-0.5)
    env.reset(task, 0)
    tr = env.step(RUN.format("print(undefined_name)"))
    assert tr.info["tool_call_valid"] is False and "NameError" in tr.observation
    over = env.step(RUN.format("print(1)"))
    assert "budget" in over.observation and over.info["tool_call_valid"] is False
    end = env.step(f"<answer>{task.answer}</answer>")
    assert end.terminated and end.reward == 0.5  # +1 correct, -0.5 for the failed execution
    assert end.info["reward_components"] == {"outcome": 1.0, "format": 0.0, "cost": -0.5}
    env.reset(task, 0)
    wrong = env.step("<answer>-999</answer>")
    assert wrong.reward == -1.0
    bad = env.step("just text")
    assert bad.info["action_kind"] == "invalid" and bad.observation.startswith("<error>")
    env.close()


@needs_sandbox
def test_stateful_session_keeps_state_within_not_across_trajectories():
    task = next(make_tasks("train", 0))
    a, b = make_env(stateful=True), make_env(stateful=True)
    a.reset(task, 0)
    b.reset(task, 1)
    assert "10" in a.step(RUN.format("x = 5\nprint(x * 2)")).observation
    assert "6" in a.step(RUN.format("print(x + 1)")).observation
    assert "NameError" in b.step(RUN.format("print(x)")).observation
    stateless = make_env()
    stateless.reset(task, 0)
    stateless.step(RUN.format("y = 1"))
    assert "NameError" in stateless.step(RUN.format("print(y)")).observation
    for env in (a, b, stateless):
        env.close()
        env.close()  # idempotent


@needs_sandbox
def test_model_code_cannot_read_the_project():
    env = make_env()
    env.reset(next(make_tasks("train", 0)), 0)
    obs = env.step(RUN.format("print(open('/work/main/pyproject.toml').read()[:20])")).observation
    assert "FileNotFoundError" in obs or "PermissionError" in obs
    env.close()


def test_random_actions_never_raise():
    rng = random.Random(0)
    env = make_env()
    task = next(make_tasks("train", 0))
    env.reset(task, 0)
    for _ in range(50):
        action = "".join(
            rng.choice(["```", "python\n", "```output", "<answer>", "</answer>", "x"]) for _ in range(5)
        )
        if action.rstrip().endswith("```output") and extract_program(action) is not None:
            continue  # executing needs the sandbox; covered above
        tr = env.step(action)
        if tr.terminated:
            env.reset(task, 0)
    env.close()


@needs_sandbox
def test_a_nonzero_exit_status_is_a_failure_the_model_sees_and_the_reward_counts():
    """Issue 23 item 18: `sys.exit(3)` was reported as `ok` (the sandbox's own error kind)."""
    task = next(make_tasks("train", 0))
    env = make_env(max_executions=2, exec_error_penalty=-0.5)
    env.reset(task, 0)
    for code in ("import sys; sys.exit(3)", "import sys; print('warning', file=sys.stderr); sys.exit(3)"):
        tr = env.step(RUN.format(code))
        assert tr.observation == "\nError: the program exited with status 3\n```\n", tr.observation
        assert tr.info["tool_call_valid"] is False and "status 3" in tr.info["error"]
    end = env.step(f"<answer>{task.answer}</answer>")
    assert end.reward == 0.5 and end.info["reward_components"]["cost"] == -0.5  # the failure costs
    env.close()
