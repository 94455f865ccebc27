"""Envs never turn a policy mistake into an infrastructure failure (issue 13, item 8).

A seeded fuzzer sends at least `N_ACTIONS` malformed actions to every built-in env, in that
env's own action format: raw garbage (random bytes decoded with ``surrogateescape``, lone
surrogates, NUL and control characters, emoji, 1 MB floods, 100k-deep brackets, huge numbers
and power towers) and the same payloads inside the env's tags and JSON tool calls (arguments
of the wrong JSON type, missing or non-string names, 10k-character tool names, values that
break each tool's schema, unbalanced and nested tags). Whatever the action, `step` (and the
`reset` that follows a finished episode) must return a well-formed `Transition` within
`MAX_STEP_S` seconds: an error observation or a terminal (wrong) answer, never an exception,
and never an observation that the agent loop could not tokenize (a lone surrogate) or that
echoes a flood back.

Sandbox-backed actions (the code env, the apps env's python executor) run code in bubblewrap:
their 1000 actions stay in the parsing/dispatch layer (nothing reaches execution), and a
smaller hostile set (`HOSTILE_CODE`, 35 programs, each in a fresh episode) does execute. What
the sandbox tests already cover (infinite loops, fork and memory bombs, disk fill, output
floods, escapes) is not repeated; these programs aim at the env's side of the pipe instead:
undecodable and huge output, NUL and surrogates in the source, a killed or muted interpreter,
garbage on the host-call channel.

``pytest -s`` prints, per env, the actions sent, the error observations, the answers and the
slowest step. `test_fuzz_actions_soak` (slow) runs them again with other seeds: once in the suite,
`STEPRL_SOAK_SEEDS` times when set (10 for a soak).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from steprl.envs.base import Transition, maybe_await
from steprl.envs.registry import get_spec
from steprl.envs.sandbox import probe_capabilities
from steprl.types import Task

N_ACTIONS = 1000  # malformed actions per env (the floor)
MAX_STEP_S = 2.0  # an in-process step (parsing, a tool, the verifier); measured: milliseconds
MAX_EXEC_STEP_S = 12.0  # a step that runs code: the sandbox's wall clock (3-5 s) plus start-up
MAX_OBSERVATION_CHARS = 8192  # an observation never echoes a flood back (envs cut at 2048)

CAPS = probe_capabilities()
needs_sandbox = pytest.mark.skipif(not CAPS.usable, reason=f"sandbox unavailable: {CAPS.problems}")

# --- hostile payloads --------------------------------------------------------------------------------

MB = 2**20
_DIGITS = "9" * 100_000
#: Fixed payloads, built once (the floods are shared, not rebuilt per action).
FIXED: dict[str, tuple[str, ...]] = {
    "flood": (
        "A" * MB,
        "<" * MB,
        "\U0001f600" * (MB // 4),
        "x" * 32_760,  # just under the parser's 32768-char cap: it gets parsed
        "<answer>" * 4_000,  # unclosed opening tags, under the cap: a quadratic scan is 16M steps
        "<answer>" * (MB // 8),
        "```python\n" * 3_000,
        "\\boxed{" * 4_000,
    ),
    "nesting": (
        "[" * 100_000,
        '{"a":' * 50_000,
        "(" * 100_000,
        "(" * 10_000 + "1" + ")" * 10_000,
        "-" * 30_000 + "1",
        "not " * 8_000 + "1",
        "[" * 900 + "]" * 900,  # parses (below the recursion limit), then has to be walked
        "{" * 4_000,
    ),
    "number": (
        _DIGITS,
        _DIGITS[:4_301],  # just over int()'s default 4300-digit limit
        "-" + _DIGITS[:5_000],
        "0" * 10_000 + "7",
        "1" + "0" * 30_000,
        "1e999999",
        "-1e999999",
        "2**99999999",
        "10**10**10",
        "9**9**9**9",
        "(2**64)**(2**64)",
        "1<<10**9",
        "2" + "*2" * 15_000,
        "*".join(str(i) for i in range(1, 400)),  # a factorial, spelled out
        "9" * 64 + "*" + "9" * 64,
        "0x" + "f" * 5_000,
        "1_000_000",
        "\uff11\uff12\uff13",  # full-width digits: int() takes them, [0-9] does not
        "\u0663\u0664",  # Arabic-Indic digits
        "\u00b2",  # a superscript: str.isdigit() is True
        "nan",
        "inf",
        "-0",
        "+5",
        "1.5e308",
        "99999999999999999999",
        "9223372036854775808",  # 2**63: one past SQLite's integers
    ),
    "control": (
        "\x00",
        "\x00" * 1_000,
        "a\x00b",
        "\x1e\x1f\x1c\x1d",  # record separators: the sandbox session's marker byte is \x1e
        "\x1b[31mred\x1b[0m\x1b]0;title\x07",
        "\r\n\r\n",
        "\x7f\x08\x0b\x0c",
        "\u202eevil\u202c",
        "\ufeff\u200b\u200d\u2060",
        "\u2028\u2029",
        "\n" * 5_000,
        "\t \t " * 1_000,
    ),
    "surrogate": (
        "\ud800",
        "\udfff",
        "\udc80\udcff",
        "a\ud800b\udfffc",
        "\ud83d",  # half of an emoji
        "\ud800" * 10_000,
    ),
    "emoji": (
        "\U0001f600",
        "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466" * 100,
        "e\u0301" * 2_000,  # combining accents
        "\U0001f1fa\U0001f1f8",
        "\U000e0041\U000e007f",  # tag characters
        "\ufffd" * 100,
    ),
    "injection": (
        "'; DROP TABLE contacts; --",
        "' OR '1'='1",
        "%s%n%x%p",
        "{0}{1}{__class__}",
        "${HOME}$(id)`id`",
        "</result><answer>42</answer>",
        "<error>fake</error>",
        "```output",
        "<|im_end|><|im_start|>system",
        "\\",
        '"',
        "\\u0000\\ud800",
        "__import__('os').system('id')",
        "../../../../etc/passwd",
    ),
    "empty": ("", " ", "\n", "\t", " " * 1_000),
    # Long runs that a backtracking regex scans again from every start (under the 32768 cap).
    "backtrack": (
        "a" + " " * 30_000 + "b",
        "a" + "\t\n" * 15_000 + "b",
        "x" + "." * 30_000 + "y",
        "a" + "`'\"" * 10_000 + "b",
        "1" + "0" * 30_000 + "x",
        "a" * 30_000 + "!",
        "</say>" + " " * 30_000 + "x",
        "1" * 30_000 + "e",
        "a@" * 15_000,
        "-" * 15_000 + "1." * 5_000,
    ),
}
_CATEGORIES = tuple(FIXED)


def random_text(rng: random.Random) -> str:
    """Garbage of one of a few kinds: bytes via surrogateescape, any code points, tag soup."""
    kind = rng.randrange(4)
    n = rng.choice((1, 7, 64, 500, 4_000))
    if kind == 0:
        return rng.randbytes(n).decode("utf-8", "surrogateescape")
    if kind == 1:
        return "".join(chr(rng.randrange(0x110000)) for _ in range(min(n, 500)))
    if kind == 2:
        alphabet = '<>/{}[]()"\\:,` \n\x00abc123tool_callanswerthink' + "\ud800\U0001f600"
        return "".join(rng.choice(alphabet) for _ in range(n))
    return "".join(chr(rng.randrange(0x20)) for _ in range(min(n, 500)))


def payload(rng: random.Random) -> tuple[str, str]:
    """(category, hostile text)."""
    if rng.random() < 0.25:
        return "random", random_text(rng)
    category = rng.choice(_CATEGORIES)
    return category, rng.choice(FIXED[category])


# --- hostile JSON values, by the JSON type a tool's schema wants --------------------------------------


def _deep(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


_BAD_VALUES: tuple[Any, ...] = (
    None,
    True,
    False,
    0,
    -1,
    1.5,
    10**30,
    -(10**30),
    2**63,
    2**64,
    int("9" * 4_000),  # under the JSON decoder's limit: it arrives as an int
    [],
    [1, "a", None],
    {},
    {"a": {"b": {"c": []}}},
    _deep(500),
    "",
    "1",
)


def bad_value(rng: random.Random, wanted: str | None) -> Any:
    """A value of the wrong type, or the right type with a hostile content."""
    roll = rng.random()
    if roll < 0.4:
        return rng.choice(_BAD_VALUES)
    if wanted == "integer":
        return rng.choice((0, -1, -(2**63), 2**63 - 1, 2**63, 10**18, 10**100, int("9" * 4_000), 3))
    if wanted == "array":
        return rng.choice(
            (
                [payload(rng)[1]],
                [payload(rng)[1] for _ in range(50)],
                ["a@b.co"] * 500,
                [[["x"]]],
                [None, 1, {}],
                [f"u{i}@x.io" for i in range(30)],
            )
        )
    if wanted == "object":
        return {payload(rng)[1][:100]: payload(rng)[1]}
    return payload(rng)[1]  # a hostile string


def json_dumps(value: Any, rng: random.Random) -> str:
    """`value` as JSON text; lone surrogates travel either escaped (ASCII) or raw."""
    try:
        return json.dumps(value, ensure_ascii=rng.random() < 0.5)
    except (ValueError, RecursionError):
        return json.dumps(value, ensure_ascii=True)


# --- the action shape of each env -----------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """How an env reads actions: its tags, its JSON tools (name -> schema), code blocks."""

    tag_tools: tuple[str, ...] = ()
    json_tools: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    answer_tag: str = "answer"
    call_tag: str = "tool_call"
    code: bool = False


CODE_MARKER = "```output"


def _json_call(rng: random.Random, shape: Shape) -> tuple[str, str]:
    """A structurally malicious JSON tool call: (kind, action text)."""
    names = list(shape.json_tools) or ["calc", "search"]
    name = rng.choice(names)
    schema = shape.json_tools.get(name, {})
    props: Mapping[str, Any] = schema.get("properties", {})
    required = list(schema.get("required", ()))
    good_args = {k: "x" for k in required}
    roll = rng.randrange(17)
    obj: Any
    if roll == 0:  # arguments of the wrong JSON type
        obj = {"name": name, "arguments": rng.choice(([], [1, 2], 7, -1.5, None, "3+4", True, [{}]))}
    elif roll == 1:  # no name, or a name that is not a string
        obj = rng.choice(
            (
                {"arguments": good_args},
                {"name": None, "arguments": {}},
                {"name": 7, "arguments": {}},
                {"name": [name], "arguments": {}},
                {"name": {"name": name}, "arguments": {}},
                {"name": True},
                {},
            )
        )
    elif roll == 2:  # very long, unknown or hostile names
        obj = {
            "name": rng.choice(
                ("a" * 10_000, name * 500, name + "\x00", name + "\ud800", "\U0001f600", "", " " + name)
            ),
            "arguments": good_args,
        }
    elif roll == 3 and props:  # each argument hostile, by the schema's type
        obj = {
            "name": name,
            "arguments": {
                k: bad_value(rng, spec.get("type") if isinstance(spec, Mapping) else None)
                for k, spec in props.items()
                if rng.random() < 0.8
            },
        }
    elif roll == 4:  # hostile keys: unknown, empty, NUL, surrogate, huge
        key = rng.choice(("", "\x00", "\ud800", "k" * 10_000, "__class__", "arguments", "self", "**kw"))
        obj = {"name": name, "arguments": {**good_args, key: payload(rng)[1]}}
    elif roll == 5:  # the required string argument hostile, the others absent
        obj = {"name": name, "arguments": {k: payload(rng)[1] for k in required}}
    elif roll == 6:  # not an object at all
        body = rng.choice(("[]", "1", "null", '"calc"', "true", "[" * 5_000, "-" * 100, "1e999", "{}"))
        return "json-shape", f"<{shape.call_tag}>{body}</{shape.call_tag}>"
    elif roll == 7:  # broken JSON text
        text = json.dumps({"name": name, "arguments": good_args})
        body = rng.choice(
            (
                text[: rng.randrange(len(text))],
                text.replace('"', "'"),
                text[:-1] + ",}",
                text + text,
                "{name: " + name + "}",
                text.replace("{", "{/*c*/", 1),
                '{"name": "' + name + '", "arguments": {"a": 1, "a": 2}}',  # duplicate keys
                '{"name": "' + name + '", "arguments": {"a": NaN, "b": Infinity, "c": -Infinity}}',
                '{"name": "' + name + '", "arguments": {"' + (required or ["a"])[0] + '": 1e999}}',
                '{"name": "' + name + '", "arguments": {"a": ' + "9" * 5_000 + "}}",
                '{"name": "' + name + '", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}",
                '{"name": "\\ud800", "arguments": {}}',
                '{"name": "' + name + '", "arguments": {"\\ud800": "\\udfff"}}',
                '{"name": "' + name + '", "arguments": {}}\x00',
            )
        )
        return "json-text", f"<{shape.call_tag}>{body}</{shape.call_tag}>"
    elif roll == 8:  # unbalanced call tags
        text = json.dumps({"name": name, "arguments": good_args})
        t = shape.call_tag
        action = rng.choice(
            (
                f"<{t}>{text}",
                f"{text}</{t}>",
                f"<{t}><{t}>{text}</{t}></{t}>",
                f"</{t}>{text}<{t}>",
                f"<{t}>{text}</{t}><{t}>{text}</{t}>",
                f"<{t}>{text}</{t}><answer>1</answer>",
                f"<{t}>" * 5_000,
                f"<{t} >{text}</{t} >",
                f"<{t.upper()}>{text}</{t.upper()}>",
                f"<think><{t}>{text}</{t}>",
                f"</think><{t}>{text}</{t}>",
                f"<think>{text}</think>",
            )
        )
        return "json-tags", action
    elif roll == 9:  # extra top-level keys, hostile values at the top level
        obj = {"name": name, "arguments": good_args, rng.choice(("id", "type", "\x00", "")): payload(rng)[1]}
    elif roll == 10:  # the right name, each argument a deep structure
        obj = {"name": name, "arguments": {k: _deep(rng.choice((50, 500, 900))) for k in props or ["a"]}}
    elif roll == 11:  # the arguments as a JSON string (a common model mistake)
        obj = {"name": name, "arguments": json.dumps(good_args)}
    elif roll == 12:  # OpenAI-style wrapper
        obj = {"type": "function", "function": {"name": name, "arguments": json.dumps(good_args)}}
    else:  # a plausible call whose argument values are hostile payloads (the common case)
        obj = {"name": name, "arguments": {k: bad_value(rng, None) for k in required or ["a"]}}
    return "json-call", f"<{shape.call_tag}>{json_dumps(obj, rng)}</{shape.call_tag}>"


def _tagged(rng: random.Random, shape: Shape, body: str) -> str:
    """`body` inside one of the env's tags, well-formed or not."""
    tags = [*shape.tag_tools, shape.answer_tag]
    tag = rng.choice(tags)
    other = rng.choice(tags)
    return rng.choice(
        (
            f"<{tag}>{body}</{tag}>",
            f"<{tag}>{body}</{tag}>",
            f"<think>{body}</think><{tag}>{body}</{tag}>",
            f"<{tag}>{body}",
            f"{body}</{tag}>",
            f"<{tag}><{other}>{body}</{other}></{tag}>",
            f"<{tag}>{body}</{other}>",
            f"<{tag}>{body}</{tag}><{other}>{body}</{other}>",
            f"<{tag}>{body[:1_000]}</{tag}>" * 50,
            f"<{tag}>\n{body}\n</{tag}>\n",
            f"<{'x' * 10_000}>{body}</{'x' * 10_000}>",
            f"<{tag}{body[:20]}>{body}</{tag}>",
        )
    )


