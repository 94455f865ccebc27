"""The ToRL tool-integrated-reasoning protocol, as pure functions (Li, Zou, Liu, arXiv 2503.23383;
GAIR-NLP/ToRL `_tir_generate`).

The model writes fenced python; generation stops at the output marker; the LAST complete python
block is executed; the observation is the output (errors cut to their last line, long output cut
to head + "..." + tail) wrapped as an output block; the final answer is `<answer>..</answer>` or
`\\boxed{..}`.
"""

from __future__ import annotations

import re
from collections.abc import Callable

OUTPUT_MARKER = "```output"
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def _last_block(text: str, open_: str, close: str) -> str | None:
    """The body of the last non-overlapping `open_`...`close` pair, scanning left to right (what
    ``re.findall(open_ + "(.*?)" + close, text, re.DOTALL)[-1]`` returns), in linear time: the
    regex retries its lazy scan from every unclosed opening, quadratic in a flood of them
    (``"<answer>" * 4000`` took 1.5 s; a 1 MB flood of them, minutes)."""
    found, pos = None, 0
    while (start := text.find(open_, pos)) >= 0:
        end = text.find(close, start + len(open_))
        if end < 0:
            break  # no later opening has a close either
        found, pos = text[start + len(open_) : end], end + len(close)
    return found


def extract_program(action: str) -> str | None:
    """The last complete ```python ... ``` block before the output marker (None if there is none;
    an unclosed block is no program, as in ToRL's `extract_program(last_only=True)`)."""
    head = action.split(OUTPUT_MARKER, 1)[0]
    return _last_block(head, "```python\n", "```")


def extract_answer(action: str) -> str | None:
    """The final answer: the last `<answer>..</answer>`, else the last `\\boxed{..}`."""
    answer = _last_block(action, "<answer>", "</answer>")
    if answer is not None:
        return answer.strip()
    boxed = _BOXED.findall(action)
    return boxed[-1].strip() if boxed else None


def format_output(
    stdout: str,
    error: str | None,
    *,
    max_tokens: int = 64,
    count_tokens: Callable[[str], int] = len,
) -> str:
    """ToRL's observation text. An error keeps only its last line (`NameError: ...`); empty output
    says so; output longer than `max_tokens` (by `count_tokens`, characters by default) keeps the
    first and last `max_tokens // 2` and joins them with "...". Wrapped as an output block."""
    if error:
        text = error.strip().splitlines()[-1] if error.strip() else "Error"
    else:
        text = stdout.rstrip("\n") or "(no output)"
    if count_tokens(text) > max_tokens:
        half = max(1, max_tokens // 2)
        text = _head_tail(text, half, count_tokens)
    return f"\n{text}\n```\n"


def _head_tail(text: str, half: int, count_tokens: Callable[[str], int]) -> str:
    """Longest prefix and suffix of at most `half` tokens each, joined by '...'."""
    lo, hi = 0, len(text)
    while lo < hi:  # longest prefix with <= half tokens
        mid = (lo + hi + 1) // 2
        if count_tokens(text[:mid]) <= half:
            lo = mid
        else:
            hi = mid - 1
    head = text[:lo]
    lo, hi = 0, len(text)
    while lo < hi:  # longest suffix with <= half tokens
        mid = (lo + hi + 1) // 2
        if count_tokens(text[len(text) - mid :]) <= half:
            lo = mid
        else:
            hi = mid - 1
    return f"{head}...{text[len(text) - lo :]}"
