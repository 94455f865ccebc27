"""What the page's data costs, measured as the page stores it, and the one escaping every byte of
run data passes through on its way into the page.

The data blob is JSON inside a <script> element, so every "<" is escaped (a token "</script>"
would otherwise end it early), and every bidi control (U+202A-U+202E embeddings and overrides,
U+2066-U+2069 isolates, the LRM/RLM/ALM marks) is replaced by a visible escape ("⟨U+202E⟩"):
in a model's output or an env's text one would reorder what the page shows around it (Trojan
Source, CVE-2021-42574), and a report is read to see exactly what was there. Sizes are measured
on this escaped text, so a budget in bytes is a bound on the file.
"""

from __future__ import annotations

import json
import re
from typing import Any

_BIDI = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def visible_bidi(text: str) -> str:
    """`text` with each bidi control replaced by its code point shown ("⟨U+202E⟩")."""
    return _BIDI.sub(lambda m: f"\u27e8U+{ord(m.group()):04X}\u27e9", text)


def blob(data: Any) -> str:
    """`data` as the JSON text the page embeds (no NaN; "<", U+2028/9 and bidi controls escaped)."""
    text = json.dumps(data, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    text = visible_bidi(text)
    return text.replace("<", "\\u003c").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def size(data: Any) -> int:
    """The bytes `data` adds to the page."""
    return len(blob(data).encode("utf-8"))


def clip(text: str, limit: int) -> str:
    """`text`, or its first `limit` characters and how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}\u2026 ({len(text):,} characters)"


def thin(items: list[Any], limit: int) -> list[Any]:
    """At most `limit` of `items`, evenly spread, the first and the last always among them."""
    if len(items) <= limit:
        return items
    if limit <= 1:
        return items[-limit:] if limit else []
    step = (len(items) - 1) / (limit - 1)
    return [items[round(k * step)] for k in range(limit)]
