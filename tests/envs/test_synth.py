"""`steprl synth` (issue 29): from tool documentation to validated tasks, and the env they run in."""

from __future__ import annotations

import copy
import random
import sys
from pathlib import Path

import pytest
import yaml

import cli_zygote
from steprl.envs.check import check_spec
from steprl.envs.registry import get_spec
from steprl.envs.sandbox import probe_capabilities
from steprl.envs.synth import SynthSpecError, load_spec, parse_spec, synthesize, write_package
from steprl.envs.synth.check import check_tool
from steprl.envs.synth.env import DONE, Episode, SynthEnv, env_spec, make_env, render_call, score
from steprl.envs.synth.templates import TEMPLATES
from steprl.envs.synth.validate import PROBES, play_actions, validate
from steprl.envs.synth.world import diff, encode_diff
from steprl.types import Task

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "configs" / "synth").glob("*.yaml"))
#: files.yaml (SHIPPED[0]) ships a written tool: its code runs, in bubblewrap, when allowed
FILES_SPEC = {"spec": str(SHIPPED[0]), "allow_written_code": True}
SANDBOX = probe_capabilities()
#: a test of files.yaml (or of the written template) skips where bubblewrap cannot run its code
needs_sandbox = pytest.mark.skipif(
    not SANDBOX.usable, reason=f"bubblewrap cannot confine code here: {SANDBOX.problems}"
)


@pytest.fixture(scope="module", params=SHIPPED, ids=lambda p: p.stem)
def shipped(request: pytest.FixtureRequest) -> tuple:
    if "code:" in request.param.read_text() and not SANDBOX.usable:
        pytest.skip(f"{request.param.name} has written code and bubblewrap cannot confine it here")
    spec = load_spec(request.param, allow_written_code=True)
    tasks, report = synthesize(spec)
    return spec, tasks, report


def test_shipped_specs_give_validated_tasks(shipped: tuple) -> None:
    spec, tasks, report = shipped
    assert report.admitted >= 100 and report.validated_share >= 0.95
    assert report.random_success < 0.01 and report.do_nothing_success < 0.01
    assert report.shapes_eval >= 1 and report.eval_tasks >= 1 and report.train_tasks >= 1
    train = {t.params["shape"] for t in tasks if t.params["split"] == "train"}
    held = {t.params["shape"] for t in tasks if t.params["split"] == "eval"}
    assert not train & held  # the eval split is shapes training never sees
    env = make_env(spec)
    assert all(validate(spec, env, t).admitted for t in tasks)  # every admitted task: no probe wins
    assert {t.template for t in spec.tools} <= set(TEMPLATES)
    check_spec(env_spec(spec, tasks), n_tasks=10)


@needs_sandbox
def test_every_template_keeps_its_contract() -> None:
    """Over every tool of every shipped spec; together they use every template."""
    used = set()
    for path in SHIPPED:
        spec = load_spec(path, allow_written_code=True)
        for tool in spec.tools:
            check_tool(spec, tool)
            used.add(tool.template)
    assert used == set(TEMPLATES)


@pytest.mark.parametrize("probe", list(PROBES))
def test_each_probe_is_caught_when_it_would_win(shipped: tuple, probe: str) -> None:
    """A task whose golden state is what the probe reaches is refused, naming the probe."""
    spec, tasks, _ = shipped
    env = make_env(spec)
    task = next(t for t in tasks if len(t.params["plan"]) >= 3)
    play_actions(env, task, PROBES[probe](spec, task)[0], 10_000)
    episode: Episode = env._state
    reached = diff(episode.start, episode.world)
    rigged = Task(
        task.id, task.prompt, task.env, task.seed, None, {**task.params, "golden": encode_diff(reached)}
    )
    verdict = validate(spec, env, rigged)
    assert probe in verdict.probes_won and not verdict.admitted


