"""What every app of the API shares: the `Function` record, the argument checks, the episode `Store`.

Each check takes a raw argument and returns it validated (stripped text, an int in range, a
lowercased address, ...) or raises `ToolError` with a short message the model sees, so no model
input reaches SQLite as an error.
"""

from __future__ import annotations

import datetime as dt
import re
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from steprl.envs.base import ToolError

MAX_TEXT = 400  # characters in one text argument
MAX_ID = 10**9
_EMAIL = re.compile(r"[^@\s,]+@[^@\s,]+\.[^@\s,]+")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_TIME = re.compile(r"([01]\d|2[0-3]):[0-5]\d")


@dataclass(frozen=True)
class Function:
    """One API function: its tool name, app, documented signature and argument schema."""

    name: str
    app: str
    signature: str
    summary: str
    required: Mapping[str, str]  # argument -> JSON type
    optional: Mapping[str, str]
    mutates: bool

    @property
    def parameters(self) -> dict[str, Any]:
        props = {k: {"type": t} for k, t in {**self.required, **self.optional}.items()}
        return {
            "type": "object",
            "properties": props,
            "required": list(self.required),
            "additionalProperties": False,
        }

    @property
    def doc(self) -> str:
        return f"{self.signature}: {self.summary}"


def define(
    name: str, sig: str, summary: str, req: str = "", opt: str = "", mutates: bool = False
) -> Function:
    """A `Function` from compact specs: `req` / `opt` are ``"arg:type arg:type"``; the app is
    the name's prefix (``contacts_get`` -> ``contacts``)."""

    def parse(spec: str) -> dict[str, str]:
        return dict(part.split(":") for part in spec.split()) if spec else {}

    return Function(name, name.split("_")[0], f"{name}({sig})", summary, parse(req), parse(opt), mutates)


# --- argument checks: each raises ToolError with a short message -----------------------------------


def text_arg(value: Any, name: str, *, empty_ok: bool = False) -> str:
    if not isinstance(value, str):
        raise ToolError(f"{name} must be a string")
    text = value.strip()
    if not text and not empty_ok:
        raise ToolError(f"{name} must not be empty")
    if len(text) > MAX_TEXT:
        raise ToolError(f"{name} too long (max {MAX_TEXT} chars)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ToolError(f"{name} is not valid text") from None
    if "\x00" in text:
        raise ToolError(f"{name} contains a NUL character")
    return text


def int_arg(value: Any, name: str, low: int = 1, high: int = MAX_ID) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ToolError(f"{name} must be an integer")
    if not low <= value <= high:
        raise ToolError(f"{name} must be between {low} and {high}")
    return value


def address_arg(value: Any, name: str = "email") -> str:
    text = text_arg(value, name).lower()
    if len(text) > 120 or not _EMAIL.fullmatch(text):
        raise ToolError(f"{name} is not an email address")
    return text


def date_arg(value: Any, name: str = "date") -> str:
    text = text_arg(value, name)
    try:
        if not _DATE.fullmatch(text):
            raise ValueError
        dt.date.fromisoformat(text)
    except ValueError:
        raise ToolError(f"{name} must be a date YYYY-MM-DD") from None
    return text


def minutes_arg(value: Any, name: str) -> int:
    """A time ``HH:MM`` as minutes after midnight."""
    text = text_arg(value, name)
    if not _TIME.fullmatch(text):
        raise ToolError(f"{name} must be a time HH:MM")
    return int(text[:2]) * 60 + int(text[3:])


def hhmm(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


class Store:
    """The episode database the apps work on (`attach` at every reset), with two shared reads."""

    def __init__(self) -> None:
        self._conn: sqlite3.Connection | None = None

    def attach(self, conn: sqlite3.Connection | None) -> None:
        self._conn = conn

    @property
    def conn(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError("no episode database attached; call AppsEnv.reset(task, seed) first.")
        return self._conn

    def meta(self, key: str) -> str:
        """A value of the world's ``meta`` table (``owner_email``, ``now``)."""
        return str(self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()[0])

    def one(self, table: str, rid: Any) -> tuple[Any, ...]:
        """The row of `table` with id `rid`, or a `ToolError` naming what is missing."""
        row = self.conn.execute(f"SELECT * FROM {table} WHERE id = ?", (int_arg(rid, "id"),)).fetchone()
        if row is None:
            raise ToolError(f"no {table[:-1]} with id {rid}")
        return tuple(row)
