"""The apps env: conformance, every template solvable, partial credit, isolation, determinism.

Reliability cases: ENV-08 (concurrent instances of one task never see each other's writes;
reset restores the baseline hash exactly) and ENV-09 (same task, seed and actions give the same
observations, final state hash and reward, in this process and in a fresh one).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from steprl.config import load_config
from steprl.envs.base import Transition
from steprl.envs.check import check_spec
from steprl.envs.library.apps import (
    FUNCTIONS,
    SPEC,
    STRATEGIES,
    TEMPLATES,
    AppsEnv,
    baseline_hash,
    build_world,
    golden,
    make_tasks,
    state_hash,
)
from steprl.envs.library.apps.policies import render_answer, render_call
from steprl.envs.library.apps.tasks import make_task
from steprl.envs.policy import Policy
from steprl.types import Task

ROOT = Path(__file__).resolve().parents[2]
#: sha256 of world 0's golden contents. If you changed the world generator on purpose, update it
#: (and know that saved tasks and eval numbers of older runs no longer describe the same data).
WORLD0_HASH = "170f99e9859e0603973343a265935e81b7fcfbd6908ee6dca81451b6cc7994b7"


def one_task(template: str, world: int = 0, draw: int = 0) -> Task:
    """A concrete task of `template` (the first draw that fits the world)."""
    for k in itertools.count(draw):
        task = make_task(TEMPLATES[template], world, random.Random(f"{template}:{k}"), f"t-{template}-{k}", 7)
        if task is not None:
            return task
    raise AssertionError("unreachable")


def run(env: AppsEnv, task: Task, policy: Policy, seed: int = 0) -> tuple[list[str], list[Transition]]:
    """One episode of `policy` (at most SPEC.max_turns steps): its actions and transitions."""
    env.reset(task, task.seed)
    rng = random.Random(seed)
    history: list[tuple[str, str]] = []
    actions: list[str] = []
    transitions: list[Transition] = []
    for _ in range(SPEC.max_turns):
        action = policy(task, history, rng)
        t = env.step(action)
        actions.append(action)
        transitions.append(t)
        history.append((action, t.observation))
        if t.terminated or t.truncated:
            break
    return actions, transitions


def replay(env: AppsEnv, task: Task, actions: Sequence[str]) -> list[Transition]:
    env.reset(task, task.seed)
    return [env.step(a) for a in actions]


def test_check_spec_passes():
    report = check_spec(SPEC, n_tasks=20, seed=0)
    assert report.expert_success_rate == 1.0
    assert report.random_success_rate < 1.0
    assert report.strategy_success["careless"] == 0.0
    assert 2.0 <= report.mean_expert_tool_calls <= 5.0


def test_templates_count_and_call_range():
    assert len(TEMPLATES) >= 50
    assert all(2 <= t.calls <= 5 for t in TEMPLATES.values()), {t.name: t.calls for t in TEMPLATES.values()}
    assert {t.name.split("_")[0] for t in TEMPLATES.values()} >= {
        "contact",
        "email",
        "calendar",
        "cross",
        "ask",
    }


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_expert_solves_every_template_with_its_minimal_calls(name: str):
    env = AppsEnv()
    for world in range(4):
        task = one_task(name, world)
        assert task.params["num_calls"] == TEMPLATES[name].calls
        actions, transitions = run(env, task, STRATEGIES["expert"])
        last = transitions[-1]
        assert last.terminated and last.info["action_kind"] == "answer"
        assert last.info["success"], (task.prompt, last.info["tests"], actions)
        assert last.info["reward_components"]["outcome"] == 1.0
        calls = [t for t in transitions if t.info["action_kind"] == "tool_call"]
        assert len(calls) == TEMPLATES[name].calls and all(t.info["tool_call_valid"] for t in calls)


def test_partial_credit_hand_checked():
    # "Move X, then email Y about it": tests = [moved, email sent, no collateral].
    task = one_task("cross_move_notify")
    env = AppsEnv()
    _, transitions = run(env, task, STRATEGIES["partial"])
    last = transitions[-1]
    assert [passed for _, passed in last.info["tests"]] == [True, False, True]
    assert last.info["reward_components"]["outcome"] == pytest.approx(2 / 3)
    assert last.reward == pytest.approx(2 / 3) and last.info["success"] is False
    assert sum(t.info["action_kind"] == "tool_call" for t in transitions) == 2  # list + move
    # The same task done fully but with a collateral deletion: [moved, sent, no collateral].
    _, transitions = run(env, task, STRATEGIES["careless"])
    assert [p for _, p in transitions[-1].info["tests"]] == [True, True, False]
    assert transitions[-1].reward == pytest.approx(2 / 3)
    # A question answered "done": [no collateral, answer] -> 1/2.
    _, transitions = run(env, one_task("ask_contact_birthday"), STRATEGIES["partial"])
    assert [p for _, p in transitions[-1].info["tests"]] == [True, False]
    assert transitions[-1].reward == pytest.approx(0.5)


def test_doing_nothing_only_passes_the_collateral_test():
    task = one_task("email_send_two")  # two sends: [sent 1, sent 2, no collateral]
    env = AppsEnv()
    env.reset(task, task.seed)
    t = env.step(render_answer("done"))
    assert [p for _, p in t.info["tests"]] == [False, False, True]
    assert t.reward == pytest.approx(1 / 3)


def _expert_then(task: Task, extra: Sequence[str]) -> Transition:
    """The expert's calls, then `extra` actions, then the expert's answer."""
    env = AppsEnv()
    actions, _ = run(env, task, STRATEGIES["expert"])
    last = replay(env, task, [*actions[:-1], *extra, actions[-1]])[-1]
    assert last.terminated
    return last


def _extra(template: str, task: Task) -> str:
    """One call that changes something the task did not ask for."""
    world = build_world(task.params["world"])
    touched = {c["row"] for c in task.params["changes"]}
    if template == "contact_update_phone":  # an extra deletion
        return render_call(
            ("contacts_delete", {"id": next(c.id for c in world.contacts if c.id not in touched)})
        )
    if template == "email_delete":  # a second email trashed
        other = next(e for e in world.emails if e.folder == "inbox" and e.id not in touched)
        return render_call(("email_delete", {"id": other.id}))
    if template == "email_send":  # an email to someone else
        return render_call(("email_send", {"to": "x@y.example", "subject": "s", "body": "b"}))
    other_event = next(e for e in world.active_events() if e.id not in touched)
    return render_call(("calendar_move", {"id": other_event.id, "start": "07:00"}))


@pytest.mark.parametrize(
    "template", ["contact_update_phone", "email_delete", "email_send", "calendar_cancel"]
)
def test_collateral_changes_fail_the_no_collateral_test(template: str):
    task = one_task(template)
    clean = _expert_then(task, [])
    assert clean.info["success"]
    dirty = _expert_then(task, [_extra(template, task)])
    tests = dict(dirty.info["tests"])
    assert tests.pop("no collateral changes") is False
    assert all(tests.values())  # the required changes are still there
    n = len(dirty.info["tests"])
    assert dirty.reward == pytest.approx((n - 1) / n) and dirty.info["success"] is False


def test_a_duplicate_send_and_an_extra_column_are_collateral():
    task = one_task("email_send")
    env = AppsEnv()
    actions, _ = run(env, task, STRATEGIES["expert"])
    twice = replay(env, task, [*actions[:-1], actions[-2], actions[-1]])[-1]
    assert dict(twice.info["tests"])["no collateral changes"] is False
    task = one_task("contact_update_phone")
    actions, _ = run(env, task, STRATEGIES["expert"])
    call = json.loads(actions[1].removeprefix("<tool_call>").removesuffix("</tool_call>"))
    call["arguments"]["city"] = "Atlantis"  # the right phone, plus a city nobody asked for
    wider = replay(env, task, [actions[0], f"<tool_call>{json.dumps(call)}</tool_call>", actions[-1]])[-1]
    assert [p for _, p in wider.info["tests"]] == [True, False]


# --- ENV-08: isolation -------------------------------------------------------------------------------


def _mutate(env: AppsEnv, i: int) -> None:
    """Three writes that carry the instance's number: a phone, a sent email, a cancelled event."""
    for name, arguments in (
        ("contacts_update", {"id": 1, "phone": f"555-000-{i:04d}"}),
        ("email_send", {"to": "ops@team.example", "subject": f"note {i}", "body": "x"}),
        ("calendar_move", {"id": 1, "start": f"{6 + i % 12:02d}:{i % 60:02d}"}),
    ):
        t = env.step(render_call((name, arguments)))
        assert t.info["tool_call_valid"], t.observation


