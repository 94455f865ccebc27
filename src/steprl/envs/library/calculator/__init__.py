"""The calculator environment: multi-turn integer arithmetic with a safe `calc` tool (ToRL-like)."""

from steprl.envs.library.calculator.env import SYSTEM_PROMPT, CalculatorEnv, calc_tool, verify
from steprl.envs.library.calculator.evaluate import CalcLimits, evaluate
from steprl.envs.library.calculator.policies import STRATEGIES, expert, guess, random_policy
from steprl.envs.library.calculator.tasks import make_tasks, split_of

__all__ = [
    "STRATEGIES",
    "SYSTEM_PROMPT",
    "CalcLimits",
    "CalculatorEnv",
    "calc_tool",
    "evaluate",
    "expert",
    "guess",
    "make_tasks",
    "random_policy",
    "split_of",
    "verify",
]
