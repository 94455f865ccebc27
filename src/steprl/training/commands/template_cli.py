"""`steprl check-template MODEL`: the template checker on a model's tokenizer, from the shell.

MODEL is what `model.name` takes: "tiny" (the plain format: the tiny model has no template),
"qwen3-testbed" (the real Qwen3 tokenizer and template), "gemma-3-270m", a Hugging Face model
directory, a Hugging Face Hub id (org/name, through the Hub's cache), or a `.gguf` file. Only
the tokenizer is loaded (and for a GGUF or gemma-3-270m, the one-time conversion runs if it has
not; a Hub id is downloaded whole when it is not cached).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from steprl.models import qwen3_testbed, tiny
from steprl.models.sources import (
    GEMMA_NAME,
    MARKER,
    cache_root,
    check_hf_dir,
    gemma_dir,
    gguf_cache_dir,
    hub_snapshot,
    is_hub_id,
    load_pretrained,
    read_chat_template,
)
from steprl.rollout.chat import PlainFormat, PromptFormat
from steprl.rollout.chat_format import ChatFormat, ChatTemplateError
from steprl.rollout.template_check import (
    TemplateReport,
    check_template,
    load_conversations,
    standard_checks,
)


def load_tokenizer(name: str, cache_dir: str | None, log: Callable[[str], None]) -> Any:
    """The tokenizer `model.name=name` would train with."""
    from transformers import AutoTokenizer

    if name == "tiny":
        return tiny.build_tokenizer()
    if name == qwen3_testbed.NAME:
        return qwen3_testbed.load_tokenizer()
    if name == GEMMA_NAME:
        return AutoTokenizer.from_pretrained(gemma_dir(cache_root(cache_dir), log))
    if is_hub_id(name):
        directory = hub_snapshot(name, log)
        check_hf_dir(directory)
        return AutoTokenizer.from_pretrained(directory)
    path = Path(name).expanduser()
    if (
        path.is_file()
        and path.suffix == ".gguf"
        and (gguf_cache_dir(path, cache_root(cache_dir)) / MARKER).exists()
    ):
        return AutoTokenizer.from_pretrained(gguf_cache_dir(path, cache_root(cache_dir)))
    if path.is_dir():
        check_hf_dir(path)
        return AutoTokenizer.from_pretrained(path)
    # a .gguf not converted yet, or a bad name: the model loader converts or says what is wrong
    return load_pretrained(
        name, dtype="float32", device="cpu", cache_dir=cache_dir, chat_template=None, log=log
    ).tokenizer


def format_for(tokenizer: Any, kind: str = "auto") -> PromptFormat:
    if kind == "auto":
        kind = "chat" if getattr(tokenizer, "chat_template", None) else "plain"
    if kind == "chat":
        return ChatFormat(tokenizer, system_prompt="env")
    return PlainFormat(tokenizer, system_prompt="env")


@dataclass(frozen=True)
class TemplateChecks:
    """What `run_checks` checked and found."""

    # "chat": the tokenizer's chat template; "plain": the tokenizer has none, so what was checked
    # is the plain format (BOS + text) that model.format=auto trains it with
    format: Literal["chat", "plain"]
    results: list[tuple[str, TemplateReport, bool]]  # (label, report, whether a break was expected)


def run_checks(
    name: str,
    *,
    conversations: str | None = None,
    chat_template: str | None = None,
    context: str | None = None,
    cache_dir: str | None = None,
    log: Callable[[str], None] = print,
) -> TemplateChecks:
    """The checks, one report per check. With `conversations`, the file's conversations under
    `context` (default keep_thinking); without, the standard checks."""
    tokenizer = load_tokenizer(name, cache_dir, log)
    if chat_template:
        tokenizer.chat_template = read_chat_template(chat_template)
    try:
        fmt = format_for(tokenizer)
    except ChatTemplateError as err:  # a template that cannot even be taken apart: a failed check
        report = TemplateReport("append_only", 0, (), str(err))
        return TemplateChecks("chat", [(f"{name}: taking the template apart", report, False)])
    kind: Literal["chat", "plain"] = "plain" if isinstance(fmt, PlainFormat) else "chat"
    if conversations is not None:
        ctx = context or "keep_thinking"
        return TemplateChecks(
            kind,
            [
                (
                    f"{conversations}, {ctx}",
                    check_template(fmt, load_conversations(conversations), context=ctx),
                    False,
                )
            ],
        )
    checks = standard_checks()
    if isinstance(fmt, PlainFormat):  # no template: nothing strips reasoning, so only the first two apply
        checks = checks[:2]
    if context is not None:
        checks = [c for c in checks if c[1] == context]
    results = [
        (label, check_template(fmt, convs, context=ctx), expected) for label, ctx, convs, expected in checks
    ]
    if kind == "plain":
        return TemplateChecks(kind, [(f"plain format, {label}", r, e) for label, r, e in results])
    if any(expected and r.ok for _, r, expected in results):
        # the template never drops earlier reasoning: strip_thinking has no official render to match
        results = [
            (f"{label} (n/a: this template keeps earlier reasoning)", r, True)
            if c[1] == "strip_thinking"
            else (label, r, expected)
            for (label, r, expected), c in zip(results, checks, strict=True)
        ]
    return TemplateChecks(kind, results)