def _sees_only_itself(env: AppsEnv, i: int) -> bool:
    contact = json.loads(env.apps.call("contacts_get", {"id": 1}))
    notes = json.loads(env.apps.call("email_list", {"folder": "sent", "query": "note ", "limit": 50}))
    return contact["phone"] == f"555-000-{i:04d}" and [m["subject"] for m in notes] == [f"note {i}"]


def test_env08_two_interleaved_episodes_never_share_state():
    task = one_task("contact_update_phone")
    a, b = AppsEnv(), AppsEnv()
    a.reset(task, task.seed)
    b.reset(task, task.seed)
    base = baseline_hash(task.params["world"])
    assert a.state_hash() == b.state_hash() == base
    a.step(render_call(("contacts_delete", {"id": 2})))
    assert b.state_hash() == base  # a's write is invisible to b
    assert b.step(render_call(("contacts_get", {"id": 2}))).observation.startswith("<result>")
    b.step(render_call(("email_send", {"to": "a@b.example", "subject": "hi", "body": "x"})))
    assert json.loads(a.apps.call("email_list", {"folder": "sent", "query": "a@b.example"})) == []
    assert len({a.state_hash(), b.state_hash(), base}) == 3
    a.reset(task, task.seed)
    assert a.state_hash() == base and b.state_hash() != base


