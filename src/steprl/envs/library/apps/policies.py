"""Scripted apps policies: `expert`, `partial`, `careless`, `random`, `expert_python` (`STRATEGIES`).

* expert: runs the template's plan (the minimal calls), reading every result back from the
  observations, then answers ("done", or the answer to a question);
* partial: the expert's plan up to and including its first state-changing call, then
  ``<answer>done</answer>``: only the first required change is made (questions get "done");
* careless: the whole plan, then one collateral change (it deletes the last contact of the
  first page of `contacts_search`) before answering: fails the "no collateral" test;
* random: junk, malformed and unknown calls, random (sometimes valid, sometimes destructive)
  calls and answers; never a crash.

Actions are canonical strings: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(`json.dumps` with its default separators) and ``<answer>...</answer>``.

For the python executor (``AppsEnv(executor="python")``), `expert_python` makes the expert's
calls as snippets, one per turn: ``print(apis.contacts_search(query='Alice'))`` in a fenced
block ending at the output marker, reading each result back from the printed output (it
answers "done" when an observation is not a result, e.g. under the JSON executor);
`random_python` sends junk, broken and random snippets and answers. `PYTHON_STRATEGIES` is the
strategy set of that executor (`PYTHON_SPEC` in the package).
"""

from __future__ import annotations

import ast
import json
import random
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from steprl.envs.library.apps.api import FUNCTIONS, MUTATING
from steprl.envs.library.apps.templates import TEMPLATES, Call, Plan
from steprl.envs.library.code_interpreter.protocol import OUTPUT_MARKER
from steprl.envs.policy import Policy
from steprl.types import Task

_RESULT = re.compile(r"<result>(.*)</result>", re.DOTALL)


def render_call(call: Call) -> str:
    name, arguments = call
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def render_answer(text: str) -> str:
    return f"<answer>{text}</answer>"


def parse_result(observation: str) -> Any:
    """The JSON result of a call (text for non-JSON results; None for an error)."""
    match = _RESULT.fullmatch(observation.strip())
    if match is None:
        return None
    try:
        return json.loads(match.group(1))
    except ValueError:
        return match.group(1)


def _plan(task: Task) -> Plan:
    return TEMPLATES[task.params["template"]].plan(task.params["args"])


def follow(
    task: Task, history: Sequence[tuple[str, str]], parse: Callable[[str], Any] = parse_result
) -> tuple[list[Call], Call | str]:
    """Replay the expert's plan on the first observations of `history` (read with `parse`).

    Returns the calls already made (as many as the plan consumed) and what comes next: the
    next call, or the final answer text once the plan is over.
    """
    plan = _plan(task)
    made: list[Call] = []
    try:
        step = next(plan)
        for _, observation in history:
            made.append(step)
            step = plan.send(parse(observation))
    except StopIteration as stop:
        return made, str(stop.value)
    return made, step


