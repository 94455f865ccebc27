"""Generated math word problems with verifiable integer answers and an expert solution program.

Short on purpose (the embedded tiny policy is char-level): "Ann has 12 pens and buys 3 boxes
of 7. How many pens?" The expert's program is the one-line arithmetic, e.g. `print(12+3*7)`.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator

from steprl.types import Task

NAMES = ("Ann", "Bo", "Cy", "Di", "Ed", "Flo", "Gus", "Hal")
ITEMS = ("pens", "cards", "coins", "eggs", "nuts", "cups")

# (template, program) with placeholders a, b, c; both formatted with the same numbers
TEMPLATES: tuple[tuple[str, str], ...] = (
    ("{n} has {a} {i} and buys {b} boxes of {c}. How many {i}?", "{a}+{b}*{c}"),
    ("{n} has {a} {i} and gives away {b}, then gets {c} more. How many {i}?", "{a}-{b}+{c}"),
    ("{n} packs {a} bags of {b} {i} and eats {c}. How many {i} are left?", "{a}*{b}-{c}"),
    ("{n} shares {a} {i} among {b} friends and keeps the rest. How many {i} are left?", "{a}%{b}"),
    ("{n} buys {a} rows of {b} {i}, twice. How many {i}?", "2*{a}*{b}"),
    ("{n} has {a} {i}; {b} friends each have {c} more than {n}. How many {i} in all?", "{a}+{b}*({a}+{c})"),
)


def split_of(prompt: str) -> str:
    return "eval" if int(hashlib.sha256(prompt.encode()).hexdigest(), 16) % 5 == 0 else "train"


def make_tasks(split: str, seed: int, n: int | None = None, *, max_number: int = 30) -> Iterator[Task]:
    """Deterministic in (split, seed); train and eval are disjoint by a hash of the problem text."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng = random.Random(f"code-{seed}")
    made = 0
    while n is None or made < n:
        template, program = rng.choice(TEMPLATES)
        values = {
            "n": rng.choice(NAMES),
            "i": rng.choice(ITEMS),
            "a": rng.randint(2, max_number),
            "b": rng.randint(2, 9),
            "c": rng.randint(2, 9),
        }
        prompt = template.format(**values)
        if split_of(prompt) != split:
            continue
        code = program.format(**values)
        answer = _evaluate(code)
        yield Task(
            id=f"code-{split}-{seed}-{made}",
            prompt=prompt,
            env="code",
            seed=seed + made,
            answer=str(answer),
            params={"program": f"print({code})"},
        )
        made += 1


def _evaluate(expression: str) -> int:
    """The reference answer of our own template (never model text): a tiny arithmetic evaluator."""
    allowed = set("0123456789+-*%() ")
    if not set(expression) <= allowed:
        raise ValueError(f"template produced a non-arithmetic program: {expression!r}")
    value: Callable[[], int] = _Parser(expression).parse
    return value()


class _Parser:
    """Recursive-descent integer arithmetic: + - * % and parentheses."""

    def __init__(self, text: str) -> None:
        self.text = text.replace(" ", "")
        self.pos = 0

    def parse(self) -> int:
        v = self._sum()
        if self.pos != len(self.text):
            raise ValueError(f"trailing input in {self.text!r}")
        return v

    def _sum(self) -> int:
        v = self._product()
        while self.pos < len(self.text) and self.text[self.pos] in "+-":
            op = self.text[self.pos]
            self.pos += 1
            rhs = self._product()
            v = v + rhs if op == "+" else v - rhs
        return v

    def _product(self) -> int:
        v = self._atom()
        while self.pos < len(self.text) and self.text[self.pos] in "*%":
            op = self.text[self.pos]
            self.pos += 1
            rhs = self._atom()
            v = v * rhs if op == "*" else v % rhs
        return v

    def _atom(self) -> int:
        if self.text[self.pos] == "(":
            self.pos += 1
            v = self._sum()
            self.pos += 1  # ")"
            return v
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos].isdigit():
            self.pos += 1
        return int(self.text[start : self.pos])