def test_env08_256_concurrent_instances_of_one_task():
    task = one_task("cross_move_notify")
    world = task.params["world"]
    envs = [AppsEnv() for _ in range(256)]
    start = threading.Barrier(16)

    def episode(i: int) -> tuple[str, bool, str]:
        if i < 16:
            start.wait()  # the first 16 start together
        env = envs[i]
        env.reset(task, task.seed)
        _mutate(env, i)
        mutated = env.state_hash()
        isolated = _sees_only_itself(env, i)
        env.reset(task, task.seed)
        return mutated, isolated, env.state_hash()

    with ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(episode, range(256)))
    mutated, isolated, after_reset = zip(*results, strict=True)
    assert all(isolated)
    assert len(set(mutated)) == 256 and baseline_hash(world) not in mutated
    assert set(after_reset) == {baseline_hash(world)}
    assert state_hash(golden(world)) == baseline_hash(world)  # the golden copy was never written
    for env in envs:
        env.close()


def test_golden_database_is_read_only():
    with pytest.raises(sqlite3.OperationalError):
        golden(0).execute("DELETE FROM contacts")


def test_reset_gives_the_baseline_hash_for_every_world():
    env = AppsEnv()
    for world in range(4):
        task = one_task("contact_delete", world)
        env.reset(task, task.seed)
        assert env.state_hash() == baseline_hash(world)
        env.step(render_call(("contacts_delete", {"id": 1})))
        assert env.state_hash() != baseline_hash(world)
    assert baseline_hash(0) == WORLD0_HASH
    assert len({baseline_hash(w) for w in range(4)}) == 4


# --- ENV-09: determinism -----------------------------------------------------------------------------


def test_env09_same_task_seed_and_actions_give_the_same_state_and_reward():
    tasks = list(make_tasks("train", 3, 12))
    for task in tasks:
        for policy in ("expert", "partial", "random"):
            env1, env2 = AppsEnv(), AppsEnv()
            first1, first2 = env1.reset(task, task.seed), env2.reset(task, task.seed)
            assert first1 == first2 and env1.state_hash() == env2.state_hash()
            actions, transitions = run(env1, task, STRATEGIES[policy], seed=5)
            again = replay(env2, task, actions)
            assert [(t.observation, t.reward, t.terminated, t.truncated) for t in transitions] == [
                (t.observation, t.reward, t.terminated, t.truncated) for t in again
            ]
            assert env1.state_hash() == env2.state_hash()
            if transitions[-1].terminated and transitions[-1].info["action_kind"] == "answer":
                assert transitions[-1].info["state_hash"] == again[-1].info["state_hash"]
                assert transitions[-1].info["tests"] == again[-1].info["tests"]


_SUBPROCESS = """
import json, random, sys
from steprl.envs.library.apps import AppsEnv, STRATEGIES, baseline_hash, make_tasks
task = list(make_tasks("eval", 11, 3))[2]
env = AppsEnv(); env.reset(task, task.seed); history = []
for _ in range(10):
    a = STRATEGIES["expert"](task, history, random.Random(0))
    t = env.step(a)
    history.append((a, t.observation))
    if t.terminated:
        break
print(json.dumps([baseline_hash(0), task.prompt, t.reward, t.info["state_hash"]]))
"""


def test_env09_hashes_are_the_same_in_a_fresh_process():
    outputs = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        proc = subprocess.run(
            [sys.executable, "-c", _SUBPROCESS],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=True,
        )
        outputs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert outputs[0] == outputs[1]
    assert outputs[0][0] == WORLD0_HASH == baseline_hash(0)
    task = list(make_tasks("eval", 11, 3))[2]
    _, transitions = run(AppsEnv(), task, STRATEGIES["expert"])
    assert outputs[0][1:] == [task.prompt, transitions[-1].reward, transitions[-1].info["state_hash"]]