def expert(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """The minimal calls, each built from the previous results, then the answer."""
    _, step = follow(task, history)
    return render_answer(step) if isinstance(step, str) else render_call(step)


def partial(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """The expert until its first state-changing call is made, then "done"."""
    made, step = follow(task, history)
    if isinstance(step, str) or any(name in MUTATING for name, _ in made):
        return render_answer("done")
    return render_call(step)


def careless(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """The expert, plus one collateral deletion of a contact before answering."""
    plan_length = TEMPLATES[task.params["template"]].calls
    made, step = follow(task, history[:plan_length])
    if not isinstance(step, str) or len(made) < plan_length:
        return expert(task, history, rng)
    extra = history[plan_length:]
    if not extra:
        return render_call(("contacts_search", {"query": ""}))
    if len(extra) == 1:
        found = parse_result(extra[0][1])
        if isinstance(found, list) and found and isinstance(found[-1], Mapping):
            return render_call(("contacts_delete", {"id": found[-1].get("id")}))
    return render_answer(step)


_JUNK = 'abcxyz0123456789 {}[]":,<>/_-@.'
_TEXTS = ("", " ", "Alice", "done", "2024-05-20", "09:30", "25:00", "a@b.example", "not an email", "x" * 500)


def _value(kind: str, rng: random.Random) -> Any:
    if kind == "integer":
        return rng.choice((rng.randint(-2, 60), 0, 10**12, True))
    if kind == "array":
        return rng.choice(([], ["a@b.example"], [1, 2], "nope"))
    return rng.choice((*_TEXTS, rng.randint(0, 9), None))


def random_policy(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """Junk, broken JSON, unknown tools, random calls (valid or not) and random answers."""

    def junk() -> str:
        return "".join(rng.choice(_JUNK) for _ in range(rng.randint(0, 24)))

    def random_call() -> str:
        f = rng.choice(FUNCTIONS)
        arguments = {k: _value(t, rng) for k, t in f.required.items()}
        arguments.update({k: _value(t, rng) for k, t in f.optional.items() if rng.random() < 0.3})
        if rng.random() < 0.1:
            arguments[junk() or "extra"] = 1
        return render_call((f.name, arguments))

    options = (
        junk,
        random_call,
        random_call,
        random_call,
        lambda: f"<tool_call>{junk()}</tool_call>",
        lambda: render_call(("delete_everything", {})),
        lambda: '<tool_call>{"name": "contacts_get", "arguments": [1]}</tool_call>',
        lambda: f"<tool_call>{junk()}",
        lambda: render_answer(rng.choice(("done", "42", junk() or "?"))),
    )
    return rng.choice(options)()


# --- the python executor -------------------------------------------------------------------------

_NO_RESULT = object()


def render_code(code: str) -> str:
    """A code action: `code` in a fenced python block, ending at the output marker."""
    return f"```python\n{code}\n```\n{OUTPUT_MARKER}"


def render_python_call(call: Call) -> str:
    """The snippet that makes `call` and prints its result, e.g. ``print(apis.x(id=3))``."""
    name, arguments = call
    return render_code(f"print(apis.{name}({', '.join(f'{k}={v!r}' for k, v in arguments.items())}))")


def parse_output(observation: str) -> Any:
    """The printed result of a snippet (a Python literal); `_NO_RESULT` for anything else: no
    output block, an error line, a cut output."""
    text = observation.strip()
    if not text.endswith("```"):
        return _NO_RESULT
    try:
        return ast.literal_eval(text.removesuffix("```").strip())
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NO_RESULT


def expert_python(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """The expert's calls as python snippets (one per turn), then its answer."""
    if any(parse_output(observation) is _NO_RESULT for _, observation in history):
        return render_answer("done")  # not our executor, or a call failed: stop here
    _, step = follow(task, history, parse_output)
    return render_answer(step) if isinstance(step, str) else render_python_call(step)


_SNIPPETS = (
    "print(1 +)",
    "print(undefined_name)",
    "import os\nprint(sorted(os.listdir('/')))",
    "print(apis.nope())",
    "print(call('contacts_get'))",
    "print(apis)",
    "x = [apis.contacts_get(id=i) for i in range(1, 3)]\nprint(len(x))",
    "raise SystemExit(3)",
    "print('x' * 5000)",
)


def random_python(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """Junk, broken snippets, random API calls (valid or not) and random answers."""
    kind = rng.randrange(7)
    if kind == 0:
        return "".join(rng.choice(_JUNK) for _ in range(rng.randint(0, 24)))
    if kind == 1:
        return f"```python\nprint(1)\n{OUTPUT_MARKER}"  # no closed block
    if kind == 2:
        return render_code(rng.choice(_SNIPPETS))
    if kind == 3:
        return render_answer(rng.choice(("done", "42")))
    f = rng.choice(FUNCTIONS)
    arguments = {k: _value(t, rng) for k, t in f.required.items()}
    arguments.update({k: _value(t, rng) for k, t in f.optional.items() if rng.random() < 0.3})
    return render_python_call((f.name, arguments))


STRATEGIES: Mapping[str, Policy] = {
    "expert": expert,
    "partial": partial,
    "careless": careless,
    "random": random_policy,
    "expert_python": expert_python,
}
#: The strategies of the python executor (its "expert" writes code).
PYTHON_STRATEGIES: Mapping[str, Policy] = {"expert": expert_python, "random": random_python}
