"""The optional LLM tool writer: code for the tools no template expresses (`template: written`
without `code:`), asked of any OpenAI-compatible endpoint (vLLM, SGLang, a hosted API, a steprl
gateway) while `steprl synth` runs.

Each answer is run in the bubblewrap sandbox (`sandboxed.py`; asking for a writer allows the
code it writes) and held to the contract every template keeps (`check.check_tool`: it
changes only its table, is deterministic, changes the state for some arguments, a missing id is
a `ToolError`); a failure goes back to the model as feedback, up to `attempts` times, then the
synthesis stops with one line naming the tool and what its last code did wrong. Accepted code is
written into the package's spec.yaml, so training never calls the writer and a person can read
what it wrote.

    steprl synth my_tools.yaml -o envs/mine --writer-url http://127.0.0.1:8000/v1 --writer-model coder
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, Protocol

from steprl.envs.synth.check import check_tool
from steprl.envs.synth.engine_chat import EngineChat, PromptTooLong
from steprl.envs.synth.sandboxed import require_sandbox
from steprl.envs.synth.spec import SynthSpec, SynthSpecError, ToolDoc
from steprl.envs.synth.templates import parse_spec
from steprl.envs.synth.users import api_key
from steprl.extras import require

_PROMPT = """Write a Python function for a tool of a simulated app.

The app's state is `world`: a dict table -> {{key: record}}, each record a dict of fields.
Tables (key field: fields with their types):
{tables}

The tool: {name}: {description}
Arguments (`args`, a dict): {params}
It may change: {writes}. It returns: {returns}.

Write exactly:

def call(world, args):
    ...