def test_collateral_changes_cost_the_outcome(shipped: tuple) -> None:
    spec, tasks, _ = shipped
    env = make_env(spec)
    task = next(t for t in tasks if t.params["plan"][-1][0] != "remove")
    plan = [render_call(n, a) for n, a in task.params["plan"]]
    assert play_actions(env, task, plan, 100) == 1.0
    name, args = task.params["plan"][0]
    extra = next(t for t in spec.tools if TEMPLATES[t.template].writes and t.template != "delete")
    # one more write on another record: every asked change made, plus one nobody asked for
    episode = Episode(spec, task, 0)
    for n, a in task.params["plan"]:
        TEMPLATES[spec.tool(n).template].call(spec, spec.tool(n), episode.world, a)
    golden_world = copy.deepcopy(episode.world)
    table = spec.tables[extra.table]
    key = sorted(golden_world[table.name])[0]
    record = golden_world[table.name][key]
    field = extra.writes[0].partition(".")[2]
    if field:
        record[field] = "collateral" if not isinstance(record[field], int) else record[field] + 1000
    else:
        del golden_world[table.name][key]
    episode.world = golden_world
    assert score(spec, episode, task) == 0.0
    partial = parse_spec(
        {**yaml.safe_load(Path(spec.source).read_text()), "tasks": {"partial_credit": True}},
        allow_written_code=True,
    )
    assert 0.0 < score(partial, episode, task) < 1.0


def test_reward_needs_the_state_not_the_answer(shipped: tuple) -> None:
    spec, tasks, _ = shipped
    env = make_env(spec)
    task = tasks[0]
    env.reset(task, 0)
    t = env.step("<answer>" + task.prompt + "</answer>")  # the request echoed: nothing done
    assert t.terminated and t.reward <= 0.0
    assert play_actions(env, task, ["<tool_call>{broken", "<tool_call>{}</tool_call>"], 100) == 0.0


WRITTEN = {
    "name": "t",
    "parameters": {"type": "object", "properties": {"id": {"type": "string"}}},
    "writes": ["a.v"],
    "template": "written",
    "phrase": "touch {id}",
}
BAD = [
    ({"name": "x", "tables": {}, "tools": []}, "tables: needs at least one table"),
    (
        {
            "name": "x",
            "tables": {"a": {"key": "id", "fields": {"v": "colour"}}},
            "tools": [{"name": "t", "reads": ["a.v"]}],
        },
        "tables.a.fields.v: type 'colour' is not a builtin",
    ),
    (
        {
            "name": "x",
            "tables": {"a": {"key": "id", "fields": {"v": "int"}}},
            "tools": [{"name": "t", "reads": ["a.w"]}],
        },
        "table 'a' has no field 'w'",
    ),
    (
        {
            "name": "x",
            "tables": {"a": {"key": "id", "fields": {"v": "int"}}},
            "tools": [{"name": "t", "reads": ["a.v"], "writes": ["a.v"]}],
        },
        "no template implements it",
    ),
    (
        {
            "name": "x",
            "tables": {"a": {"key": "id", "fields": {"v": "int"}}},
            "tools": [{"name": "t", "writes": ["a.v"], "template": "sett"}],
        },
        "'sett' is not one of find, get",
    ),
    (
        {
            "name": "x",
            "tables": {"a": {"key": "id", "fields": {"v": "int"}}},
            "tools": [
                {
                    "name": "t",
                    "reads": ["a.v"],
                    "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}},
                }
            ],
        },
        "does not hold values of type 'id'",
    ),
    (
        {"name": "x", "tables": {"a": {"key": "id", "fields": {"v": "int"}, "rows": 1}}, "tools": []},
        "rows: must be",
    ),
    ({"name": "x", "tabels": {}}, "unknown keys ['tabels']"),
    (
        {"name": "x", "tables": {"a": {"key": "id", "fields": {"v": "int"}}}, "tools": [WRITTEN]},
        "has no code: give code:",
    ),
    (
        {
            "name": "x",
            "tables": {"a": {"key": "id", "fields": {"v": "int"}}},
            "tools": [{**WRITTEN, "code": "def call(world, args:\n"}],
        },
        "its code does not run: SyntaxError",
    ),
]