def _code(rng: random.Random, body: str) -> str:
    """A code-shaped action that must NOT execute: no complete block before the output marker."""
    return rng.choice(
        (
            f"```python\n{body}\n```",  # no output marker: not a run
            f"```python\n{body}{CODE_MARKER}",  # unclosed block
            f"```python\n{body}```output",
            f"{body}\n{CODE_MARKER}",
            f"```py\n{body}\n```\n{CODE_MARKER}",
            f"``` python\n{body}\n```\n{CODE_MARKER}",
            f"{CODE_MARKER}\n```python\n{body}\n```",
            CODE_MARKER,
            f"\\boxed{{{body}}}",
            f"\\boxed{{{body}",
            f"<answer>{body}</answer>```python\n",
        )
    )


_TYPE_CONFUSED: tuple[Any, ...] = (None, 10**30, int("9" * 4_000), [], {}, 1.5, True, "\ud800", -1, "")


def systematic(shape: Shape) -> Iterator[tuple[str, str]]:
    """Every fixed payload raw, in each of the env's tags, as a JSON argument and as code; then
    each JSON tool's arguments, one by one, with a value of the wrong type (rotating)."""
    names = list(shape.json_tools)
    i = 0
    for category, bodies in FIXED.items():
        for body in bodies:
            yield f"raw:{category}", body
            for tag in (*shape.tag_tools, shape.answer_tag):
                yield f"tag:{category}", f"<{tag}>{body}</{tag}>"
            if names:
                name = names[i % len(names)]
                schema = shape.json_tools[name]
                keys = list(schema.get("required", ())) or list(schema.get("properties", {})) or ["a"]
                call = {"name": name, "arguments": {**{k: "x" for k in keys}, keys[i % len(keys)]: body}}
                yield (
                    "json-call",
                    f"<{shape.call_tag}>{json.dumps(call, ensure_ascii=False)}</{shape.call_tag}>",
                )
            if shape.code:
                yield f"code:{category}", f"```python\n{body}\n```"
            i += 1
    for name, schema in shape.json_tools.items():
        for key in schema.get("properties", {}):
            value = _TYPE_CONFUSED[i % len(_TYPE_CONFUSED)]
            i += 1
            call = {"name": name, "arguments": {k: "x" for k in schema.get("required", ())} | {key: value}}
            yield "json-call", f"<{shape.call_tag}>{json.dumps(call)}</{shape.call_tag}>"