Rules: change only what the tool may change; for a key that is not in its table raise
ToolError("no <thing> <key>") (ToolError is in scope); no imports, no I/O, no randomness; return
a short string ({ret_rule}). Answer with the code in one ```python block."""


class Writer(Protocol):
    """Who writes a tool's code: `ask` answers a conversation; `attempts` answers are tried."""

    @property
    def attempts(self) -> int: ...

    def ask(self, messages: list[dict[str, str]]) -> str: ...


@dataclasses.dataclass(frozen=True)
class EngineWriter:
    """A model served by a steprl engine in this process (`engine_chat.py`; `steprl synth
    --writer-engine hf --writer-model DIR`): no endpoint to run."""

    chat: EngineChat
    attempts: int = 3
    temperature: float = 0.2
    max_tokens: int = 800

    def ask(self, messages: list[dict[str, str]]) -> str:
        try:
            return self.chat.complete(messages, temperature=self.temperature, max_tokens=self.max_tokens)
        except PromptTooLong as exc:
            raise SynthSpecError(f"the tool writer ({self.chat.model}): {exc}") from None


@dataclasses.dataclass(frozen=True)
class ToolWriter:
    """A model behind an OpenAI-compatible `/v1/chat/completions` (the `openai` SDK)."""

    base_url: str
    model: str
    api_key_env: str = ""
    attempts: int = 3
    temperature: float = 0.2
    max_tokens: int = 800
    timeout_s: float = 120.0

    def ask(self, messages: list[dict[str, str]]) -> str:
        openai = require("openai", extra="llm", feature="the LLM tool writer")
        key = api_key(self.api_key_env, "--writer-key-env")
        client = openai.OpenAI(base_url=self.base_url, api_key=key, timeout=self.timeout_s, max_retries=1)
        try:
            out = client.chat.completions.create(
                model=self.model, messages=messages, temperature=self.temperature, max_tokens=self.max_tokens
            )
        except openai.OpenAIError as exc:  # endpoint down, unknown model, refused key: the user's to fix
            raise SynthSpecError(
                f"the tool writer at {self.base_url} (model {self.model!r}) failed: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:200]}; check --writer-url, --writer-model and the key"
            ) from None
        return out.choices[0].message.content or ""


def prompt(spec: SynthSpec, tool: ToolDoc) -> str:
    tables = "\n".join(
        f"  {t.name} (key {t.key}: {', '.join(f'{f} {typ}' for f, typ in t.fields.items())})"
        for t in spec.tables.values()
    )
    owner = spec.key_types()
    keyed = [p.name for p in tool.params if p.semantic in owner]
    return _PROMPT.format(
        tables=tables,
        name=tool.name,
        description=tool.description or "(no description)",
        params=", ".join(
            f"{p.name} ({p.semantic}{', a key of ' + owner[p.semantic] if p.name in keyed else ''})"
            for p in tool.params
        ),
        writes=", ".join(tool.writes),
        returns=tool.returns or "nothing",
        ret_rule="the new record's key" if tool.returns in owner else "'ok' or the changed value",
    )


def code_of(answer: str) -> str:
    """The code in a model's answer: its first ```python block, else the whole text."""
    m = re.search(r"```(?:python|py)?\s*\n(.*?)```", answer, flags=re.DOTALL)
    return (m.group(1) if m else answer).strip() + "\n"


_PLACEHOLDER = "def call(world, args):\n    return 'ok'\n"


def _with_code(raw: Mapping[str, Any], i: int, code: str) -> dict[str, Any]:
    """`raw` with `code` for tool i and a placeholder for every other written tool still without
    code (a spec parses only when each has some)."""
    tools = [dict(t) for t in raw["tools"]]
    for t in tools:
        if t.get("template") == "written" and not t.get("code"):
            t["code"] = _PLACEHOLDER
    tools[i]["code"] = code
    return {**raw, "tools": tools}


def _problem(raw: Mapping[str, Any], i: int, code: str, source: str) -> str | None:
    raw = _with_code(raw, i, code)
    try:
        spec = parse_spec(raw, source, allow_written_code=True)  # the writer's: runs in the sandbox
        check_tool(spec, spec.tools[i])
    except (SynthSpecError, AssertionError) as exc:
        return str(exc)
    except Exception as exc:  # the code raised something else on a generated world
        return f"{type(exc).__name__}: {exc}"
    return None


def write_tools(raw: Mapping[str, Any], writer: Writer | None, source: str = "<spec>") -> dict[str, Any]:
    """`raw` with code for every `template: written` tool that has none, each checked; without a
    writer such a tool is one line saying how to give it code."""
    tools = raw.get("tools") if isinstance(raw, Mapping) else None
    if not isinstance(tools, list):
        return raw  # type: ignore[return-value]  # not a spec: parse_spec says why, in one line
    todo = [
        i
        for i, t in enumerate(tools)
        if isinstance(t, Mapping) and t.get("template") == "written" and not t.get("code")
    ]
    if not todo:
        return dict(raw)
    if writer is None:
        names = [tools[i].get("name") for i in todo]
        raise SynthSpecError(
            f"tools {names}: template written with no code; write code: (def call(world, args): ...) "
            "or pass --writer-url and --writer-model (an endpoint) or --writer-engine and --writer-model "
            "(a model in this process) to have a model write it"
        )
    require_sandbox([tools[i].get("name") for i in todo])  # the code cannot be checked: ask no model
    out = {**raw, "tools": [dict(t) for t in tools]}
    for i in todo:
        spec = parse_spec(_with_code(out, i, _PLACEHOLDER), source, allow_written_code=True)
        messages = [{"role": "user", "content": prompt(spec, spec.tools[i])}]
        problem = "no answer"
        for _ in range(writer.attempts):
            answer = writer.ask(messages)
            code = code_of(answer)
            problem = _problem(out, i, code, source) or ""
            if not problem:
                out["tools"][i]["code"] = code
                break
            messages += [
                {"role": "assistant", "content": answer},
                {
                    "role": "user",
                    "content": f"That code fails a check: {problem}. Fix it; answer with the whole function.",
                },
            ]
        else:
            raise SynthSpecError(
                f"tools[{i}] ({out['tools'][i].get('name')}): the writer's code failed its checks "
                f"{writer.attempts} times; last: {problem}"
            )
    return out


def check_written(spec: SynthSpec) -> None:
    """Every `written` tool held to the templates' contract (`check_tool`); one line if one fails."""
    for i, tool in enumerate(spec.tools):
        if tool.template != "written":
            continue
        try:
            check_tool(spec, tool)
        except AssertionError as exc:
            raise SynthSpecError(f"tools[{i}] ({tool.name}).code: breaks the tool contract: {exc}") from None
        except SynthSpecError as exc:  # no sandbox here, or the code failed on its own in it
            raise SynthSpecError(f"tools[{i}] ({tool.name}).code: {exc}") from None
        except Exception as exc:
            raise SynthSpecError(
                f"tools[{i}] ({tool.name}).code: raised {type(exc).__name__}: {exc}"
            ) from None
