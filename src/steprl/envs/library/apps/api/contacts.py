"""The contacts app: search, read, add, update and delete contacts (table ``contacts``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from steprl.envs.base import ToolError
from steprl.envs.library.apps.api.base import (
    Function,
    Store,
    address_arg,
    date_arg,
    define,
    int_arg,
    text_arg,
)

_FIELDS = ("first_name", "last_name", "email", "phone", "company", "city", "birthday")

FUNCTIONS: tuple[Function, ...] = (
    define(
        "contacts_search",
        "query, limit=10",
        "contacts whose name, email, phone or company contains query: [{id, name, email, phone}]",
        "query:string",
        "limit:integer",
    ),
    define(
        "contacts_get",
        "id",
        "one contact: {id, first_name, last_name, email, phone, company, city, birthday}",
        "id:integer",
    ),
    define(
        "contacts_add",
        "first_name, last_name, email, phone='', company='', city='', birthday=''",
        "add a contact (birthday as YYYY-MM-DD): {id}",
        "first_name:string last_name:string email:string",
        "phone:string company:string city:string birthday:string",
        mutates=True,
    ),
    define(
        "contacts_update",
        "id, first_name?, last_name?, email?, phone?, company?, city?, birthday?",
        "change the given fields of a contact",
        "id:integer",
        " ".join(f"{k}:string" for k in _FIELDS),
        mutates=True,
    ),
    define("contacts_delete", "id", "delete a contact", "id:integer", mutates=True),
)


class Contacts:
    """The contacts functions over the episode database in `store`."""

    def __init__(self, store: Store) -> None:
        self.store = store

    @staticmethod
    def _contact(row: tuple[Any, ...]) -> dict[str, Any]:
        return dict(zip(("id", *_FIELDS), row, strict=True))

    def contacts_search(self, query: str, limit: int = 10) -> list[dict[str, Any]]:
        q = text_arg(query, "query", empty_ok=True).lower()
        rows = self.store.conn.execute(
            "SELECT id, first_name || ' ' || last_name, email, phone FROM contacts WHERE instr(lower("
            "first_name || ' ' || last_name || '|' || email || '|' || phone || '|' || company), ?) "
            "ORDER BY id LIMIT ?",
            (q, int_arg(limit, "limit", 1, 50)),
        ).fetchall()
        return [dict(zip(("id", "name", "email", "phone"), r, strict=True)) for r in rows]

    def contacts_get(self, id: int) -> dict[str, Any]:
        return self._contact(self.store.one("contacts", id))

    def _values(self, fields: Mapping[str, Any]) -> dict[str, str]:
        values = {}
        for key, value in fields.items():
            if key == "email":
                values[key] = address_arg(value)
            elif key == "birthday":
                values[key] = date_arg(value, "birthday") if str(value).strip() else ""
            else:
                values[key] = text_arg(value, key, empty_ok=key not in ("first_name", "last_name"))
        return values

    def _email_taken(self, address: str, but: int = 0) -> None:
        row = self.store.conn.execute(
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
        v = self._values(
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
        conn = self.store.conn
        with conn:
            cur = conn.execute(
                "INSERT INTO contacts (first_name, last_name, email, phone, company, city, birthday) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                tuple(v[k] for k in _FIELDS),
            )
        return {"id": cur.lastrowid}

    def contacts_update(self, id: int, **fields: Any) -> dict[str, Any]:
        current = self.contacts_get(id)
        unknown = sorted(set(fields) - set(_FIELDS))
        if unknown:
            raise ToolError(f"unknown field '{str(unknown[0])[:32]}'")
        if not fields:
            raise ToolError("give at least one field to change")
        values = self._values(fields)
        if "email" in values:
            self._email_taken(values["email"], but=current["id"])
        conn = self.store.conn
        with conn:
            for key in _FIELDS:  # fixed column names, in a fixed order
                if key in values:
                    conn.execute(f"UPDATE contacts SET {key} = ? WHERE id = ?", (values[key], id))
        return self.contacts_get(id)

    def contacts_delete(self, id: int) -> dict[str, Any]:
        self.contacts_get(id)
        conn = self.store.conn
        with conn:
            conn.execute("DELETE FROM contacts WHERE id = ?", (id,))
        return {"deleted": id}
