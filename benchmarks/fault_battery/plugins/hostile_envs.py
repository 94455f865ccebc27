"""Envs that misbehave, for the battery's envs and report probes, loaded by the `steprl` commands
with ``--plugin hostile_envs`` (this folder, plugins/, on PYTHONPATH: not fault_battery/, whose
http.py would shadow the standard library; importing registers them). Each answers "ok" right
and anything else wrong in one turn, like tests/hosting/hang_envs.py, with
one fault:

* ``close_blocks``: `close()` sleeps an hour (a sync env whose cleanup hangs).
* ``step_spins``: `step()` spins the CPU forever (a sync env in a busy loop: no sleep to wake).
* ``text_env``: its prompt and every observation carry `text` (param `kind`): "surrogate" (a lone
  U+D800), "bidi" (U+202E and an isolate, and a ``</script>`` that would end the report's data
  block), or "huge" (1 MiB of text).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

from steprl.envs.base import Env, Observation, Transition
from steprl.envs.registry import EnvSpec, register
from steprl.types import Task

INJECTED = "</script><script>document.title='pwned'</script>"
TEXTS = {
    "surrogate": "odd \ud800 text",
    "bidi": "\u202eevil\u202c \u2066iso\u2069 " + INJECTED,
    "huge": "x" * (1 << 20),
}


class Simple(Env):
    system_prompt = "say ok"

    def __init__(self, kind: str = "bidi") -> None:
        self.kind = kind

    def reset(self, task: Task, seed: int) -> Observation:
        return Observation(task.prompt)

    def step(self, action: str) -> Transition:
        win = float(action.strip() == "ok")
        info = {"reward_components": {"outcome": win}, "action_kind": "answer"}
        return Transition("done", win, True, info=info)

    def close(self) -> None:
        pass


class CloseBlocks(Simple):
    def close(self) -> None:
        time.sleep(3600)


class StepSpins(Simple):
    def step(self, action: str) -> Transition:
        while True:  # noqa: SIM114 (a busy loop on purpose: nothing interrupts it)
            pass


class TextEnv(Simple):
    def reset(self, task: Task, seed: int) -> Observation:
        return Observation(f"{task.prompt} {TEXTS[self.kind]}")

    def step(self, action: str) -> Transition:
        out = super().step(action)
        return Transition(TEXTS[self.kind], out.reward, True, info=out.info)


def _tasks(name: str) -> Any:
    def tasks(split: str, seed: int, **_: Any) -> Iterator[Task]:
        for i in itertools.count():
            yield Task(id=f"{name}-{split}-{i}", prompt=f"{split} {i}", env=name, seed=seed + i, answer="ok")

    return tasks


for _name, _factory in (("close_blocks", CloseBlocks), ("step_spins", StepSpins), ("text_env", TextEnv)):
    register(
        EnvSpec(
            name=_name,
            factory=_factory,
            tasks=_tasks(_name),
            strategies={"expert": lambda task, h, rng: "ok", "random": lambda task, h, rng: "x"},
            max_turns=1,
            description="fault battery: an env that misbehaves",
        ),
        replace=True,
    )