# --- robustness ----------------------------------------------------------------------------------------

_NAMES = [f.name for f in FUNCTIONS] + ["nope", "contacts", ""]
_KEYS = sorted({k for f in FUNCTIONS for k in (*f.required, *f.optional)}) + ["x", "ID"]
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
_ARGS = st.dictionaries(
    st.sampled_from(_KEYS), _JSON | st.integers(-3, 40) | st.sampled_from(["", "a@b.example"])
)
_CALLS = st.builds(
    lambda name, args: f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>",
    st.sampled_from(_NAMES),
    _ARGS,
)
_ACTIONS = (
    _CALLS | st.text(max_size=80) | st.builds(lambda s: f"<tool_call>{s}</tool_call>", st.text(max_size=40))
)
_ENV = AppsEnv()
_TASK = one_task("cross_move_invite")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=st.lists(_ACTIONS, min_size=1, max_size=3))
def test_malformed_calls_give_error_observations_never_exceptions(actions: list[str]):
    _ENV.reset(_TASK, _TASK.seed)
    for action in actions:
        before = _ENV.state_hash()
        t = _ENV.step(action)
        assert isinstance(t, Transition)
        if t.terminated:
            break
        if t.info["action_kind"] == "invalid" or t.info["tool_call_valid"] is False:
            assert t.observation.startswith("<error>") and t.observation.endswith("</error>")
            assert _ENV.state_hash() == before  # a failed call never half-applies
        else:
            assert t.observation.startswith("<result>")


def test_api_docs_lists_each_app():
    env = AppsEnv(show_api_in_prompt=False)
    task = one_task("contact_delete")
    env.reset(task, task.seed)
    for app in ("contacts", "email", "calendar"):
        obs = env.step(render_call(("api_docs", {"app": app}))).observation
        assert obs.startswith("<result>") and f"{app}_" in obs
        names = [line.split("(")[0] for line in obs.removeprefix("<result>").splitlines()]
        assert all(n.startswith(f"{app}_") for n in names) and len(names) >= 5
    assert env.step(render_call(("api_docs", {"app": "bank"}))).observation.startswith("<error>unknown app")
    assert "api_docs" in env.system_prompt and "contacts_search(" not in env.system_prompt


def test_executor_choice():
    # The python executor is tested in test_apps_python.py; building it starts no sandbox.
    env = AppsEnv(executor="python")
    assert env.executor == "python" and "```output" in env.stop_strings and "apis." in env.system_prompt
    with pytest.raises(ValueError, match="executor"):
        AppsEnv(executor="bash")  # type: ignore[arg-type]


def test_max_turns_truncates_and_reports_the_tests():
    env = AppsEnv(max_turns=2)
    task = one_task("cross_move_notify")
    env.reset(task, task.seed)
    actions, _ = run(AppsEnv(), task, STRATEGIES["expert"])
    assert not env.step(actions[0]).truncated
    t = env.step(actions[1])
    assert t.truncated and not t.terminated
    assert t.info["reward_components"]["outcome"] == 0.0
    assert [p for _, p in t.info["tests"]] == [True, False, True]
    with pytest.raises(RuntimeError):
        env.step(actions[2])


def test_task_stream():
    train = list(make_tasks("train", 0, 300))
    evals = list(make_tasks("eval", 0, 100))
    assert train == list(make_tasks("train", 0, 300))
    assert not {t.prompt for t in train} & {t.prompt for t in evals}
    assert len({t.params["template"] for t in train}) >= 50
    json.dumps([t.params for t in train])  # tasks are plain data
    assert {t.params["world"] for t in train} == {0, 1, 2, 3}
    only = list(make_tasks("train", 0, 10, worlds=1, templates=["calendar_cancel"]))
    assert {(t.params["template"], t.params["world"]) for t in only} == {("calendar_cancel", 0)}
    with pytest.raises(ValueError, match="unknown templates"):
        next(make_tasks("train", 0, templates=["nope"]))


def test_close_is_idempotent_and_reset_after_close_works():
    env = AppsEnv()
    task = one_task("contact_delete")
    env.reset(task, task.seed)
    env.close()
    env.close()
    assert env.db is None
    env.reset(task, task.seed)
    assert env.state_hash() == baseline_hash(task.params["world"])


def test_config_loads():
    cfg = load_config(ROOT / "configs" / "apps_tiny.yaml")
    assert cfg.env.name == "apps"
    assert set(cfg.model.sft.strategies) <= set(SPEC.strategies)
    AppsEnv(**cfg.env.params)
    assert next(make_tasks("train", 0, **cfg.env.task_params)).env == "apps"
