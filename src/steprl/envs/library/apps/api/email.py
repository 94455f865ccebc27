"""The email app: list, read, send, reply to, forward and trash emails (table ``emails``).

Sent mail comes from the world's owner (``meta.owner_email``) and is dated ``meta.now``.
"""

from __future__ import annotations

from typing import Any

from steprl.envs.base import ToolError
from steprl.envs.library.apps.api.base import Function, Store, address_arg, define, int_arg, text_arg

FUNCTIONS: tuple[Function, ...] = (
    define(
        "email_list",
        "folder='inbox', query='', limit=10",
        "emails in a folder (inbox, sent, trash), newest first, whose from, to or subject "
        "contains query: [{id, from, to, subject, date}]",
        "",
        "folder:string query:string limit:integer",
    ),
    define("email_read", "id", "one email with its body", "id:integer"),
    define(
        "email_send",
        "to, subject, body",
        "send an email: {id}",
        "to:string subject:string body:string",
        "",
        True,
    ),
    define(
        "email_reply", "id, body", "reply to an email (subject 'Re: ...')", "id:integer body:string", "", True
    ),
    define(
        "email_forward",
        "id, to, note=''",
        "forward an email (subject 'Fwd: ...')",
        "id:integer to:string",
        "note:string",
        mutates=True,
    ),
    define("email_delete", "id", "move an email to the trash", "id:integer", mutates=True),
)


class Email:
    """The email functions over the episode database in `store`."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def email_list(self, folder: str = "inbox", query: str = "", limit: int = 10) -> list[dict[str, Any]]:
        box = text_arg(folder, "folder").lower()
        if box not in ("inbox", "sent", "trash"):
            raise ToolError("folder must be inbox, sent or trash")
        q = text_arg(query, "query", empty_ok=True).lower()
        rows = self.store.conn.execute(
            "SELECT id, sender, recipient, subject, date FROM emails WHERE folder = ? AND "
            "instr(lower(sender || '|' || recipient || '|' || subject), ?) "
            "ORDER BY date DESC, id DESC LIMIT ?",
            (box, q, int_arg(limit, "limit", 1, 50)),
        ).fetchall()
        return [dict(zip(("id", "from", "to", "subject", "date"), r, strict=True)) for r in rows]

    def email_read(self, id: int) -> dict[str, Any]:
        row = self.store.one("emails", id)
        return dict(zip(("id", "folder", "from", "to", "subject", "body", "date"), row, strict=True))

    def _send(self, to: str, subject: str, body: str) -> dict[str, Any]:
        conn = self.store.conn
        with conn:
            cur = conn.execute(
                "INSERT INTO emails (folder, sender, recipient, subject, body, date) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                ("sent", self.store.meta("owner_email"), to, subject, body, self.store.meta("now")),
            )
        return {"id": cur.lastrowid}

    def email_send(self, to: str, subject: str, body: str) -> dict[str, Any]:
        return self._send(address_arg(to, "to"), text_arg(subject, "subject"), text_arg(body, "body"))

    def email_reply(self, id: int, body: str) -> dict[str, Any]:
        original = self.email_read(id)
        text = text_arg(body, "body")
        owner = self.store.meta("owner_email")
        to = original["to"] if original["from"] == owner else original["from"]
        subject = original["subject"]
        subject = subject if subject.lower().startswith("re:") else f"Re: {subject}"
        return self._send(to, subject, text)

    def email_forward(self, id: int, to: str, note: str = "") -> dict[str, Any]:
        original = self.email_read(id)
        address, text = address_arg(to, "to"), text_arg(note, "note", empty_ok=True)
        quoted = (
            f"---------- Forwarded message ----------\nFrom: {original['from']}\n"
            f"Subject: {original['subject']}\n\n{original['body']}"
        )
        return self._send(address, f"Fwd: {original['subject']}", f"{text}\n\n{quoted}" if text else quoted)

    def email_delete(self, id: int) -> dict[str, Any]:
        if self.email_read(id)["folder"] == "trash":
            raise ToolError(f"email {id} is already in the trash")
        conn = self.store.conn
        with conn:
            conn.execute("UPDATE emails SET folder = 'trash' WHERE id = ?", (id,))
        return {"trashed": id}
