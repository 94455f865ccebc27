"""The apps env's python executor: AppWorld-style code actions in the sandbox, API calls on the host.

(1) the JSON expert's calls written as snippets reach the same final state; (2) variables live
within one episode only; (3) an endless snippet hits the wall clock and the episode goes on;
(4) a snippet reaches neither the episode database nor the host nor the network; (5) malformed
snippets are error observations; (6) `check_spec` passes for the python executor; a sandbox or
API-backend failure is an infrastructure failure. Tests skip (with the probe's reason) only
where this host cannot confine code.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import socket
from pathlib import Path
from typing import Any

import pytest

from steprl.engines.base import SamplingParams
from steprl.engines.scripted import ScriptedEngine
from steprl.envs.base import InfraError, Transition
from steprl.envs.check import check_spec
from steprl.envs.library.apps import (
    PYTHON_SPEC,
    SPEC,
    STRATEGIES,
    TEMPLATES,
    AppsEnv,
    baseline_hash,
    code_actions,
    expert_python,
)
from steprl.envs.library.apps.policies import render_answer, render_call, render_code
from steprl.envs.library.apps.tasks import make_task
from steprl.envs.policy import Policy
from steprl.envs.sandbox import Sandbox, SandboxLimits, probe_capabilities
from steprl.rollout.chat import PlainFormat
from steprl.rollout.context import AppendOnly
from steprl.rollout.loop import Budgets, run_episode
from steprl.types import EndReason, Task

CAPS = probe_capabilities()
_MISSING = [r for g in ("bwrap", "user_namespace", "pid_namespace", "net_namespace") if (r := CAPS.reason(g))]
pytestmark = pytest.mark.skipif(bool(_MISSING), reason="; ".join(_MISSING))
REPO = Path(__file__).resolve().parents[2]


def one_task(template: str, world: int = 0) -> Task:
    """A concrete task of `template` (the first draw that fits the world)."""
    for k in itertools.count():
        task = make_task(TEMPLATES[template], world, random.Random(f"{template}:{k}"), f"t-{template}-{k}", 7)
        if task is not None:
            return task
    raise AssertionError("unreachable")


def run(env: AppsEnv, task: Task, policy: Policy) -> tuple[list[str], list[Transition]]:
    """One episode of `policy` (at most SPEC.max_turns steps): its actions and transitions."""
    env.reset(task, task.seed)
    rng = random.Random(0)
    history: list[tuple[str, str]] = []
    transitions: list[Transition] = []
    for _ in range(SPEC.max_turns):
        action = policy(task, history, rng)
        t = env.step(action)
        history.append((action, t.observation))
        transitions.append(t)
        if t.terminated or t.truncated:
            break
    return [a for a, _ in history], transitions


def output(t: Transition) -> str:
    """The text of an output block observation ("\\n<text>\\n```\\n")."""
    assert t.observation.endswith("\n```\n"), t.observation
    return t.observation.removesuffix("\n```\n").removeprefix("\n")


@pytest.fixture
def env() -> AppsEnv:
    e = AppsEnv(executor="python")
    yield e
    e.close()


# --- (1) the expert's calls as code ----------------------------------------------------------------


def test_expert_calls_as_snippets_reach_the_json_executors_final_state() -> None:
    json_env, python_env = AppsEnv(), AppsEnv(executor="python")
    cases = [(name, 0) for name in TEMPLATES] + [(name, 2) for name in list(TEMPLATES)[::4]]
    try:
        for name, world in cases:
            template, task = TEMPLATES[name], one_task(name, world)
            json_actions, json_steps = run(json_env, task, STRATEGIES["expert"])
            actions, steps = run(python_env, task, expert_python)
            last = steps[-1]
            assert last.info["success"], (name, actions, [t.observation for t in steps])
            assert last.info["state_hash"] == json_steps[-1].info["state_hash"]
            assert (last.info["state_hash"] != baseline_hash(world)) == bool(task.params["changes"])
            assert last.info["tests"] == json_steps[-1].info["tests"]
            cells = [t for t in steps if t.info["action_kind"] == "tool_call"]
            assert len(cells) == template.calls and all(t.info["tool_call_valid"] for t in cells)
            assert [t.info["api_calls"] for t in cells] == [1] * template.calls
            assert actions[-1] == json_actions[-1]  # the same answer
            for code, call in zip(actions[:-1], json_actions[:-1], strict=True):  # the calls, as code
                name_ = json.loads(call.removeprefix("<tool_call>").removesuffix("</tool_call>"))["name"]
                assert f"apis.{name_}(" in code
    finally:
        json_env.close()
        python_env.close()


def test_call_and_positional_arguments_work_like_keyword_calls(env: AppsEnv) -> None:
    task = one_task("contact_delete")
    env.reset(task, task.seed)
    a = output(env.step(render_code("print(apis.contacts_get(id=2) == call('contacts_get', id=2))")))
    b = output(env.step(render_code("print(apis.contacts_get(2)['id'], dir(apis)[:2])")))
    assert a == "True" and b == "2 ['api_docs', 'calendar_cancel']"
    docs = output(env.step(render_code("print(apis.api_docs(app='email'))")))
    assert docs.splitlines()[0].startswith("email_")


# --- (2) state: within an episode, never across -----------------------------------------------------


def test_variables_persist_within_an_episode_and_never_across(env: AppsEnv) -> None:
    task = one_task("contact_delete")
    env.reset(task, task.seed)
    first = env.step(
        render_code("x = 41\nfound = apis.contacts_search(query='')\n_ = open('/tmp/note', 'w').write('a')")
    )
    assert first.info["tool_call_valid"] and output(first) == "(no output)"
    assert output(env.step(render_code("print(x + 1, len(found) > 0)"))) == "42 True"

    other = AppsEnv(executor="python")  # a concurrent episode has its own interpreter
    try:
        other.reset(task, task.seed)
        assert output(other.step(render_code("print(x)"))) == "NameError: name 'x' is not defined"
    finally:
        other.close()

    env.reset(task, task.seed)  # a new episode: fresh interpreter, fresh /tmp, the API still there
    assert output(env.step(render_code("print('x' in globals(), 'found' in globals())"))) == "False False"
    assert output(env.step(render_code("import os\nprint(os.path.exists('/tmp/note'))"))) == "False"
    assert output(env.step(render_code("print(apis.contacts_get(id=2)['id'])"))) == "2"


# --- (3) an endless snippet -------------------------------------------------------------------------


def test_an_endless_snippet_times_out_and_the_episode_goes_on() -> None:
    env = AppsEnv(executor="python", code_limits=SandboxLimits(wall_s=1.0), max_api_calls_per_cell=5)
    task = one_task("contact_delete")
    try:
        env.reset(task, task.seed)
        done = env.step(render_code("x = 1\nprint(apis.contacts_delete(id=1))"))
        assert done.info["tool_call_valid"], done.observation
        hang = env.step(render_code("while True:\n    pass"))
        assert not hang.terminated and not hang.truncated
        assert hang.info["tool_call_valid"] is False and hang.info["interpreter_restarted"] is True
        assert (
            output(hang)
            == "Timeout: the code ran longer than 1s; the interpreter restarted and its variables are lost"
        )
        # A fresh interpreter with the API; the database kept the change made before the timeout.
        after = env.step(render_code("print('x' in globals())\nprint(apis.contacts_get(id=1))"))
        assert output(after) == "False\nApiError: no contact with id 1"
        # An endless loop of API calls that swallows errors: bounded calls, then the wall clock.
        spin = env.step(
            render_code(
                "while True:\n    try:\n        apis.contacts_get(id=2)\n    except ApiError:\n        pass"
            )
        )
        assert spin.info["api_calls"] == 5 and "Timeout" in spin.observation
        last = env.step(render_answer("done"))
        assert last.terminated and last.info["action_kind"] == "answer"
    finally:
        env.close()


# --- (4) isolation ----------------------------------------------------------------------------------

PROBE = """
import json, os, socket
def connect(address):
    try:
        socket.create_connection(address, timeout=2).close()
        return "connected"
    except OSError as exc:
        return type(exc).__name__
