"""Task templates: a sampler over a world's data, a prompt, and the expert's minimal plan.

A `Template` turns a `World` and a `random.Random` into an `Instance`: the prompt's arguments
(names, subjects, titles: only what the user would say), the expected `Change`s (with row ids
from the world, hidden from the agent) and, for questions, the expected answer.

Its `plan(args)` is a generator: it yields API calls ``(name, arguments)``, receives each
call's parsed result, and returns the final answer text. It sees only the prompt's arguments
and the results, never the hidden ids, so the expert reads everything it needs from its
observations like an agent must. `calls` is the plan's length (the minimal number of calls).
"""

from __future__ import annotations

import datetime as dt
import random
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from steprl.envs.library.apps.checks import Change, norm
from steprl.envs.library.apps.world import (
    CITIES,
    COMPANIES,
    FIRST_NAMES,
    LAST_NAMES,
    TODAY,
    TOPICS,
    Contact,
    Email,
    Event,
    World,
)

Call = tuple[str, dict[str, Any]]
Plan = Generator[Call, Any, str]
Sampler = Callable[[World, random.Random], "Instance | None"]
Planner = Callable[[Mapping[str, Any]], Plan]


@dataclass(frozen=True)
class Instance:
    """One concrete task of a template (before the split is decided)."""

    args: Mapping[str, Any]
    changes: tuple[Change, ...] = ()
    answer: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "args", MappingProxyType(dict(self.args)))
        object.__setattr__(self, "changes", tuple(self.changes))


@dataclass(frozen=True)
class Template:
    name: str
    calls: int
    text: str  # str.format pattern over the instance's args
    sample: Sampler
    plan: Planner = field(repr=False)

    def prompt(self, args: Mapping[str, Any]) -> str:
        return self.text.format(**args)


#: Every template, in registration order (the template modules are imported in a fixed order).
REGISTRY: dict[str, Template] = {}


def template(name: str, calls: int, text: str, sample: Sampler) -> Callable[[Planner], Planner]:
    """Register the decorated plan as template `name` (see the module docstring)."""

    def register(plan: Planner) -> Planner:
        if name in REGISTRY:
            raise ValueError(f"template {name!r} is registered twice; rename one.")
        REGISTRY[name] = Template(name, calls, text, sample, plan)
        return plan

    return register


def call(name: str, **arguments: Any) -> Call:
    return (name, arguments)


def pick(rows: Sequence[Mapping[str, Any]], key: str, value: Any) -> Mapping[str, Any]:
    """The first result whose `key` equals `value` (loosely); a plan bug if there is none."""
    for row in rows:
        if norm(row.get(key)) == norm(value):
            return row
    raise LookupError(f"no result with {key}={value!r} in {list(rows)[:3]}")


# --- samplers' helpers -------------------------------------------------------------------------------

SUBJECTS = (
    "Quick note", "Heads up", "For your records", "Following up", "Details you asked for",
    "Small update", "FYI", "Contact details", "Reminder", "Hello from me",
)  # fmt: skip
MESSAGES = (
    "Thanks for your help last week.", "Can we talk tomorrow morning?", "The report is ready.",
    "I will be out of office on Friday.", "Let me know if anything changes.",
    "Looking forward to seeing you.", "Please send me the latest numbers.", "Sounds good to me.",
)  # fmt: skip
NEW_TITLE_KINDS = ("planning", "catch-up", "brainstorm", "retro", "deep dive")


def contacts(w: World, rng: random.Random, n: int) -> list[Contact]:
    return rng.sample(list(w.contacts), n)


def new_phone(w: World, rng: random.Random) -> str:
    used = {c.phone for c in w.contacts} | {v for _, v in w.new_values}
    while True:
        phone = f"555-{rng.randint(200, 989)}-{rng.randint(1000, 9999)}"
        if phone not in used:
            return phone


def new_address(c: Contact, rng: random.Random) -> str:
    return f"{c.first_name}.{c.last_name}@{rng.choice(('fastmail', 'postbox', 'inbox'))}.example".lower()


def other_city(c: Contact, rng: random.Random) -> str:
    return rng.choice([x for x in CITIES if x != c.city])


def other_company(c: Contact, rng: random.Random) -> str:
    return rng.choice([x for x in COMPANIES if x != c.company])


def new_person(w: World, rng: random.Random) -> tuple[str, str, str]:
    """A name nobody in the world has: (first, last, address)."""
    taken = {c.name for c in w.contacts} | {p.name for p in w.strangers} | {w.owner.name}
    taken_firsts = {n.split()[0] for n in taken}
    while True:
        first, last = rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)
        if f"{first} {last}" not in taken and first not in taken_firsts:
            return first, last, f"{first}.{last}@{rng.choice(('fastmail', 'postbox'))}.example".lower()


def chat_emails(w: World) -> list[Email]:
    """Inbox emails written by contacts (what most email tasks refer to)."""
    return [e for e in w.emails if e.folder == "inbox" and e.kind == "chat"]


def senders(w: World, counts: Sequence[int] = (1, 2, 3)) -> list[Contact]:
    """Contacts with a number of inbox emails in `counts`."""
    return [c for c in w.contacts if len(w.inbox_from(c.email)) in counts]


def events(w: World, attendees: Sequence[int] | None = None) -> list[Event]:
    """Active events, optionally only those with a number of attendees in `attendees`."""
    found = w.active_events()
    return [e for e in found if attendees is None or len(e.attendees) in attendees]


def minutes(hhmm: str) -> int:
    return int(hhmm[:2]) * 60 + int(hhmm[3:])


def hhmm(total: int) -> str:
    return f"{total // 60:02d}:{total % 60:02d}"


def shift(hhmm_text: str, delta: int) -> str:
    return hhmm(minutes(hhmm_text) + delta)


def add_days(date: str, days: int) -> str:
    return (dt.date.fromisoformat(date) + dt.timedelta(days=days)).isoformat()


def new_slot(rng: random.Random, length: int = 60) -> tuple[str, str, str]:
    """A weekday date in the next four weeks and a start/end time: (date, start, end)."""
    while True:
        day = TODAY + dt.timedelta(days=rng.randint(1, 27))
        if day.weekday() < 5:
            break
    start = rng.randrange(8 * 60, 17 * 60 + 1, 30)
    return day.isoformat(), hhmm(start), hhmm(start + length)


def new_title(w: World, rng: random.Random) -> str:
    taken = {e.title.lower() for e in w.events}
    while True:
        title = f"{rng.choice(TOPICS)} {rng.choice(NEW_TITLE_KINDS)}"
        if not any(title.lower() in t or t in title.lower() for t in taken):
            return title


def reply_subject(subject: str) -> str:
    return subject if subject.lower().startswith("re:") else f"Re: {subject}"
