"""AppWorld-like stateful apps: contacts, email and calendar over SQLite, verified by unit tests.

Layout: `world` (seeded data) -> `db` (golden database per world, one private copy per
episode, `state_hash`) -> `api` (the functions, one module per app, `api_docs`) -> `checks`
(unit tests over the final state) -> `templates` (task templates with the expert's plans) -> `tasks` (the task
stream) -> `code_actions` (the python executor: snippets in the sandbox, API calls forwarded
to the host) -> `env` (`AppsEnv`) -> `policies` (expert, partial, careless, random, and the
python executor's expert_python, random_python).

`SPEC` describes the env for the registry (it is not registered here); `PYTHON_SPEC` is the
same env with ``executor="python"`` and the python strategies (for `check_spec`; unregistered,
since ``env.params.executor`` selects the executor of the registered "apps").
"""

import dataclasses
import functools

from steprl.envs.library.apps.api import APPS, FUNCTIONS, MUTATING, Apps, api_docs_text
from steprl.envs.library.apps.checks import Change, Report, UnitResult, run_tests
from steprl.envs.library.apps.db import baseline_hash, episode_db, golden, snapshot, state_hash
from steprl.envs.library.apps.env import AppsEnv, system_prompt
from steprl.envs.library.apps.policies import (
    PYTHON_STRATEGIES,
    STRATEGIES,
    careless,
    expert,
    expert_python,
    partial,
    random_policy,
    random_python,
)
from steprl.envs.library.apps.tasks import ENV_NAME, make_tasks, split_of
from steprl.envs.library.apps.templates import TEMPLATES, Template
from steprl.envs.library.apps.world import World, build_world
from steprl.envs.spec import EnvSpec

SPEC = EnvSpec(
    name=ENV_NAME,
    factory=AppsEnv,
    tasks=make_tasks,
    strategies=STRATEGIES,
    max_turns=10,  # the longest expert plan is 5 calls + the answer; careless adds 2 calls
    description="AppWorld-like contacts/email/calendar apps over SQLite, scored by unit tests on the "
    "final state",
)
PYTHON_SPEC = dataclasses.replace(
    SPEC,
    factory=functools.partial(AppsEnv, executor="python"),
    strategies=PYTHON_STRATEGIES,
    description=SPEC.description + "; python executor (sandboxed code actions)",
)

__all__ = [
    "APPS",
    "FUNCTIONS",
    "MUTATING",
    "PYTHON_SPEC",
    "PYTHON_STRATEGIES",
    "SPEC",
    "STRATEGIES",
    "TEMPLATES",
    "Apps",
    "AppsEnv",
    "Change",
    "Report",
    "Template",
    "UnitResult",
    "World",
    "api_docs_text",
    "baseline_hash",
    "build_world",
    "careless",
    "episode_db",
    "expert",
    "expert_python",
    "golden",
    "make_tasks",
    "partial",
    "random_policy",
    "random_python",
    "run_tests",
    "snapshot",
    "split_of",
    "state_hash",
    "system_prompt",
]
