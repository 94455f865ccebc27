"""SQLite storage: a golden database per data seed, one copy per episode, and a state hash.

Isolation (reliability ENV-08): the golden database of a world is built once per process (in
memory, read-only) and every episode gets its own in-memory copy, made with
`sqlite3.Connection.backup` at reset. Episodes never share a connection or a file, so one
episode's writes are invisible to every other, and a reset discards them all.

Determinism (ENV-09): `state_hash` hashes the sorted contents of every user table (not the
file bytes, which depend on the SQLite version and page layout), so the baseline hash of a
world is the same in every process; after a reset an episode's hash equals it exactly.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sqlite3
import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from steprl.envs.library.apps.world import NOW, World, build_world

# AUTOINCREMENT: ids are never reused, so a deleted row and a new one can never be confused.
SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE contacts (
    id INTEGER PRIMARY KEY AUTOINCREMENT, first_name TEXT NOT NULL, last_name TEXT NOT NULL,
    email TEXT NOT NULL, phone TEXT NOT NULL, company TEXT NOT NULL, city TEXT NOT NULL,
    birthday TEXT NOT NULL);
CREATE TABLE emails (
    id INTEGER PRIMARY KEY AUTOINCREMENT, folder TEXT NOT NULL, sender TEXT NOT NULL,
    recipient TEXT NOT NULL, subject TEXT NOT NULL, body TEXT NOT NULL, date TEXT NOT NULL);
CREATE TABLE events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL, date TEXT NOT NULL,
    start_time TEXT NOT NULL, end_time TEXT NOT NULL, location TEXT NOT NULL,
    attendees TEXT NOT NULL, status TEXT NOT NULL);
"""

#: The tables a state hash and a snapshot cover, in a fixed order.
TABLES = ("contacts", "emails", "events", "meta")

Row = tuple[Any, ...]
#: table -> (column names, {primary key -> row}) (read-only).
Snapshot = Mapping[str, tuple[tuple[str, ...], Mapping[Any, Row]]]

_COPY_LOCK = threading.Lock()  # one backup at a time out of a shared golden connection


def _fill(conn: sqlite3.Connection, world: World) -> None:
    conn.executescript(SCHEMA)
    meta = {"owner_name": world.owner.name, "owner_email": world.owner.email, "now": NOW}
    conn.executemany("INSERT INTO meta VALUES (?, ?)", sorted(meta.items()))
    conn.executemany(
        "INSERT INTO contacts VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        [
            (c.id, c.first_name, c.last_name, c.email, c.phone, c.company, c.city, c.birthday)
            for c in world.contacts
        ],
    )
    conn.executemany(
        "INSERT INTO emails VALUES (?, ?, ?, ?, ?, ?, ?)",
        [(e.id, e.folder, e.sender, e.recipient, e.subject, e.body, e.date) for e in world.emails],
    )
    conn.executemany(
        "INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        [
            (e.id, e.title, e.date, e.start, e.end, e.location, ",".join(e.attendees), e.status)
            for e in world.events
        ],
    )
    conn.commit()


@functools.lru_cache(maxsize=32)
def golden(world_seed: int) -> sqlite3.Connection:
    """The read-only golden database of a world (built once per process, cached)."""
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    _fill(conn, build_world(world_seed))
    conn.execute("PRAGMA query_only = ON")
    return conn


def episode_db(world_seed: int) -> sqlite3.Connection:
    """A fresh, private, writable copy of the world's golden database (copy-on-reset).

    `check_same_thread=False`: an env may be stepped from worker threads, one call at a time.
    """
    source = golden(world_seed)
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    with _COPY_LOCK:
        source.backup(conn)
    return conn


def snapshot(conn: sqlite3.Connection) -> Snapshot:
    """Every row of every table, keyed by primary key (the first column)."""
    tables: dict[str, tuple[tuple[str, ...], Mapping[Any, Row]]] = {}
    for table in TABLES:
        cursor = conn.execute(f"SELECT * FROM {table} ORDER BY 1")  # fixed table names, no input
        columns = tuple(d[0] for d in cursor.description)
        tables[table] = (columns, MappingProxyType({row[0]: tuple(row) for row in cursor.fetchall()}))
    return MappingProxyType(tables)


def state_hash(conn: sqlite3.Connection) -> str:
    """sha256 over the sorted contents of every table (content only; stable across processes)."""
    digest = hashlib.sha256()
    for table, (columns, rows) in snapshot(conn).items():
        digest.update(json.dumps([table, columns]).encode())
        for key in sorted(rows):
            digest.update(json.dumps(rows[key], ensure_ascii=True).encode())
            digest.update(b"\n")
    return digest.hexdigest()


@functools.lru_cache(maxsize=32)
def golden_snapshot(world_seed: int) -> Snapshot:
    """The golden database's snapshot (cached): what every final state is compared to."""
    with _COPY_LOCK:
        return snapshot(golden(world_seed))


@functools.lru_cache(maxsize=32)
def baseline_hash(world_seed: int) -> str:
    """The state hash of a world's golden database: every episode's hash right after reset."""
    with _COPY_LOCK:
        return state_hash(golden(world_seed))
