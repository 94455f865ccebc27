"""A k-armed bandit (RAGEN's Bandit, made learnable by a tiny model): pull the best arm.

Each task names `k` arms (short words) and gives each a Bernoulli payout probability; the
prompt shows them, e.g. ``Arms: ruby 30%, fern 80%`` (or only the names with
``reveal=False``, as in RAGEN, where the agent must rely on priors or explore). The agent
answers ``<answer>fern</answer>`` (an arm's name in any case, or its 1-based number) once per
pull; the episode ends after `pulls` valid pulls (default 1: single-turn).

Outcome per pull, chosen by the env's `reward` (each scaled by 1/pulls, so a return is in
[0, 1]):

* ``"best"`` (the default): 1 for pulling a best arm, 0 otherwise. Noise-free, and the expert
  scores exactly 1, which `check_env` requires.
* ``"sampled"``: the payout, 1 with the arm's probability, drawn from `random.Random(seed)`
  made at reset (the expert's success rate is then about p_best).
* ``"expected"``: the arm's probability (the payout's mean).

The default is this project's choice, not RAGEN's: RAGEN's bandit rewards the chosen arm's
payoff, drawn at random (its two-armed bandit pays a safe arm a fixed amount and a risky arm a
high amount with some probability), which ``reward="sampled"`` follows with Bernoulli payouts.
"best" was chosen so the expert is exactly solvable and a tiny model's learning signal is
noise-free; pass ``reward="sampled"`` (config: ``env.params.reward: sampled``) for RAGEN's
reward. `configs/bandit_tiny.yaml` sets ``reward: best`` explicitly.

Whatever the mode, a pull's observation (multi-pull episodes) shows the sampled payout,
e.g. ``fern: 1``, so exploration is possible with hidden probabilities. The expert knows the
task's probabilities and pulls a best arm; `guess` pulls a random arm.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

from steprl.envs.library.puzzles.common import (
    MAX_REJECTIONS,
    Drawn,
    PuzzleEnv,
    answer,
    check_split,
    split_of,
    stream_tasks,
)
from steprl.envs.policy import Policy
from steprl.types import Task

ENV_NAME = "bandit"
RewardMode = Literal["best", "sampled", "expected"]
SYSTEM_PROMPT = (
    "Pick the arm most likely to pay out (its chance is shown as a percentage). "
    "Answer with its name: <answer>name</answer>."
)
#: Arm names: short lowercase words, each a few characters (cheap for a char-level model).
ARM_NAMES: tuple[str, ...] = (
    "red", "blue", "gold", "jade", "ruby", "onyx", "mint", "plum", "sand", "snow", "fern", "iron",
    "opal", "pine", "rose", "sage", "teal", "wolf", "bear", "hawk", "lynx", "moth", "newt", "orca",
)  # fmt: skip
_NUMBERS = tuple(str(i) for i in range(1, 10))  # arms may be named by number, 1-based


def render_prompt(arms: Sequence[str], probs: Sequence[float], pulls: int, reveal: bool) -> str:
    """``Arms: ruby 30%, fern 80%`` (names only without `reveal`; ``3 pulls.`` first if pulls > 1)."""
    shown = [f"{a} {round(p * 100)}%" for a, p in zip(arms, probs, strict=True)] if reveal else list(arms)
    head = f"{pulls} pulls. " if pulls > 1 else ""
    return f"{head}Arms: {', '.join(shown)}"


def best_arms(task: Task) -> list[str]:
    """The arms with the highest payout probability."""
    arms, probs = list(task.params["arms"]), [float(p) for p in task.params["probs"]]
    top = max(probs)
    return [a for a, p in zip(arms, probs, strict=True) if p == top]


class BanditEnv(PuzzleEnv):
    """The bandit as an `Env` (see the module docstring); the arms come from `Task.params`.

    Args:
        reward: "best" (default; 1 for a best arm: this project's choice) | "sampled" (the
            payout drawn with the arm's probability, as RAGEN rewards the chosen arm's payoff) |
            "expected" (the arm's probability); see the module docstring.
        scale: every reward multiplied by it (success is unchanged): several bandits of
            different reward scales in one run are the test bed of per-env advantage
            normalisation (`algorithm.task_normalize`, benchmarks/steering_mixture.py).
        max_invalid_actions, format_penalty: see `PuzzleEnv`.
    """

    name = ENV_NAME
    tool_name = "pull"
    move_hint = "answer an arm's name"
    unknown_move = "unknown arm"
    system_prompt = SYSTEM_PROMPT

    def __init__(
        self,
        *,
        reward: RewardMode = "best",
        scale: float = 1.0,
        max_invalid_actions: int = 3,
        format_penalty: float = -0.1,
    ) -> None:
        if reward not in ("best", "sampled", "expected"):
            raise ValueError(f"reward must be 'best', 'sampled' or 'expected', got {reward!r}.")
        super().__init__(
            max_steps=None, max_invalid_actions=max_invalid_actions, format_penalty=format_penalty
        )
        self.reward: RewardMode = reward
        self.scale = scale
        self.arms: list[str] = []
        self.probs: list[float] = []
        self.pulls = 1
        self.prompt = ""
        self.log: list[str] = []
        self._best_pulls = 0
        self._rng = random.Random(0)

    def _load(self, task: Task, seed: int) -> None:
        self.arms = [str(a) for a in task.params["arms"]]
        self.probs = [float(p) for p in task.params["probs"]]
        if not self.arms or len(self.arms) != len(self.probs):
            raise ValueError(f"bandit task {task.id!r} needs as many 'probs' as 'arms'.")
        self.pulls = int(task.params.get("pulls", 1))
        self.prompt = task.prompt
        self.log = []
        self._best_pulls = 0
        self._rng = random.Random(seed)

    def _render(self) -> str:
        """The prompt, then one ``arm: payout`` per pull so far (the anchor state)."""
        return "\n".join([self.prompt, *self.log])

    def _parse(self, text: str) -> str | None:
        key = text.strip().lower()
        if key in _NUMBERS[: len(self.arms)]:  # ASCII digits only: "²".isdigit() is True
            return self.arms[_NUMBERS.index(key)]
        return next((a for a in self.arms if a.lower() == key), None)

    def _observe(self) -> str:
        return f"\n{self.log[-1]}\n"

    def _apply(self, move: str) -> tuple[float, bool, dict[str, Any]]:
        p = self.probs[self.arms.index(move)]
        payout = 1 if self._rng.random() < p else 0
        self.log.append(f"{move}: {payout}")
        best = p == max(self.probs)
        self._best_pulls += best
        score = {"best": float(best), "sampled": float(payout), "expected": p}[self.reward]
        done = len(self.log) >= self.pulls
        # Success: every pull went to a best arm (whatever the payouts were).
        success = done and self._best_pulls == self.pulls
        return (
            self.scale * score / self.pulls,
            done,
            {"arm": move, "payout": payout, "best_arm": best, "success": success},
        )


# --- tasks ----------------------------------------------------------------------------------


def make_tasks(
    split: str,
    seed: int,
    n: int | None = None,
    *,
    k: int = 2,
    pulls: int = 1,
    reveal: bool = True,
) -> Iterator[Task]:
    """`n` bandits of `split` (infinitely many when None), the same ones for the same seed.

    Each has `k` distinct arm names and distinct probabilities from {0.1, ..., 0.9} (so the
    best arm is unique). The split is decided by the hash of the prompt, so train and eval
    never show the same prompt. ``Task.params``: ``arms``, ``probs``, ``pulls``, ``reveal``;
    ``Task.answer``: the best arm.
    """
    check_split(split, n)
    if not 2 <= k <= 9:
        raise ValueError(f"k must be in [2, 9], got {k}.")
    if pulls < 1:
        raise ValueError(f"pulls must be >= 1, got {pulls}.")

    def draw(rng: random.Random) -> Drawn:
        arms = rng.sample(ARM_NAMES, k)
        probs = [tenths / 10 for tenths in rng.sample(range(1, 10), k)]
        prompt = render_prompt(arms, probs, pulls, reveal)
        if split_of(prompt) != split:
            return None
        params = {"arms": tuple(arms), "probs": tuple(probs), "pulls": pulls, "reveal": reveal}
        return prompt, arms[probs.index(max(probs))], params

    give_up = f"no {split!r} bandit in {MAX_REJECTIONS} draws (k={k})."
    return stream_tasks(ENV_NAME, split, seed, n, draw, give_up)


# --- scripted policies ----------------------------------------------------------------------


def expert(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """Pull a best arm (the expert knows the probabilities even when they are hidden)."""
    return answer(best_arms(task)[0])


def guess(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """Pull a uniformly random arm (right about 1/k of the time)."""
    return answer(rng.choice(list(task.params["arms"])))


def random_policy(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """Random arms in every accepted spelling, unknown names, numbers and malformed text."""
    arms = [str(a) for a in task.params["arms"]]
    arm = rng.choice(arms)
    options = (
        lambda: answer(arm),
        lambda: answer(arm.upper()),
        lambda: answer(str(rng.randint(0, len(arms) + 1))),
        lambda: answer(rng.choice(ARM_NAMES)),
        lambda: arm,
        lambda: f"<answer>{arm}",
        lambda: "".join(rng.choice("abcdefgh <>/") for _ in range(rng.randint(0, 10))),
    )
    return rng.choice(options)()


STRATEGIES: Mapping[str, Policy] = {"expert": expert, "guess": guess, "random": random_policy}