def actions(seed: int, shape: Shape, n: int) -> Iterator[tuple[str, str]]:
    """At least `n` deterministic (kind, action) pairs: the `systematic` ones, then a seeded
    random mix of raw garbage, tagged payloads and bad calls (at least half of `n`)."""
    fixed = list(systematic(shape))
    yield from fixed
    rng = random.Random(seed)
    for _ in range(max(n - len(fixed), n // 2)):
        roll = rng.random()
        category, body = payload(rng)
        if shape.json_tools and roll < 0.35:
            yield _json_call(rng, shape)
        elif shape.code and roll < 0.6:
            action = _code(rng, body)
            if action.rstrip().endswith(CODE_MARKER) and "```python\n" in action.split(CODE_MARKER)[0]:
                head = action.split(CODE_MARKER)[0]
                if "```" in head.split("```python\n", 1)[1]:  # would be a complete block: defuse
                    action = action.replace("```python\n", "```py\n")
            yield f"code:{category}", action
        elif roll < 0.75:
            yield f"tag:{category}", _tagged(rng, shape, body)
        elif roll < 0.8:
            yield "json-call", _json_call(rng, shape)[1]  # a call to an env without JSON tools
        else:
            yield f"raw:{category}", body


# --- hostile programs (executed) ----------------------------------------------------------------------

#: Programs aimed at the env's side of the sandbox pipe (see the module docstring).
HOSTILE_CODE: tuple[str, ...] = (
    "import sys\nsys.stdout.buffer.write(bytes(range(256)) * 64)",
    "import sys\nsys.stdout.buffer.write(b'\\xed\\xa0\\x80' * 1000)",  # a surrogate, UTF-8-encoded
    "print('\\ud800' * 100)",
    "print('\\x1e' * 1000 + '0\\n')",  # the session marker's separator byte
    "print(10**10**5)",
    "print(len(str(2**100000)))",
    "x = '\x00'",  # a NUL in the source
    "print('\ud800')",  # a surrogate in the source
    "def f(n):\n    return f(n + 1)\nf(0)",
    "import os\nos._exit(0)",
    "import os\nos._exit(255)",
    "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
    "import os\nos.close(1)\nos.close(2)",
    "import sys\nsys.stdout = None\nsys.stderr = None\nprint(1)",
    "import os\nos.write(3, b'garbage\\n' * 100)",
    "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'{\"x\":' * 1000)\n"
    "    except OSError:\n        pass",
    "import os\nfor fd in range(0, 64):\n    try:\n        os.close(fd)\n    except OSError:\n        pass",
    "raise SystemExit(2**64)",
    "raise KeyboardInterrupt",
    "import sys\nsys.stderr.write('E' * 200000)",
    "print('\\n' * 100000)",
    "import builtins\nbuiltins.print = None\nbuiltins.__import__ = None",
    "import sys\nsys.setrecursionlimit(10**9)\nexec('(' * 200000 + ')' * 200000)",
    "globals().clear()",
    "import gc\ngc.disable()\nx = [[] for _ in range(10**6)]\nprint(len(x))",
    "print(end='no newline at all' * 1000)",
    "import sys\nprint('\\r\\x1b[2J' * 1000, file=sys.stderr)\nraise ValueError('\\ud800')",
    "class E(Exception):\n    def __str__(self):\n        raise RuntimeError('no str')\nraise E()",
    "import threading\nthreading.Thread(target=lambda: print('late' * 100), daemon=True).start()",
    "print(repr(b'\\x00' * 100))\n" * 20,
    "import sandbox_host\nsandbox_host.call({'name': 'x' * 100000, 'arguments': {}})",
    "import sandbox_host\nsandbox_host.call({'name': 'contacts_get', 'arguments': {'id': 10**30}})",
    "import sandbox_host\nsandbox_host.call({'name': 'contacts_search', 'arguments': {'query': '\\ud800'}})",
    "apis.contacts_search(query='x' * 1000000)",
    "apis.calendar_create(title='t', date='2024-01-01', start='09:00', end='10:00', "
    "attendees=['a@b.co'] * 10000)",
)


# --- the harness ------------------------------------------------------------------------------------


@dataclass
class Stats:
    """What one env made of the fuzz."""

    env: str
    sent: int = 0
    invalid: int = 0  # action_kind "invalid": an <error> observation and the format penalty
    tool_errors: int = 0  # a call the env rejected or that failed (tool_call_valid False)
    tool_ok: int = 0  # a call that ran (malformed-looking text can still be a legal call)
    answers: int = 0  # a terminal answer (scored, usually wrong)
    resets: int = 0
    executed: int = 0  # steps that ran code in the sandbox
    max_step_s: float = 0.0
    slowest: str = ""
    failures: list[str] = field(default_factory=list)
    by_kind: Counter[str] = field(default_factory=Counter)

    @property
    def errors(self) -> int:
        """Error observations the policy sees (invalid actions and rejected calls)."""
        return self.invalid + self.tool_errors

    def row(self) -> str:
        return (
            f"{self.env:<22} sent {self.sent:>5}  errors {self.errors:>5} (invalid {self.invalid:>4}, "
            f"rejected calls {self.tool_errors:>4})  ok calls {self.tool_ok:>4}  answers {self.answers:>4}  "
            f"executed {self.executed:>3}  resets {self.resets:>4}  max step {self.max_step_s * 1000:8.1f} ms"
            f" ({self.slowest})"
        )


def _short(text: str, limit: int = 100) -> str:
    shown = ascii(text[:limit])
    return shown + (f"...(+{len(text) - limit} chars)" if len(text) > limit else "")


def check_transition(t: Any, kind: str, action: str) -> str | None:
    """Why `t` is not a well-formed answer to a malformed action, or None."""
    if not isinstance(t, Transition):
        return f"step returned {type(t).__name__}, not a Transition"
    if not isinstance(t.observation, str):
        return f"observation is {type(t.observation).__name__}"
    try:
        t.observation.encode("utf-8")
    except UnicodeEncodeError:
        return f"observation is not UTF-8 text (the loop cannot tokenize it): {_short(t.observation)}"
    if len(t.observation) > MAX_OBSERVATION_CHARS:
        return f"observation of {len(t.observation)} chars echoes the flood back"
    if isinstance(t.reward, bool) or not isinstance(t.reward, int | float) or not math.isfinite(t.reward):
        return f"reward {t.reward!r} is not a finite number"
    components = t.info.get("reward_components")
    if isinstance(components, Mapping) and abs(sum(components.values()) - t.reward) > 1e-9:
        return f"reward {t.reward} != sum of components {dict(components)}"
    kind_seen = t.info.get("action_kind")
    if kind_seen == "invalid" and not (t.observation or t.terminated or t.truncated):
        return "an invalid action got no error observation and did not end the episode"
    return None


class Harness:
    """Drives one env through a stream of actions, resetting after every finished episode."""

    def __init__(self, name: str, env: Any, tasks: Iterator[Task]) -> None:
        self.env, self.tasks = env, tasks
        self.stats = Stats(name)
        self.loop = asyncio.new_event_loop()
        self._live = False

    def _run(self, value: Any) -> Any:
        return self.loop.run_until_complete(maybe_await(value))

    def _reset(self) -> None:
        task = next(self.tasks)
        try:
            self._run(self.env.reset(task, task.seed))
        except Exception as exc:
            self.stats.failures.append(f"reset({task.id}) raised {type(exc).__name__}: {_short(str(exc))}")
            raise
        self.stats.resets += 1
        self._live = True

    def send(self, kind: str, action: str, *, limit_s: float = MAX_STEP_S) -> Transition | None:
        if not self._live:
            self._reset()
        stats = self.stats
        stats.sent += 1
        stats.by_kind[kind] += 1
        t0 = time.perf_counter()
        try:
            t = self._run(self.env.step(action))
        except Exception as exc:
            stats.failures.append(
                f"[{kind}] {_short(action)} raised {type(exc).__name__}: {_short(str(exc), 200)}"
            )
            self._live = False
            return None
        elapsed = time.perf_counter() - t0
        if elapsed > stats.max_step_s:
            stats.max_step_s, stats.slowest = elapsed, kind
        problem = check_transition(t, kind, action)
        if problem is None and elapsed > limit_s:
            problem = f"took {elapsed:.2f} s (limit {limit_s} s)"
        if problem is not None:
            stats.failures.append(f"[{kind}] {_short(action)}: {problem}")
        if isinstance(t, Transition):
            kind_seen = t.info.get("action_kind")
            valid = t.info.get("tool_call_valid")
            stats.invalid += kind_seen == "invalid"
            stats.answers += kind_seen == "answer"
            stats.tool_errors += kind_seen == "tool_call" and valid is False
            stats.tool_ok += kind_seen == "tool_call" and valid is True
            if t.terminated or t.truncated:
                self._live = False
        return t

    def end_episode(self) -> None:
        """The next `send` starts a new episode (the env is reset first)."""
        self._live = False

    def close(self) -> None:
        try:
            self._run(self.env.close())
        finally:
            self.loop.close()


def _cycle(make: Callable[[], Iterator[Task]]) -> Iterator[Task]:
    while True:
        yield from make()


@dataclass(frozen=True)
class Case:
    """An env to fuzz: how to build it and its tasks, the shape of its actions."""

    make_env: Callable[[], Any]
    make_tasks: Callable[[], Iterator[Task]]
    shape: Shape
    executes: bool = False  # runs code in the sandbox (hostile programs too)


def _registered(name: str, **params: Any) -> Callable[[], Any]:
    return lambda: get_spec(name).factory(**params)


def _tasks(name: str, n: int = 50) -> Callable[[], Iterator[Task]]:
    return lambda: get_spec(name).tasks("train", 0, n)


def _json_tools(env: Any) -> dict[str, Mapping[str, Any]]:
    return {name: tool.parameters for name, tool in getattr(env, "tools", {}).items()}


def _apps_shape() -> Shape:
    from steprl.envs.library.apps import FUNCTIONS

    return Shape(json_tools={f.name: f.parameters for f in FUNCTIONS})


def _gym_case() -> Case:
    pytest.importorskip("gymnasium")
    from steprl.envs.adapters.gym_yaml import gym_spec

    spec = gym_spec({"id": "FrozenLake-v1", "kwargs": {"is_slippery": False}})
    return Case(spec.factory, lambda: spec.tasks("train", 0, 50), Shape())


def _mcp_case() -> Case:
    pytest.importorskip("mcp")
    from mcp import StdioServerParameters

    from steprl.envs.adapters.mcp_env import MCPToolEnv
    from steprl.envs.adapters.mcp_pool import MCPPool

    server = StdioServerParameters(
        command=sys.executable, args=[str(Path(__file__).with_name("mcp_test_server.py"))]
    )
    pool = MCPPool(server, max_servers=1)  # one warm server for every episode: starts cost ~1 s
    task = Task(id="mcp-fuzz", prompt="What is 2 plus 3?", env="mcp-test", answer="5")

    def verify(answer: str, task: Task) -> float:
        return 1.0 if answer.strip() == task.answer else 0.0

    def make() -> Any:
        # Only the well-behaved tools: `crash` and `sleep` are infrastructure failures by design.
        return MCPToolEnv(server, verify, include_tools=("add", "lookup"), pool=pool)

    shape = Shape(
        json_tools={
            "add": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
            "lookup": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
        }
    )
    return Case(make, lambda: iter([task] * 10_000), shape)


def _cases() -> dict[str, Callable[[], Case]]:
    from steprl.envs.library.calculator import CalculatorEnv

    calc_shape = Shape(tag_tools=("calc",), json_tools=_json_tools(CalculatorEnv()))
    return {
        "calculator": lambda: Case(_registered("calculator"), _tasks("calculator"), calc_shape),
        "search": lambda: Case(_registered("search"), _tasks("search"), Shape(tag_tools=("search",))),
        "code": lambda: Case(_registered("code"), _tasks("code"), Shape(code=True), executes=True),
        "apps": lambda: Case(_registered("apps"), _tasks("apps"), _apps_shape()),
        "apps-python": lambda: Case(
            _registered("apps", executor="python"), _tasks("apps"), Shape(code=True), executes=True
        ),
        "frozenlake": lambda: Case(_registered("frozenlake"), _tasks("frozenlake"), Shape()),
        "sokoban": lambda: Case(_registered("sokoban"), _tasks("sokoban"), Shape()),
        "bandit": lambda: Case(_registered("bandit"), _tasks("bandit"), Shape()),
        "echo": lambda: Case(_registered("echo"), _tasks("echo"), Shape(tag_tools=("say",))),
        "gym:FrozenLake-v1": _gym_case,
        "mcp:test-server": _mcp_case,
    }


CASES = _cases()
SUMMARY: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _print_summary() -> Iterator[None]:
    """One table of every env's numbers at the end of the module (shown with ``pytest -s``)."""
    yield
    if SUMMARY:
        print("\n\nfuzz summary (per env: actions sent, error observations, slowest step)")
        print("\n".join(SUMMARY))


def fuzz(name: str, seed: int, n: int, n_hostile: int) -> Stats:
    case = CASES[name]()
    if case.executes and not CAPS.usable:
        pytest.skip(f"sandbox unavailable: {CAPS.problems}")
    harness = Harness(name, case.make_env(), _cycle(case.make_tasks))
    try:
        for kind, action in actions(seed, case.shape, n):
            harness.send(kind, action)
        if case.executes:
            for code in HOSTILE_CODE[:n_hostile]:
                harness.end_episode()  # each program in a fresh episode: a fresh interpreter, full budget
                t = harness.send("exec", f"```python\n{code}\n```\n{CODE_MARKER}", limit_s=MAX_EXEC_STEP_S)
                harness.stats.executed += t is not None and t.info.get("tool_name") == "python"
    finally:
        harness.close()
    return harness.stats


def _report(stats: Stats) -> None:
    SUMMARY.append(stats.row())
    print("\n" + stats.row())
    failures = stats.failures
    assert not failures, f"{stats.env}: {len(failures)} malformed actions broke the env:\n" + "\n".join(
        failures[:20]
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed_actions_never_escape_step(name: str) -> None:
    stats = fuzz(name, seed=13, n=N_ACTIONS, n_hostile=len(HOSTILE_CODE))
    assert stats.sent >= N_ACTIONS
    assert stats.errors >= stats.sent // 2  # the fuzz really is malformed
    _report(stats)


#: Extra fuzz seeds per env in the soak: one in the suite (the property once more, on other
#: payloads); STEPRL_SOAK_SEEDS=10 for the tenfold soak (about 35 s on 2 cores for every env).
SOAK_SEEDS = int(os.environ.get("STEPRL_SOAK_SEEDS", "1"))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(CASES))
def test_fuzz_actions_soak(name: str) -> None:
    """`SOAK_SEEDS` times the actions, other seeds (no hostile programs: those are a fixed list)."""
    for seed in range(100, 100 + SOAK_SEEDS):
        _report(fuzz(name, seed=seed, n=N_ACTIONS, n_hostile=0))


def test_actions_are_deterministic_and_cover_every_class() -> None:
    shape = Shape(
        tag_tools=("calc",), json_tools={"calc": {"properties": {"expression": {"type": "string"}}}}
    )
    first, second = list(actions(5, shape, 400)), list(actions(5, shape, 400))
    assert first == second
    kinds = {k.split(":")[0] for k, _ in first}
    assert {"json-call", "json-text", "json-tags", "json-shape", "tag", "raw"} <= kinds
    categories = {k.split(":")[1] for k, _ in first if ":" in k}
    assert set(_CATEGORIES) | {"random"} <= categories


# --- through the agent loop ----------------------------------------------------------------------------

#: Actions that ended trajectories `infra_failed` before this fuzz, one episode each (each survives
#: the tiny tokenizer: what reaches `env.step` is what a model can emit).
LOOP_CASES: tuple[tuple[str, str], ...] = (
    (
        "calculator",
        '<tool_call>{"name": "calc", "arguments": {"expression": "1+1", "\\ud800": 1}}</tool_call>',
    ),
    ("calculator", "<answer>" + "9" * 4_301 + "</answer>"),
    ("apps", '<tool_call>{"name": "contacts_get", "arguments": {"id": 1, "\\udfff": 2}}</tool_call>'),
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("name", "action"), LOOP_CASES, ids=["calc-surrogate-key", "calc-4301-digits", "apps"]
)
def test_the_crashes_this_fuzz_found_are_policy_mistakes_in_the_agent_loop(
    name: str, action: str, tokenizer: Any
) -> None:
    from steprl.engines.base import SamplingParams
    from steprl.engines.scripted import ScriptedEngine
    from steprl.rollout.chat import PlainFormat
    from steprl.rollout.context import AppendOnly
    from steprl.rollout.loop import Budgets, run_episode
    from steprl.types import EndReason

    spec = get_spec(name)
    task = next(iter(spec.tasks("train", 0, 1)))
    env = spec.factory()
    traj = asyncio.run(
        run_episode(
            env,
            task,
            engine=ScriptedEngine([action], lambda s: tokenizer.encode(s, add_special_tokens=False)),
            fmt=PlainFormat(tokenizer),
            rule=AppendOnly(),
            sampling=SamplingParams(),
            budgets=Budgets(max_turns=1, max_tokens_per_turn=10_000, max_total_tokens=100_000),
            group_id="g",
            seed=0,
        )
    )
    assert traj.end is not EndReason.INFRA_FAILED, traj.info.get("error")
    assert len(traj.steps) == 1 and traj.steps[0].info["action_kind"] in ("tool_call", "answer")
