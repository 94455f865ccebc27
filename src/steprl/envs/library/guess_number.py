"""guess_number: find a secret number in 1..high with a `probe` tool (the tool-abandonment case).

The env of docs/your-own-env.md section 6, in the calculator's tag style so that the tiny
char-level model can learn it: ``<probe>4</probe>`` replies ``<result>higher</result>`` (or
``lower`` / ``equal``); ``<answer>6</answer>`` ends the episode, 1 if it names the secret.

Every prompt is the same (``guess 1..8``); the secret is drawn from the task's seed and kept in
`Task.params` (never shown), so train and eval are kept apart by seed ranges (`split_by="seed"`).

Strategies: `expert` bisects with the probe (at most log2(high)+1 turns), `guess` answers a
random number at once (right with probability 1/high), `random` sends any text. A weak warm
start (a few SFT steps on expert and guess transcripts) probes in some episodes but often
botches the bisection; when its probing succeeds less often than a blind guess, RL learns to
stop calling the tool, and held-out success falls to the guessing rate: the silent failure of
issue 27 that the health rules must name (`tool_call_fall`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Mapping, Sequence

from steprl.envs.base import Observation, ToolError
from steprl.envs.library.puzzles.common import check_split
from steprl.envs.policy import Policy
from steprl.envs.rewards import RewardConfig
from steprl.envs.spec import EnvSpec
from steprl.envs.tool_env import FunctionTool, ToolEnv
from steprl.types import Task

_PROBE = re.compile(r"<probe>(-?\d+)</probe>")
_EVAL_OFFSET = 2**30  # eval task seeds are in [2**30, 2**31), train ones below


def system_prompt(high: int) -> str:
    return (
        f"Find the secret number in 1..{high}. Call <probe>n</probe>; it replies <result>higher</result>, "
        "<result>lower</result> or <result>equal</result>. Finish with <answer>n</answer>."
    )


def probe_tool(secret_of: Mapping[str, int]) -> FunctionTool:
    """`probe(n)`: how the secret compares with n. `secret_of` holds the current episode's secret."""

    def probe(n: str) -> str:
        try:
            value = int(n.strip())
        except ValueError:
            raise ToolError(f"probe takes an integer, got {n[:20]!r}") from None
        secret = secret_of["secret"]
        return "higher" if value < secret else "lower" if value > secret else "equal"

    return FunctionTool(
        name="probe",
        description="compare a number with the secret: higher, lower or equal",
        parameters={
            "type": "object",
            "properties": {"n": {"type": "string", "description": "an integer, e.g. 4"}},
            "required": ["n"],
            "additionalProperties": False,
        },
        fn=probe,
    )


def verify(answer: str, task: Task) -> float:
    return 1.0 if answer.strip() == str(task.params["secret"]) else 0.0


class GuessNumberEnv(ToolEnv):
    """A `ToolEnv` with the `probe` tool; the secret comes from the task (`task.params`)."""

    def __init__(self, *, high: int = 8, probe_cost: float = 0.0, max_invalid_actions: int = 2) -> None:
        if high < 2:
            raise ValueError(f"guess_number: high must be >= 2, got {high}.")
        self._secret = {"secret": 1}
        super().__init__(
            [probe_tool(self._secret)],
            verify,
            system_prompt=system_prompt(high),
            rewards=RewardConfig(tool_call_cost=probe_cost),
            max_invalid_actions=max_invalid_actions,
            tag_tools={"probe": "n"},
            format_hint="use <probe>n</probe> or <answer>n</answer>",
        )

    def reset(self, task: Task, seed: int) -> Observation:
        self._secret["secret"] = int(task.params["secret"])
        return super().reset(task, seed)


def make_tasks(split: str, seed: int, n: int | None = None, *, high: int = 8) -> Iterator[Task]:
    """Tasks of `split`: the same prompt, a secret per task seed (train and eval seeds disjoint)."""
    check_split(split, n)
    rng = random.Random(f"guess_number:{split}:{seed}")
    offset = 0 if split == "train" else _EVAL_OFFSET
    i = 0
    while n is None or i < n:
        task_seed = offset + rng.randrange(_EVAL_OFFSET)
        secret = random.Random(task_seed).randint(1, high)
        yield Task(
            id=f"guess-{split}-{task_seed}",
            prompt=f"guess 1..{high}",
            env="guess_number",
            seed=task_seed,
            params={"high": high, "secret": secret},
        )
        i += 1


def _high(task: Task) -> int:
    return int(task.params["high"])


def expert(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """Bisects on the probe's replies; answers once a probe says equal or one number is left."""
    low, high = 1, _high(task)
    for action, observation in history:
        m = _PROBE.fullmatch(action.strip())
        if m is None:
            continue
        value = int(m.group(1))
        if "equal" in observation:
            return f"<answer>{value}</answer>"
        low, high = (value + 1, high) if "higher" in observation else (low, value - 1)
    if low >= high:
        return f"<answer>{low}</answer>"
    return f"<probe>{(low + high) // 2}</probe>"


def guess(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """Answers at once, a random number: right with probability 1/high."""
    return f"<answer>{rng.randint(1, _high(task))}</answer>"


def random_policy(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    return rng.choice(
        [
            "",
            "<probe>x</probe>",
            f"<probe>{rng.randint(-3, 20)}</probe>",
            "<answer>3</answer>",
            "<probe>",
            "hm",
        ]
    )


STRATEGIES: Mapping[str, Policy] = {"expert": expert, "guess": guess, "random": random_policy}

SPEC = EnvSpec(
    name="guess_number",
    factory=GuessNumberEnv,
    tasks=make_tasks,
    strategies=STRATEGIES,
    max_turns=6,
    description="find a secret number with a probe tool (the expert bisects; guessing skips the tool)",
    split_by="seed",
)