try:
    import steprl
    host_code = True
except ImportError:
    host_code = False
files = []
for d, dirs, fs in os.walk("/"):
    dirs[:] = [x for x in dirs if d != "/" or x not in ("usr", "proc", "dev")]
    files += [os.path.join(d, f) for f in fs]
print(json.dumps({
    "root": sorted(os.listdir("/")), "repo": os.path.exists(REPO), "host_code": host_code,
    "pids": sum(p.isdigit() for p in os.listdir("/proc")), "files": sorted(files),
    "net": connect(("1.1.1.1", 80)), "host": connect(("127.0.0.1", PORT)), "uid": os.getuid(),
}))
"""


def test_a_snippet_reaches_neither_the_database_nor_the_host_nor_the_network(env: AppsEnv) -> None:
    task = one_task("contact_delete")
    env.reset(task, task.seed)
    with socket.socket() as server:  # a host service on loopback, like an env server
        server.bind(("127.0.0.1", 0))
        server.listen()
        code = PROBE.replace("REPO", repr(str(REPO))).replace("PORT", str(server.getsockname()[1]))
        seen = json.loads(output(env.step(render_code(code))))
    assert seen["repo"] is False and seen["host_code"] is False
    assert seen["net"] != "connected" and seen["host"] != "connected"
    assert seen["pids"] <= 3 and seen["uid"] != 0
    assert seen["files"] == ["/sandbox/main.py"]  # the session server; no database file anywhere
    assert set(seen["root"]) <= {
        "bin",
        "dev",
        "lib",
        "lib32",
        "lib64",
        "libx32",
        "proc",
        "sandbox",
        "sbin",
        "tmp",
        "usr",
    }
    # Nothing changed the episode database: the API is the only way in.
    assert env.state_hash() == baseline_hash(task.params["world"])


# --- (5) malformed snippets --------------------------------------------------------------------------


def test_malformed_snippets_give_error_observations(env: AppsEnv) -> None:
    task = one_task("contact_delete")
    env.reset(task, task.seed)
    cases = {
        "print(1 +)": "SyntaxError",
        "print(undefined)": "NameError: name 'undefined' is not defined",
        "print('before')\napis.contacts_get(id='x')": "before\nApiError: argument 'id' must be integer",
        "apis.nope()": "ApiError: unknown function 'nope'",
        "apis.contacts_get(id=1, color='red')": "ApiError: unexpected argument 'color'",
        "apis.contacts_search(query={1})": "TypeError: Object of type set is not JSON serializable",
        "apis.contacts_get(1, 2)": "TypeError: contacts_get() takes 1 positional arguments at most",
        "raise SystemExit(3)": "SystemExit: 3",
        "import sandbox_host\nsandbox_host.call([1])": "sandbox_host.RpcError: malformed API call",
    }
    for code, expected in cases.items():
        t = env.step(render_code(code))
        assert not t.terminated and t.info["action_kind"] == "tool_call", code
        assert t.info["tool_call_valid"] is False and t.reward == 0.0, code
        assert output(t).startswith(expected), (code, t.observation)
        assert t.info["error"] == output(t).splitlines()[-1]
    long_output = env.step(render_code("print('x' * 100_000)"))
    assert long_output.info["tool_call_valid"] and len(long_output.observation) < 2048 + 20
    assert env.state_hash() == baseline_hash(task.params["world"])  # failed calls change nothing
    # No complete block, or a JSON call: not an action of this executor (a format penalty).
    for action in (
        "```python\nprint(1)\n```output",
        "```python\nprint(1)```output",
        render_call(("contacts_get", {"id": 1})),
    ):
        t = env.step(action)
        assert t.info["action_kind"] == "invalid" and t.observation.startswith("<error>"), action
        assert t.reward == pytest.approx(-0.1) and not t.terminated


def test_the_api_call_budget_per_snippet_is_enforced() -> None:
    env = AppsEnv(executor="python", max_api_calls_per_cell=3)
    task = one_task("contact_delete")
    try:
        env.reset(task, task.seed)
        t = env.step(render_code("for i in range(5):\n    print(apis.contacts_get(id=2)['id'])"))
        assert output(t) == "2\n2\n2\nApiError: too many calls in one cell (max 3)"
        assert t.info["api_calls"] == 3
        assert output(env.step(render_code("print(apis.contacts_get(id=2)['id'])"))) == "2"  # per snippet
    finally:
        env.close()


# --- (6) the conformance checker ---------------------------------------------------------------------


def test_check_spec_passes_for_the_python_executor() -> None:
    report = check_spec(PYTHON_SPEC, n_tasks=20, seed=0)
    assert report.expert_success_rate == 1.0 and report.random_success_rate < 1.0
    assert 2.0 <= report.mean_expert_tool_calls <= 5.0
    # expert_python also belongs to the registered (JSON) spec, where its code is no action.
    assert check_spec(SPEC, n_tasks=5, seed=1).strategy_success["expert_python"] == 0.0


# --- infrastructure failures ---------------------------------------------------------------------------


def test_a_sandbox_that_cannot_start_is_an_infra_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    # (a path of its own: the probe is cached per path, and test_sandbox.py checks its warnings)
    monkeypatch.setattr(code_actions, "apps_sandbox", lambda: Sandbox(bwrap="/nonexistent/apps/bwrap"))
    env = AppsEnv(executor="python")
    task = one_task("contact_delete")
    env.reset(task, task.seed)
    with pytest.raises(InfraError, match="apt-get install bubblewrap"):
        env.step(render_code("print(1)"))
    env.close()


def test_a_failing_api_backend_is_an_infra_failure_in_the_agent_loop(tokenizer: Any) -> None:
    env = AppsEnv(executor="python")
    task = one_task("contact_delete")
    action = render_code("print(apis.contacts_get(id=2))")
    assert tokenizer.decode(tokenizer.encode(action, add_special_tokens=False)) == action

    class BrokenDatabase(AppsEnv):
        def step(self, action: str) -> Transition:
            assert self.db is not None
            self.db.close()  # the host-side database fails under the API call
            return super().step(action)

    broken = BrokenDatabase(executor="python")
    for e in (env, broken):
        traj = asyncio.run(
            run_episode(
                e,
                task,
                engine=ScriptedEngine(
                    [action, "<answer>done</answer>"], lambda s: tokenizer.encode(s, add_special_tokens=False)
                ),
                fmt=PlainFormat(tokenizer),
                rule=AppendOnly(),
                sampling=SamplingParams(),
                budgets=Budgets(max_tokens_per_turn=200, max_total_tokens=100_000),
                group_id="g",
                seed=0,
            )
        )
        if e is env:
            assert traj.end is EndReason.ANSWERED
            assert traj.steps[0].info["action_kind"] == "tool_call" and traj.steps[0].info["tool_call_valid"]
        else:
            assert traj.end is EndReason.INFRA_FAILED and not traj.trainable
            assert "apps python executor" in traj.info["error"]
        e.close()