@pytest.mark.parametrize(("raw", "message"), BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_a_malformed_spec_is_one_line_naming_the_key(raw: dict, message: str) -> None:
    with pytest.raises(SynthSpecError, match=None) as err:
        parse_spec(raw, allow_written_code=True)
    assert message in str(err.value) and "\n" not in str(err.value)


LIBRARY = """
name: library
description: A lending library's books, members and loans.
tables:
  members: {key: card, fields: {name: member_name, fines: int}, rows: 4}
  books: {key: isbn, fields: {title: title, copies: int, shelf: shelf}, rows: 5}
  loans: {key: loan_id, fields: {card: card, isbn: isbn, days: int}, rows: 3}
types:
  member_name: [ines, omar, lena, yuki, tariq]
  title: [dune, emma, ulysses, beloved, walden, ivanhoe]
  shelf: [A1, A2, B1, C3]
  int: {min: 0, max: 30}
tools:
  - {name: member_by_name, description: A member's card number., reads: [members.name], returns: card,
     parameters: {type: object, properties: {name: {type: string}}, required: [name]}}
  - {name: book_by_title, description: A book's ISBN., reads: [books.title], returns: isbn,
     parameters: {type: object, properties: {title: {type: string}}, required: [title]}}
  - {name: copies_of, description: Copies on the shelf., reads: [books.copies],
     parameters: {type: object, properties: {isbn: {type: string}}, required: [isbn]}}
  - {name: lend, description: Lend a book to a member., writes: [loans], returns: loan_id,
     parameters: {type: object, required: [card, isbn, days],
                  properties: {card: {type: string}, isbn: {type: string}, days: {type: integer}}}}
  - {name: fine, description: Add to a member's fines., writes: [members.fines], effect: add,
     parameters: {type: object, properties: {card: {type: string}, amount: {type: integer, x-type: int}}}}
  - {name: shelve, description: Move a book to a shelf., writes: [books.shelf],
     parameters: {type: object, properties: {isbn: {type: string}, shelf: {type: string}}}}
  - {name: return_loan, description: End a loan., writes: [loans],
     parameters: {type: object, properties: {loan_id: {type: string}}}}
"""


def test_a_new_domain_synthesizes_and_checks_from_the_plain_cli(tmp_path: Path) -> None:
    (tmp_path / "library.yaml").write_text(LIBRARY)
    steprl = [sys.executable, "-c", "from steprl.cli import main; main()"]
    made = cli_zygote.run(
        [*steprl, "synth", "library.yaml", "-o", "lib_env"], cwd=tmp_path, capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr + made.stdout
    assert "check-env: ok" in made.stdout and "tasks admitted" in made.stdout
    spec = get_spec("synth", {"path": str(tmp_path / "lib_env")})  # env: {name: synth, params: {path: ...}}
    check_spec(spec, n_tasks=5, env_params={"path": str(tmp_path / "lib_env")})
    bad = tmp_path / "bad.yaml"
    bad.write_text(LIBRARY.replace("reads: [books.copies]", "reads: [books.colour]"))
    refused = cli_zygote.run(
        [*steprl, "synth", "bad.yaml", "-o", "x"], cwd=tmp_path, capture_output=True, text=True
    )
    assert (
        refused.returncode == 2
        and refused.stdout.strip().count("\n") == 0
        and "books.colour" in refused.stdout
    )
    assert not (tmp_path / "x").exists()


@needs_sandbox
def test_package_loads_by_import_path_and_keeps_foreign_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = write_package(SHIPPED[0], tmp_path / "pkg_a", allow_written_code=True)
    monkeypatch.chdir(tmp_path)
    spec = get_spec("pkg_a:SPEC")
    task = next(spec.tasks("eval", 0))
    env = make_env(load_spec(SHIPPED[0], allow_written_code=True))  # what spec.factory() makes
    assert type(spec.factory()) is type(env)
    env.reset(task, 0)
    for n, a in task.params["plan"]:
        env.step(render_call(n, a))
    assert env.step(DONE).reward == 1.0 and report.admitted >= 100
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(SynthSpecError, match="not a package steprl synth wrote"):
        write_package(SHIPPED[0], tmp_path / "mine", allow_written_code=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


@needs_sandbox
def test_admission_replaces_mastered_tasks_live_and_skips_mastered_shapes() -> None:
    """The loop on a synthesized env's never-ending train split, with a learner whose skill on
    a shape grows each time it trains one: retired tasks are replaced, mastered shapes refused."""
    from steprl.training.sources import TaskSplits, make_source
    from steprl.training.sources.admission import AdmissionSource, shape_of
    from steprl.types import EndReason, Group, Trajectory

    spec = get_spec("synth", FILES_SPEC)
    splits = TaskSplits.one(lambda: spec.tasks("train", 0), "synth")
    source = make_source("admission", splits, 0, {"active": 8, "band": [0.2, 0.8], "window": 2})
    assert isinstance(source, AdmissionSource)
    skill: dict[str, float] = {}
    rates = []
    for _ in range(300):
        item = source.next()
        assert item is not None
        task = item[1]
        s = skill.get(shape_of(task), 0.25)
        wins = round(s * 4)
        trajs = tuple(
            Trajectory(task.id, f"{task.id}-{k}", task.env, (), float(k < wins), EndReason.ANSWERED)
            for k in range(4)
        )
        source.observe(Group(task, trajs))
        skill[shape_of(task)] = min(1.0, s + 0.1)
        rates.append(source.metrics())
    last = rates[-1]
    admitted = last["source/active"] - last["source/probation"]  # on probation: not admitted yet
    assert last["source/active"] == 8 and last["source/retired"] > 8
    assert last["source/admitted"] == admitted + last["source/retired"] + last["source/parked"]
    assert last["source/skipped"] > 0  # shapes above the band were not asked for again
    assert all("source/pass_rate" in m for m in rates[8:])


@needs_sandbox
def test_probation_admits_only_tasks_measured_inside_the_band() -> None:
    """A learner that solves a given task always, never or sometimes (by its id): a task is
    admitted on its first group inside the band, rejected otherwise, so the admitted pass rate is
    in the band from the first group on."""
    from steprl.config import ConfigError
    from steprl.training.sources import TaskSplits, make_source, take
    from steprl.training.sources.admission import AdmissionSource
    from steprl.types import EndReason, Group, Trajectory

    spec = get_spec("synth", FILES_SPEC)
    splits = TaskSplits.one(lambda: spec.tasks("train", 0), "synth")

    def group(task: Task, wins: int) -> Group:  # 4 episodes, the first `wins` solved
        won = [float(k < wins) for k in range(4)]
        return Group(
            task,
            tuple(
                Trajectory(task.id, f"{task.id}-{k}", task.env, (), w, EndReason.ANSWERED)
                for k, w in enumerate(won)
            ),
        )

    def first_rates(probe: str) -> tuple[list[float], AdmissionSource]:
        source = make_source("admission", splits, 0, {"active": 8, "window": 2, "probe": probe})
        assert isinstance(source, AdmissionSource)
        rates = []
        for _ in range(40):
            item = source.next()
            assert item is not None
            task = item[1]
            source.observe(group(task, (0, 4, 4, 2)[sum(map(ord, task.id)) % 4]))  # mostly all or none
            if (rate := source.metrics().get("source/pass_rate")) is not None:
                rates.append(rate)
        return rates, source

    probed, source = first_rates("all")
    assert probed and all(r == 0.5 for r in probed)  # only the sometimes-solved ones stay
    m = source.metrics()
    assert m["source/rejected"] > m["source/admitted"] > 0 and m["source/retired"] == 0
    state = source.state_dict()
    assert set(state["probation"]) == {t.id for t in source.active} - set(state["history"])
    unprobed, _ = first_rates("none")
    assert any(not 0.2 <= r <= 0.8 for r in unprobed)  # without: the set as the stream gave it
    unseen_rates, unseen = first_rates("unseen")  # the default: only shapes with no rate yet
    assert unseen_rates[0] == 0.5 and unseen.metrics()["source/rejected"] < m["source/rejected"]
    fresh = make_source("admission", splits, 0, {"active": 8})
    assert isinstance(fresh, AdmissionSource)
    assert fresh.next() is not None and len(fresh.probation) == 8  # the first set: measured
    # a task on probation is not served again while its first group is out (steps in flight)
    ahead = make_source("admission", splits, 0, {"active": 8, "probe": "all"})
    assert isinstance(ahead, AdmissionSource)
    first = take(ahead, 8)
    for _, task in first[:4]:  # half come back, inside the band: admitted
        ahead.observe(group(task, 2))
    assert {t.id for _, t in take(ahead, 4)} == {t.id for _, t in first[:4]}
    with pytest.raises(ConfigError, match="^env.source_params: probe: one of unseen, all, none, got 'some'$"):
        make_source("admission", splits, 0, {"probe": "some"})


ASKING = {**FILES_SPEC, "ask_user": 1.0, "user_error_rate": 0.5}


@needs_sandbox
def test_an_ambiguous_request_needs_the_user_and_the_user_answers_as_the_user() -> None:
    spec = get_spec("synth", ASKING)
    task = next(spec.tasks("train", 0))
    ((name, value),) = task.params["intent"].items()
    assert "(ask me)" in task.prompt and task.params["plan"][0][0] == "ask_user"
    made = spec.factory(**ASKING)
    assert isinstance(made, SynthEnv)
    env: SynthEnv = made
    outcomes = {}
    for seed in range(12):  # the user errs on about half of the episodes
        env.reset(task, seed)
        reply = env.step(render_call("ask_user", {"question": f"which {name}?"}))
        assert reply.info["role"] == "user" and reply.observation.lower().startswith(f"the {name} is")
        told = reply.observation.rstrip(".").rsplit(" ", 1)[1]
        history = [("ask", reply.observation)]
        for _ in task.params["plan"][1:]:
            action = spec.strategies["expert"](task, history, random.Random(0))
            history.append((action, env.step(action).observation))
        outcome = env.step(DONE).reward
        outcomes[seed] = (reply.info["user_error"], outcome, told == str(value))
    assert {err for err, _, _ in outcomes.values()} == {True, False}
    assert all(out == 1.0 and right for err, out, right in outcomes.values() if not err)
    assert all(out == 0.0 and not right for err, out, right in outcomes.values() if err)


def test_erpo_masks_the_users_errors() -> None:
    """grpo_env_std leaves a user-caused failure out of the statistics and gives it 0."""
    import torch

    from steprl.algorithms import advantages as adv

    r, g, e = (
        torch.tensor([1.0, 0.0, 0.0, 1.0]),
        torch.zeros(4, dtype=torch.long),
        torch.zeros(4, dtype=torch.long),
    )
    masked = adv.grpo_env_std(r, g, e, user_error=torch.tensor([False, True, False, False]))
    kept = adv.grpo_env_std(r[[0, 2, 3]], g[[0, 2, 3]], e[[0, 2, 3]])
    assert masked[1] == 0.0 and torch.allclose(masked[[0, 2, 3]], kept)
    assert torch.allclose(kept, torch.tensor([1 / 3, -2 / 3, 1 / 3]) / (1 / 3) ** 0.5)
    assert torch.equal(
        adv.grpo_env_std(r, g, e, user_error=torch.zeros(4, dtype=torch.bool)), adv.grpo_env_std(r, g, e)
    )


@needs_sandbox
def test_user_errors_reach_erpo_from_the_agent_loop(tokenizer) -> None:
    """Expert episodes through the agent loop: the steps the user got wrong are marked, the
    trajectories they failed are flagged for ERPO, which gives them 0, and the reply is a user turn."""
    import asyncio
    from itertools import islice

    import torch

    from steprl.algorithms import advantages as adv
    from steprl.rollout.chat import PlainFormat
    from steprl.rollout.context import AppendOnly
    from steprl.rollout.demos import play_demos
    from steprl.rollout.loop import Budgets
    from steprl.training.loop.step_batch import user_errors

    spec = get_spec("synth", ASKING)
    tasks = list(islice(spec.tasks("train", 0), 16))
    demos = asyncio.run(
        play_demos(
            tasks,
            strategies=spec.strategies,
            weights={"expert": 1.0},
            make_env=lambda t: spec.factory(**ASKING),
            fmt=PlainFormat(tokenizer),
            seed=0,
            rule=AppendOnly(),
            budgets=Budgets(max_turns=12, max_tokens_per_turn=160, max_total_tokens=4000),
        )
    )
    trajs = [d.trajectory for d in demos]
    flags = user_errors(trajs)
    assert flags is not None and 0 < int(flags.sum()) < len(trajs)
    for t, flag in zip(trajs, flags.tolist(), strict=True):
        assert t.steps[0].info["role"] == "user" and bool(t.steps[0].info["user_error"]) == flag
        assert t.outcome_reward == (0.0 if flag else 1.0)  # every failure here is the user's
    rewards = torch.tensor([t.outcome_reward for t in trajs])
    groups = torch.arange(len(trajs)) // 4
    a = adv.grpo_env_std(rewards, groups, torch.zeros(len(trajs), dtype=torch.long), user_error=flags)
    keep = ~flags
    assert torch.all(a[flags] == 0)
    assert torch.equal(
        a[keep], adv.grpo_env_std(rewards[keep], groups[keep], torch.zeros(int(keep.sum()), dtype=torch.long))
    )
    blamed = adv.grpo_env_std(rewards, groups, torch.zeros(len(trajs), dtype=torch.long))
    assert torch.all(blamed[flags] <= 0) and bool((blamed[flags] < 0).any())  # without the mask: blamed


def test_a_simulated_user_env_trains_from_yaml(tmp_path: Path) -> None:
    from steprl.config import load_config
    from steprl.training.loop.trainer import train

    cfg = load_config(
        ROOT / "configs" / "synth_shop_ask_tiny.yaml",
        [
            "model.init=scratch",  # the YAML as shipped, smaller: what is checked is that it trains
            "rollout.tasks_per_step=4",
            "rollout.group_size=2",
            "rollout.max_turns=4",
            "rollout.max_tokens_per_turn=24",
            "rollout.max_total_tokens=400",
            "trainer.total_steps=2",
            "trainer.eval_every=0",
            "trainer.eval_tasks=2",
            "logging.tensorboard=false",
            f"run.output_dir={tmp_path}",
        ],
    )
    result = train(cfg, log=lambda _: None)
    assert len(result.history) == 2


CLINIC = """
name: clinic
description: You keep a clinic's patients and their visits.
mcp: {command: PYTHON, args: [SERVER], ignore: [server_time]}
tables:
  patients:
    key: patient_id
    fields: {name: patient_name, ward: ward, age: int}
    rows: 5
  visits:
    key: visit_id
    fields: {patient: patient_id, doctor: doctor}
    rows: 3
types:
  patient_name: [ada, bo, cy, di, ed, flo, gil]
  ward: [east, west, north]
  doctor: [kim, lee, roy]
  int: {min: 1, max: 90}
tools:
  - {name: find_patient, reads: [patients.name], returns: patient_id}
  - {name: get_age, reads: [patients.age]}
  - {name: move_ward, writes: [patients.ward]}
  - {name: book_visit, writes: [visits], returns: visit_id, phrase: "book {patient} with doctor {doctor}"}
  - {name: cancel_visit, writes: [visits]}
tasks: {count: 100, max_writes: 2, seed: 0}
"""


def test_an_mcp_servers_tool_list_synthesizes_into_a_self_contained_package(tmp_path: Path) -> None:
    """The tool docs come from a real MCP server's tools/list; the package never needs it again;
    a server tool with no state binding, or an entry naming no server tool, is one line."""
    server = Path(__file__).with_name("synth_mcp_server.py")
    spec_text = CLINIC.replace("PYTHON", sys.executable).replace("SERVER", str(server))
    (tmp_path / "clinic.yaml").write_text(spec_text)
    steprl = [sys.executable, "-c", "from steprl.cli import main; main()"]
    made = cli_zygote.run(
        [*steprl, "synth", "clinic.yaml", "-o", "clinic_env"], cwd=tmp_path, capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr + made.stdout
    assert "check-env: ok" in made.stdout
    written = yaml.safe_load((tmp_path / "clinic_env" / "spec.yaml").read_text())
    assert "mcp" not in written and [t["name"] for t in written["tools"]] == [
        "find_patient",
        "get_age",
        "move_ward",
        "book_visit",
        "cancel_visit",
    ]
    moved = next(t for t in written["tools"] if t["name"] == "move_ward")
    assert moved["description"] == "Move a patient to another ward."  # the server's docstring
    assert set(moved["parameters"]["properties"]) == {"patient_id", "ward"}
    spec = get_spec("synth", {"path": str(tmp_path / "clinic_env")})
    assert sum(1 for _ in zip(range(100), spec.tasks("train", 0), strict=False)) == 100
    for bad, says in (
        (spec_text.replace(", ignore: [server_time]", ""), "server_time"),
        (
            spec_text.replace("tasks: {count", "  - {name: discharge, writes: [patients]}\ntasks: {count"),
            "discharge",
        ),
    ):
        (tmp_path / "bad.yaml").write_text(bad)
        refused = cli_zygote.run(
            [*steprl, "synth", "bad.yaml", "-o", "x"], cwd=tmp_path, capture_output=True, text=True
        )
        assert refused.returncode == 2 and says in refused.stdout, refused.stdout + refused.stderr
        assert refused.stdout.strip().count("\n") == 0


@needs_sandbox
def test_an_llm_user_answers_through_an_openai_endpoint_and_its_mistakes_are_marked() -> None:
    """`env.params.user` sends each ask_user to a real loopback /v1/chat/completions (the openai
    SDK): a reply that states the hidden value is a user turn and the task is solved; a reply
    that does not (a random LLM's) is marked user_error, the step ERPO masks."""
    from openai_test_server import ask_the_user_once, chat_server

    with chat_server() as (url, app):
        for model, erred in (("echo", False), ("tiny", True)):
            params = {**ASKING, "user_error_rate": 0.0, "user": {"base_url": url, "model": model}}
            spec, task, env, reply = ask_the_user_once(params)
            assert reply.info["role"] == "user" and reply.info["user_error"] is erred
            history = [("ask", reply.observation)]
            for _ in task.params["plan"][1:]:
                action = spec.strategies["expert"](task, history, random.Random(0))
                history.append((action, env.step(action).observation))
            outcome = env.step(DONE).reward
            assert erred or outcome == 1.0  # the echo user's value solves the task
        sent = app.state.requests[0]
        (value,) = task.params["intent"].values()
        assert (
            sent["messages"][1]["content"] == "which value?" and str(value) in sent["messages"][0]["content"]
        )
    with pytest.raises(SynthSpecError, match="env.params.user.model: required"):
        get_spec("synth", {**ASKING, "user": {"base_url": url}})


@needs_sandbox
def test_the_users_reply_is_a_user_turn_under_a_real_chat_template() -> None:
    """Under Qwen3's template the simulated user's reply opens a user turn of its own, while a
    tool's result is a <tool_response> (the agent loop's `info["role"]`)."""
    import asyncio
    from itertools import islice

    from steprl.models import qwen3_testbed
    from steprl.rollout.chat_format import ChatFormat
    from steprl.rollout.context import AppendOnly
    from steprl.rollout.demos import play_demos
    from steprl.rollout.loop import Budgets

    params = {**ASKING, "user_error_rate": 0.0}
    spec = get_spec("synth", params)
    fmt = ChatFormat(qwen3_testbed.load_tokenizer())
    (demo,) = asyncio.run(
        play_demos(
            list(islice(spec.tasks("train", 0), 1)),
            strategies=spec.strategies,
            weights={"expert": 1.0},
            make_env=lambda t: spec.factory(**params),
            fmt=fmt,
            seed=0,
            rule=AppendOnly(),
            budgets=Budgets(max_turns=12, max_tokens_per_turn=200, max_total_tokens=8000),
        )
    )
    asked, called = (fmt.decode_all(s.observation_ids) for s in demo.trajectory.steps[:2])
    assert demo.trajectory.outcome_reward == 1.0
    assert "<|im_start|>user\nThe " in asked and "<tool_response>" not in asked
    assert "<|im_start|>user\n<tool_response>" in called


@needs_sandbox
def test_the_llm_writer_writes_checked_code_for_a_tool_no_template_expresses(tmp_path: Path) -> None:
    """`template: written` with no code: the writer (a loopback OpenAI endpoint) is asked; code
    that breaks the contract goes back as feedback; the fixed code lands in the package's
    spec.yaml and its tasks validate; a writer that never gets it right, or no writer, is one line."""
    from openai_test_server import TRANSFER_STOCK, chat_server

    from steprl.envs.synth.writer import ToolWriter

    raw = yaml.safe_load(SHIPPED[[p.stem for p in SHIPPED].index("shop")].read_text())
    raw["tools"].append(dict(TRANSFER_STOCK))
    raw["tools"].append({**raw["tools"][-1], "name": "transfer_back", "description": "The same, other way."})
    raw["tasks"]["count"] = 60
    (tmp_path / "shop2.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(
        SynthSpecError, match=r"tools \['transfer_stock', 'transfer_back'\]: template written with no code"
    ):
        write_package(tmp_path / "shop2.yaml", tmp_path / "none")
    with chat_server() as (url, app):
        report = write_package(tmp_path / "shop2.yaml", tmp_path / "pkg", ToolWriter(url, "coder"))
        assert (
            len(app.state.requests) == 4  # each tool: the wrong table, then the fix
            and "wrote another table" in app.state.requests[1]["messages"][2]["content"]
        )
        with pytest.raises(SynthSpecError, match=r"transfer_stock.*failed its checks 2 times"):
            write_package(tmp_path / "shop2.yaml", tmp_path / "bad", ToolWriter(url, "tiny", attempts=2))
    written = yaml.safe_load((tmp_path / "pkg" / "spec.yaml").read_text())
    assert "raise ToolError" in next(t for t in written["tools"] if t["name"] == "transfer_stock")["code"]
    spec = get_spec("synth", {"path": str(tmp_path / "pkg"), "allow_written_code": True})
    tasks = [t for t in islice_tasks(spec, 400) if any(n == "transfer_stock" for n, _ in t.params["plan"])]
    assert report.admitted == 60 and tasks
    check_spec(spec, n_tasks=5, env_params={"path": str(tmp_path / "pkg")})
    env = spec.factory(path=str(tmp_path / "pkg"))
    env.reset(tasks[0], 0)
    for n, a in tasks[0].params["plan"]:
        env.step(render_call(n, a))
    assert env.step(DONE).reward == 1.0


def islice_tasks(spec, n: int) -> list[Task]:
    from itertools import islice

    return list(islice(spec.tasks("train", 0), n))


@needs_sandbox
def test_admission_parks_what_the_learner_cannot_do_and_skips_shapes_below_the_band() -> None:
    """A task whose last groups all failed leaves the set (parked) and its shape is not asked
    for again while below the band (resume-exactness: `check_task_source`, over every source)."""
    from steprl.training.sources import TaskSplits, make_source
    from steprl.training.sources.admission import AdmissionSource, shape_of
    from steprl.types import EndReason, Group, Trajectory

    spec = get_spec("synth", FILES_SPEC)
    splits = TaskSplits.one(lambda: spec.tasks("train", 0), "synth")
    # without probation: with it, a task failed on its first group is rejected, never admitted
    params = {"active": 4, "band": [0.2, 0.8], "window": 2, "probe": "none"}
    source = make_source("admission", splits, 0, params)
    assert isinstance(source, AdmissionSource)
    hard = None
    for _ in range(60):
        item = source.next()
        assert item is not None
        task = item[1]
        hard = hard or shape_of(task)  # the first shape served: the learner never solves it
        trajs = tuple(  # every other episode solved, on every other shape
            Trajectory(
                task.id,
                f"{task.id}-{k}",
                task.env,
                (),
                float(shape_of(task) != hard and k % 2 == 0),
                EndReason.ANSWERED,
            )
            for k in range(4)
        )
        source.observe(Group(task, trajs))
    m = source.metrics()
    assert m["source/parked"] >= 1 and m["source/skipped_hard"] >= 1 and m["source/retired"] == 0
    assert all(shape_of(t) != hard for t in source.active)
    assert m["source/pass_rate"] == 0.5 and m["source/in_band"] == 1.0


def test_key_digits_sets_how_long_ids_are() -> None:
    from steprl.envs.synth.world import make_world

    raw = yaml.safe_load(SHIPPED[[p.stem for p in SHIPPED].index("shop")].read_text())
    short = parse_spec({**raw, "tasks": {**raw["tasks"], "key_digits": 1}})
    assert {len(k) for t in make_world(short, 0).values() for k in t} == {2}  # P3
    raw["tables"]["products"]["rows"] = 12
    with pytest.raises(SynthSpecError, match="do not fit in ids of 1 digit.*raise tasks.key_digits"):
        make_world(parse_spec({**raw, "tasks": {**raw["tasks"], "key_digits": 1}}), 0)


def test_a_compositional_split_holds_out_only_combinations_of_taught_tools() -> None:
    from itertools import islice

    spec = get_spec(
        "synth",
        {"spec": str(SHIPPED[[p.stem for p in SHIPPED].index("shop")]), "holdout_tools_seen": True,
         "holdout_shapes": 0.35, "count": 90},
    )  # fmt: skip
    tasks = spec.tasks("eval", 0)
    held, seen = {}, set()
    for t in tasks:
        if t.id in seen:
            break  # the eval split cycles its fixed tasks
        seen.add(t.id)
        held[t.params["shape"]] = t.params["plan"]
    train = list(islice(spec.tasks("train", 0), 600))
    assert held and not set(held) & {t.params["shape"] for t in train}
    for plan in held.values():  # every tool of a held-out shape: called by a train shape as short
        taught = {n for t in train if len(t.params["plan"]) <= len(plan) for n, _ in t.params["plan"]}
        assert {n for n, _ in plan} <= taught
