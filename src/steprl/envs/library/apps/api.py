"""The apps' API: contacts, email and calendar functions over one episode's database.

`Apps` holds the functions; `FUNCTIONS` describes each one (app, signature, JSON schema,
whether it changes state). Every function validates its arguments itself and raises
`ToolError` (a short message the model sees) for anything wrong, so no model input can reach
SQLite as an error: a `sqlite3` exception here is an env bug and propagates as infrastructure.

`Apps.call(name, arguments)` is the one entry point every executor uses: `ToolEnv` calls it for
JSON function calls, and the python executor (`code_actions.py`: snippets run in
`steprl.envs.sandbox`) forwards each API call a snippet makes to it over the sandbox session's
RPC channel. Results are compact JSON.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import sqlite3
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from steprl.envs.base import ToolError
from steprl.envs.tool_env import check_arguments

APPS = ("contacts", "email", "calendar")
MAX_TEXT = 400  # characters in one text argument
MAX_ID = 10**9
_EMAIL = re.compile(r"[^@\s,]+@[^@\s,]+\.[^@\s,]+")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_TIME = re.compile(r"([01]\d|2[0-3]):[0-5]\d")
_CONTACT_FIELDS = ("first_name", "last_name", "email", "phone", "company", "city", "birthday")


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


def _f(name: str, sig: str, summary: str, req: str = "", opt: str = "", mutates: bool = False) -> Function:
    def parse(spec: str) -> dict[str, str]:
        return dict(part.split(":") for part in spec.split()) if spec else {}

    return Function(name, name.split("_")[0], f"{name}({sig})", summary, parse(req), parse(opt), mutates)


FUNCTIONS: tuple[Function, ...] = (
    _f("api_docs", "app", "list an app's functions (app: contacts, email or calendar)", "app:string"),
    _f(
        "contacts_search",
        "query, limit=10",
        "contacts whose name, email, phone or company contains query: [{id, name, email, phone}]",
        "query:string",
        "limit:integer",
    ),
    _f(
        "contacts_get",
        "id",
        "one contact: {id, first_name, last_name, email, phone, company, city, birthday}",
        "id:integer",
    ),
    _f(
        "contacts_add",
        "first_name, last_name, email, phone='', company='', city='', birthday=''",
        "add a contact (birthday as YYYY-MM-DD): {id}",
        "first_name:string last_name:string email:string",
        "phone:string company:string city:string birthday:string",
        mutates=True,
    ),
    _f(
        "contacts_update",
        "id, first_name?, last_name?, email?, phone?, company?, city?, birthday?",
        "change the given fields of a contact",
        "id:integer",
        " ".join(f"{k}:string" for k in _CONTACT_FIELDS),
        mutates=True,
    ),
    _f("contacts_delete", "id", "delete a contact", "id:integer", mutates=True),
    _f(
        "email_list",
        "folder='inbox', query='', limit=10",
        "emails in a folder (inbox, sent, trash), newest first, whose from, to or subject "
        "contains query: [{id, from, to, subject, date}]",
        "",
        "folder:string query:string limit:integer",
    ),
    _f("email_read", "id", "one email with its body", "id:integer"),
    _f(
        "email_send",
        "to, subject, body",
        "send an email: {id}",
        "to:string subject:string body:string",
        "",
        True,
    ),
    _f(
        "email_reply", "id, body", "reply to an email (subject 'Re: ...')", "id:integer body:string", "", True
    ),
    _f(
        "email_forward",
        "id, to, note=''",
        "forward an email (subject 'Fwd: ...')",
        "id:integer to:string",
        "note:string",
        mutates=True,
    ),
    _f("email_delete", "id", "move an email to the trash", "id:integer", mutates=True),
    _f(
        "calendar_list",
        "date='', query='', limit=10",
        "upcoming events on a date (YYYY-MM-DD) whose title contains query: [{id, title, date, start, end}]",
        "",
        "date:string query:string limit:integer",
    ),
    _f("calendar_get", "id", "one event with its location and attendees", "id:integer"),
    _f(
        "calendar_create",
        "title, date, start, end, location='', attendees=[]",
        "create an event (times as HH:MM, attendees as email addresses): {id}",
        "title:string date:string start:string end:string",
        "location:string attendees:array",
        mutates=True,
    ),
    _f(
        "calendar_move",
        "id, start, date=same day",
        "move an event to a new start (and date), keeping its length",
        "id:integer start:string",
        "date:string",
        mutates=True,
    ),
    _f("calendar_cancel", "id", "cancel an event", "id:integer", mutates=True),
    _f("calendar_invite", "id, email", "add an attendee to an event", "id:integer email:string", "", True),
    _f(
        "calendar_uninvite",
        "id, email",
        "remove an attendee from an event",
        "id:integer email:string",
        "",
        True,
    ),
)
BY_NAME: Mapping[str, Function] = {f.name: f for f in FUNCTIONS}
MUTATING = frozenset(f.name for f in FUNCTIONS if f.mutates)


def api_docs_text(app: str) -> str:
    """The function list of `app`, one `signature: summary` per line."""
    return "\n".join(f.doc for f in FUNCTIONS if f.app == app)


# --- argument checks: each raises ToolError with a short message -----------------------------------


def _text(value: Any, name: str, *, empty_ok: bool = False) -> str:
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


def _int(value: Any, name: str, low: int = 1, high: int = MAX_ID) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ToolError(f"{name} must be an integer")
    if not low <= value <= high:
        raise ToolError(f"{name} must be between {low} and {high}")
    return value


def _address(value: Any, name: str = "email") -> str:
    text = _text(value, name).lower()
    if len(text) > 120 or not _EMAIL.fullmatch(text):
        raise ToolError(f"{name} is not an email address")
    return text


def _date(value: Any, name: str = "date") -> str:
    text = _text(value, name)
    try:
        if not _DATE.fullmatch(text):
            raise ValueError
        dt.date.fromisoformat(text)
    except ValueError:
        raise ToolError(f"{name} must be a date YYYY-MM-DD") from None
    return text


def _minutes(value: Any, name: str) -> int:
    text = _text(value, name)
    if not _TIME.fullmatch(text):
        raise ToolError(f"{name} must be a time HH:MM")
    return int(text[:2]) * 60 + int(text[3:])


def _hhmm(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


class Apps:
    """The API functions over the attached episode database (`attach` at every reset)."""

    def __init__(self) -> None:
        self._conn: sqlite3.Connection | None = None

    def attach(self, conn: sqlite3.Connection | None) -> None:
        self._conn = conn

    @property
    def conn(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError("no episode database attached; call AppsEnv.reset(task, seed) first.")
        return self._conn

    def call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """Run API function `name` with keyword `arguments`; its result as compact JSON."""
        function = BY_NAME.get(name)
        if function is None:
            raise ToolError(f"unknown function '{str(name)[:32]}'")
        error = check_arguments(arguments, function.parameters)
        if error is not None:
            raise ToolError(error)
        method: Callable[..., Any] = getattr(self, name)
        result = method(**arguments)
        return result if isinstance(result, str) else json.dumps(result, separators=(",", ":"))

    def _meta(self, key: str) -> str:
        return str(self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()[0])

    def _one(self, table: str, rid: Any) -> tuple[Any, ...]:
        row = self.conn.execute(f"SELECT * FROM {table} WHERE id = ?", (_int(rid, "id"),)).fetchone()
        if row is None:
            raise ToolError(f"no {table[:-1]} with id {rid}")
        return tuple(row)

    # --- docs ------------------------------------------------------------------------------------

    def api_docs(self, app: str) -> str:
        name = _text(app, "app").lower()
        if name not in APPS:
            raise ToolError(f"unknown app; apps: {', '.join(APPS)}")
        return api_docs_text(name)

    # --- contacts ----------------------------------------------------------------------------------

    @staticmethod
    def _contact(row: tuple[Any, ...]) -> dict[str, Any]:
        return dict(zip(("id", *_CONTACT_FIELDS), row, strict=True))

    def contacts_search(self, query: str, limit: int = 10) -> list[dict[str, Any]]:
        q = _text(query, "query", empty_ok=True).lower()
        rows = self.conn.execute(
            "SELECT id, first_name || ' ' || last_name, email, phone FROM contacts WHERE instr(lower("
            "first_name || ' ' || last_name || '|' || email || '|' || phone || '|' || company), ?) "
            "ORDER BY id LIMIT ?",
            (q, _int(limit, "limit", 1, 50)),
        ).fetchall()
        return [dict(zip(("id", "name", "email", "phone"), r, strict=True)) for r in rows]

    def contacts_get(self, id: int) -> dict[str, Any]:
        return self._contact(self._one("contacts", id))

    def _contact_values(self, fields: Mapping[str, Any]) -> dict[str, str]:
        values = {}
        for key, value in fields.items():
            if key == "email":
                values[key] = _address(value)
            elif key == "birthday":
                values[key] = _date(value, "birthday") if str(value).strip() else ""
            else:
                values[key] = _text(value, key, empty_ok=key not in ("first_name", "last_name"))
        return values

    def _email_taken(self, address: str, but: int = 0) -> None:
        row = self.conn.execute(
            "SELECT id FROM contacts WHERE email = ? AND id != ?", (address, but)
        ).fetchone()
        if row is not None:
            raise ToolError(f"contact {row[0]} already has this email")

    def contacts_add(
        self,
        first_name: str,
        last_name: str,
        email: str,
        phone: str = "",
        company: str = "",
        city: str = "",
        birthday: str = "",
    ) -> dict[str, Any]:
        v = self._contact_values(
            dict(
                first_name=first_name,
                last_name=last_name,
                email=email,
                phone=phone,
                company=company,
                city=city,
                birthday=birthday,
            )
        )
        self._email_taken(v["email"])
        with self.conn:
            cur = self.conn.execute(
                "INSERT INTO contacts (first_name, last_name, email, phone, company, city, birthday) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                tuple(v[k] for k in _CONTACT_FIELDS),
            )
        return {"id": cur.lastrowid}

    def contacts_update(self, id: int, **fields: Any) -> dict[str, Any]:
        current = self.contacts_get(id)
        unknown = sorted(set(fields) - set(_CONTACT_FIELDS))
        if unknown:
            raise ToolError(f"unknown field '{str(unknown[0])[:32]}'")
        if not fields:
            raise ToolError("give at least one field to change")
        values = self._contact_values(fields)
        if "email" in values:
            self._email_taken(values["email"], but=current["id"])
        with self.conn:
            for key in _CONTACT_FIELDS:  # fixed column names, in a fixed order
                if key in values:
                    self.conn.execute(f"UPDATE contacts SET {key} = ? WHERE id = ?", (values[key], id))
        return self.contacts_get(id)

    def contacts_delete(self, id: int) -> dict[str, Any]:
        self.contacts_get(id)
        with self.conn:
            self.conn.execute("DELETE FROM contacts WHERE id = ?", (id,))
        return {"deleted": id}

    # --- email -------------------------------------------------------------------------------------

    def email_list(self, folder: str = "inbox", query: str = "", limit: int = 10) -> list[dict[str, Any]]:
        box = _text(folder, "folder").lower()
        if box not in ("inbox", "sent", "trash"):
            raise ToolError("folder must be inbox, sent or trash")
        q = _text(query, "query", empty_ok=True).lower()
        rows = self.conn.execute(
            "SELECT id, sender, recipient, subject, date FROM emails WHERE folder = ? AND "
            "instr(lower(sender || '|' || recipient || '|' || subject), ?) "
            "ORDER BY date DESC, id DESC LIMIT ?",
            (box, q, _int(limit, "limit", 1, 50)),
        ).fetchall()
        return [dict(zip(("id", "from", "to", "subject", "date"), r, strict=True)) for r in rows]

    def email_read(self, id: int) -> dict[str, Any]:
        row = self._one("emails", id)
        return dict(zip(("id", "folder", "from", "to", "subject", "body", "date"), row, strict=True))

    def _send(self, to: str, subject: str, body: str) -> dict[str, Any]:
        with self.conn:
            cur = self.conn.execute(
                "INSERT INTO emails (folder, sender, recipient, subject, body, date) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                ("sent", self._meta("owner_email"), to, subject, body, self._meta("now")),
            )
        return {"id": cur.lastrowid}

    def email_send(self, to: str, subject: str, body: str) -> dict[str, Any]:
        return self._send(_address(to, "to"), _text(subject, "subject"), _text(body, "body"))

    def email_reply(self, id: int, body: str) -> dict[str, Any]:
        original = self.email_read(id)
        text = _text(body, "body")
        owner = self._meta("owner_email")
        to = original["to"] if original["from"] == owner else original["from"]
        subject = original["subject"]
        subject = subject if subject.lower().startswith("re:") else f"Re: {subject}"
        return self._send(to, subject, text)

    def email_forward(self, id: int, to: str, note: str = "") -> dict[str, Any]:
        original = self.email_read(id)
        address, text = _address(to, "to"), _text(note, "note", empty_ok=True)
        quoted = (
            f"---------- Forwarded message ----------\nFrom: {original['from']}\n"
            f"Subject: {original['subject']}\n\n{original['body']}"
        )
        return self._send(address, f"Fwd: {original['subject']}", f"{text}\n\n{quoted}" if text else quoted)

    def email_delete(self, id: int) -> dict[str, Any]:
        if self.email_read(id)["folder"] == "trash":
            raise ToolError(f"email {id} is already in the trash")
        with self.conn:
            self.conn.execute("UPDATE emails SET folder = 'trash' WHERE id = ?", (id,))
        return {"trashed": id}

    # --- calendar ----------------------------------------------------------------------------------

    def calendar_list(self, date: str = "", query: str = "", limit: int = 10) -> list[dict[str, Any]]:
        day = _date(date) if isinstance(date, str) and date.strip() else _text(date, "date", empty_ok=True)
        q = _text(query, "query", empty_ok=True).lower()
        rows = self.conn.execute(
            "SELECT id, title, date, start_time, end_time FROM events WHERE status = 'confirmed' AND "
            "(? = '' OR date = ?) AND instr(lower(title), ?) ORDER BY date, start_time, id LIMIT ?",
            (day, day, q, _int(limit, "limit", 1, 50)),
        ).fetchall()
        return [dict(zip(("id", "title", "date", "start", "end"), r, strict=True)) for r in rows]

    def calendar_get(self, id: int) -> dict[str, Any]:
        row = self._one("events", id)
        event = dict(
            zip(("id", "title", "date", "start", "end", "location", "attendees", "status"), row, strict=True)
        )
        event["attendees"] = [a for a in event["attendees"].split(",") if a]
        return event

    def calendar_create(
        self,
        title: str,
        date: str,
        start: str,
        end: str,
        location: str = "",
        attendees: list[Any] | None = None,
    ) -> dict[str, Any]:
        name, day = _text(title, "title"), _date(date)
        begin, finish = _minutes(start, "start"), _minutes(end, "end")
        if finish <= begin:
            raise ToolError("end must be after start")
        if attendees is not None and not isinstance(attendees, list):
            raise ToolError("attendees must be a list of email addresses")
        people = sorted({_address(a, "attendee") for a in attendees or []})
        if len(people) > 20:
            raise ToolError("at most 20 attendees")
        with self.conn:
            cur = self.conn.execute(
                "INSERT INTO events (title, date, start_time, end_time, location, attendees, status) "
                "VALUES (?, ?, ?, ?, ?, ?, 'confirmed')",
                (
                    name,
                    day,
                    _hhmm(begin),
                    _hhmm(finish),
                    _text(location, "location", empty_ok=True),
                    ",".join(people),
                ),
            )
        return {"id": cur.lastrowid}

    def _active(self, id: int) -> dict[str, Any]:
        event = self.calendar_get(id)
        if event["status"] != "confirmed":
            raise ToolError(f"event {id} is cancelled")
        return event

    def calendar_move(self, id: int, start: str, date: str | None = None) -> dict[str, Any]:
        event = self._active(id)
        day = event["date"] if date is None else _date(date)
        length = _minutes(event["end"], "end") - _minutes(event["start"], "start")
        begin = _minutes(start, "start")
        if begin + length >= 24 * 60:
            raise ToolError("the event would end after midnight")
        with self.conn:
            self.conn.execute(
                "UPDATE events SET date = ?, start_time = ?, end_time = ? WHERE id = ?",
                (day, _hhmm(begin), _hhmm(begin + length), id),
            )
        return self.calendar_get(id)

    def calendar_cancel(self, id: int) -> dict[str, Any]:
        self._active(id)
        with self.conn:
            self.conn.execute("UPDATE events SET status = 'cancelled' WHERE id = ?", (id,))
        return {"cancelled": id}

    def _set_attendees(self, id: int, people: list[str]) -> dict[str, Any]:
        with self.conn:
            self.conn.execute("UPDATE events SET attendees = ? WHERE id = ?", (",".join(sorted(people)), id))
        return self.calendar_get(id)

    def calendar_invite(self, id: int, email: str) -> dict[str, Any]:
        event, address = self._active(id), _address(email)
        if address in event["attendees"]:
            raise ToolError(f"{address} is already invited")
        if len(event["attendees"]) >= 20:
            raise ToolError("at most 20 attendees")
        return self._set_attendees(id, [*event["attendees"], address])

    def calendar_uninvite(self, id: int, email: str) -> dict[str, Any]:
        event, address = self._active(id), _address(email)
        if address not in event["attendees"]:
            raise ToolError(f"{address} is not invited")
        return self._set_attendees(id, [a for a in event["attendees"] if a != address])
