"""warehouse: the new-user trial's env, written as a user writes one (docs/your-own-env.md):
look up hidden stock quantities with a tool, answer their sum. Loaded with
``--plugin warehouse`` (``PYTHONPATH=benchmarks/user_envs``) by `benchmarks/tool_abandonment.py`.

``<look>bolt</look>`` replies ``<result>7</result>``; ``<answer>12</answer>`` ends the episode,
1 if it is the sum of the items the prompt names (``sum bolt nut``). Quantities are drawn per
task seed and never shown, so the tool is the only way to the answer (a guess is right about 1
time in 10 for two items). `params.items`: 2 (the trial's env) or 1 (its one-lookup variant).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence

from steprl.envs.base import Observation, ToolError
from steprl.envs.registry import register
from steprl.envs.spec import EnvSpec
from steprl.envs.tool_env import FunctionTool, ToolEnv
from steprl.types import Task

ITEMS = ("bolt", "nut", "gear", "pipe", "rope", "tape", "wire", "cog")
_LOOK = re.compile(r"<look>(\w+)</look>")
_EVAL_OFFSET = 2**30


def _stock(seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    return {item: rng.randint(1, 9) for item in ITEMS}


class WarehouseEnv(ToolEnv):
    def __init__(self, **_: object) -> None:
        self._stock: dict[str, int] = {}

        def look(item: str) -> str:
            name = item.strip()
            if name not in self._stock:
                raise ToolError(f"no item {name[:20]!r}; items: {' '.join(ITEMS)}")
            return str(self._stock[name])

        tool = FunctionTool(
            name="look",
            description="the stock of one item",
            parameters={
                "type": "object",
                "properties": {"item": {"type": "string"}},
                "required": ["item"],
                "additionalProperties": False,
            },
            fn=look,
        )
        super().__init__(
            [tool],
            verify,
            system_prompt="Call <look>item</look> for an item's stock; finish with <answer>sum</answer>.",
            tag_tools={"look": "item"},
            format_hint="use <look>item</look> or <answer>n</answer>",
        )

    def reset(self, task: Task, seed: int) -> Observation:
        self._stock = _stock(int(task.params["stock_seed"]))
        return super().reset(task, seed)


def verify(answer: str, task: Task) -> float:
    return 1.0 if answer.strip() == str(task.params["answer"]) else 0.0


def make_tasks(split: str, seed: int, n: int | None = None, *, items: int = 2) -> Iterator[Task]:
    rng = random.Random(f"warehouse:{split}:{seed}")
    offset = 0 if split == "train" else _EVAL_OFFSET
    i = 0
    while n is None or i < n:
        task_seed = offset + rng.randrange(_EVAL_OFFSET)
        picked = random.Random(task_seed).sample(ITEMS, items)
        stock = _stock(task_seed)
        yield Task(
            id=f"warehouse-{split}-{task_seed}",
            prompt="sum " + " ".join(picked),
            env="warehouse",
            seed=task_seed,
            params={"items": picked, "stock_seed": task_seed, "answer": sum(stock[p] for p in picked)},
        )
        i += 1


def expert(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """Looks up each item in turn, then answers the sum of the replies."""
    items: list[str] = list(task.params["items"])
    seen: dict[str, int] = {}
    for action, observation in history:
        m = _LOOK.fullmatch(action.strip())
        digits = re.findall(r"\d+", observation)
        if m and digits:
            seen[m.group(1)] = int(digits[0])
    for item in items:
        if item not in seen:
            return f"<look>{item}</look>"
    return f"<answer>{sum(seen[i] for i in items)}</answer>"


def guess(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    n = len(task.params["items"])
    return f"<answer>{sum(rng.randint(1, 9) for _ in range(n))}</answer>"


def random_policy(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    return rng.choice(["", "<look>x</look>", "<look>bolt", "<answer>3</answer>", "hm", "<look></look>"])


SPEC = EnvSpec(
    name="warehouse",
    factory=WarehouseEnv,
    tasks=make_tasks,
    strategies={"expert": expert, "guess": guess, "random": random_policy},
    max_turns=4,
    description="look up hidden stock quantities, answer their sum (the new-user trial's env)",
    split_by="seed",
)
register(SPEC)
