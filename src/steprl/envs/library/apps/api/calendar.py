"""The calendar app: list, read, create, move, cancel events and manage attendees (table ``events``).

Times are ``HH:MM`` (stored as text, computed in minutes); attendees are stored as a sorted,
comma-joined list of addresses; a cancelled event keeps its row with ``status = 'cancelled'``.
"""

from __future__ import annotations

from typing import Any

from steprl.envs.base import ToolError
from steprl.envs.library.apps.api.base import (
    Function,
    Store,
    address_arg,
    date_arg,
    define,
    hhmm,
    int_arg,
    minutes_arg,
    text_arg,
)

MAX_ATTENDEES = 20

FUNCTIONS: tuple[Function, ...] = (
    define(
        "calendar_list",
        "date='', query='', limit=10",
        "upcoming events on a date (YYYY-MM-DD) whose title contains query: [{id, title, date, start, end}]",
        "",
        "date:string query:string limit:integer",
    ),
    define("calendar_get", "id", "one event with its location and attendees", "id:integer"),
    define(
        "calendar_create",
        "title, date, start, end, location='', attendees=[]",
        "create an event (times as HH:MM, attendees as email addresses): {id}",
        "title:string date:string start:string end:string",
        "location:string attendees:array",
        mutates=True,
    ),
    define(
        "calendar_move",
        "id, start, date=same day",
        "move an event to a new start (and date), keeping its length",
        "id:integer start:string",
        "date:string",
        mutates=True,
    ),
    define("calendar_cancel", "id", "cancel an event", "id:integer", mutates=True),
    define(
        "calendar_invite", "id, email", "add an attendee to an event", "id:integer email:string", "", True
    ),
    define(
        "calendar_uninvite",
        "id, email",
        "remove an attendee from an event",
        "id:integer email:string",
        "",
        True,
    ),
)


class Calendar:
    """The calendar functions over the episode database in `store`."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def calendar_list(self, date: str = "", query: str = "", limit: int = 10) -> list[dict[str, Any]]:
        given = isinstance(date, str) and bool(date.strip())
        day = date_arg(date) if given else text_arg(date, "date", empty_ok=True)
        q = text_arg(query, "query", empty_ok=True).lower()
        rows = self.store.conn.execute(
            "SELECT id, title, date, start_time, end_time FROM events WHERE status = 'confirmed' AND "
            "(? = '' OR date = ?) AND instr(lower(title), ?) ORDER BY date, start_time, id LIMIT ?",
            (day, day, q, int_arg(limit, "limit", 1, 50)),
        ).fetchall()
        return [dict(zip(("id", "title", "date", "start", "end"), r, strict=True)) for r in rows]

    def calendar_get(self, id: int) -> dict[str, Any]:
        row = self.store.one("events", id)
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
        name, day = text_arg(title, "title"), date_arg(date)
        begin, finish = minutes_arg(start, "start"), minutes_arg(end, "end")
        if finish <= begin:
            raise ToolError("end must be after start")
        if attendees is not None and not isinstance(attendees, list):
            raise ToolError("attendees must be a list of email addresses")
        people = sorted({address_arg(a, "attendee") for a in attendees or []})
        if len(people) > MAX_ATTENDEES:
            raise ToolError(f"at most {MAX_ATTENDEES} attendees")
        conn = self.store.conn
        with conn:
            cur = conn.execute(
                "INSERT INTO events (title, date, start_time, end_time, location, attendees, status) "
                "VALUES (?, ?, ?, ?, ?, ?, 'confirmed')",
                (
                    name,
                    day,
                    hhmm(begin),
                    hhmm(finish),
                    text_arg(location, "location", empty_ok=True),
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
        day = event["date"] if date is None else date_arg(date)
        length = minutes_arg(event["end"], "end") - minutes_arg(event["start"], "start")
        begin = minutes_arg(start, "start")
        if begin + length >= 24 * 60:
            raise ToolError("the event would end after midnight")
        conn = self.store.conn
        with conn:
            conn.execute(
                "UPDATE events SET date = ?, start_time = ?, end_time = ? WHERE id = ?",
                (day, hhmm(begin), hhmm(begin + length), id),
            )
        return self.calendar_get(id)

    def calendar_cancel(self, id: int) -> dict[str, Any]:
        self._active(id)
        conn = self.store.conn
        with conn:
            conn.execute("UPDATE events SET status = 'cancelled' WHERE id = ?", (id,))
        return {"cancelled": id}

    def _set_attendees(self, id: int, people: list[str]) -> dict[str, Any]:
        conn = self.store.conn
        with conn:
            conn.execute("UPDATE events SET attendees = ? WHERE id = ?", (",".join(sorted(people)), id))
        return self.calendar_get(id)

    def calendar_invite(self, id: int, email: str) -> dict[str, Any]:
        event, address = self._active(id), address_arg(email)
        if address in event["attendees"]:
            raise ToolError(f"{address} is already invited")
        if len(event["attendees"]) >= MAX_ATTENDEES:
            raise ToolError(f"at most {MAX_ATTENDEES} attendees")
        return self._set_attendees(id, [*event["attendees"], address])

    def calendar_uninvite(self, id: int, email: str) -> dict[str, Any]:
        event, address = self._active(id), address_arg(email)
        if address not in event["attendees"]:
            raise ToolError(f"{address} is not invited")
        return self._set_attendees(id, [a for a in event["attendees"] if a != address])
