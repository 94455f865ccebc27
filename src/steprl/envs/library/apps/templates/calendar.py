"""Calendar templates: move, cancel, invite, create, and questions about events (2 to 5 calls)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Generator, Mapping
from typing import Any

from steprl.envs.library.apps.checks import Change, update
from steprl.envs.library.apps.templates.base import (
    REGISTRY,
    Call,
    Instance,
    Plan,
    Template,
    add_days,
    call,
    contacts,
    events,
    minutes,
    new_slot,
    new_title,
    pick,
    shift,
    template,
)
from steprl.envs.library.apps.templates.email import find_contact
from steprl.envs.library.apps.world import Event, World


def find_event(title: str) -> Generator[Call, Any, Mapping[str, Any]]:
    """The upcoming event with this title: {id, title, date, start, end} (`yield from`)."""
    found = yield call("calendar_list", query=title)
    return pick(found, "title", title)


def event_details(title: str) -> Generator[Call, Any, Mapping[str, Any]]:
    """All of the upcoming event with this title, as `calendar_get` answers (`yield from`)."""
    e = yield from find_event(title)
    return (yield call("calendar_get", id=e["id"]))


def moved(e: Event, date: str, start: str) -> Change:
    end = shift(start, minutes(e.end) - minutes(e.start))
    return update(
        "events", e.id, f'"{e.title}" at {date} {start}-{end}', date=date, start_time=start, end_time=end
    )


def cancelled(e: Event) -> Change:
    return update("events", e.id, f'"{e.title}" cancelled', status="cancelled")


def attendees(e: Event, people: list[str]) -> Change:
    final = ",".join(sorted(people))
    return update("events", e.id, f'"{e.title}" attendees are {final or "nobody"}', attendees=final)


def _s_move(w: World, rng: random.Random) -> Instance | None:
    e = rng.choice(events(w))
    date, start, _ = new_slot(rng)
    if (date, start) == (e.date, e.start):
        return None
    return Instance({"title": e.title, "date": date, "start": start}, (moved(e, date, start),))


@template("calendar_move", 2, 'Move "{title}" to {date} at {start}.', _s_move)
def _p_move(a: Mapping[str, Any]) -> Plan:
    e = yield from find_event(a["title"])
    yield call("calendar_move", id=e["id"], date=a["date"], start=a["start"])
    return "done"


def _shift_template(name: str, text: str, sign: int) -> None:
    def sample(w: World, rng: random.Random) -> Instance:
        e, delta = rng.choice(events(w)), rng.choice((30, 60, 90))
        return Instance(
            {"title": e.title, "minutes": delta}, (moved(e, e.date, shift(e.start, sign * delta)),)
        )

    def plan(a: Mapping[str, Any]) -> Plan:
        e = yield from find_event(a["title"])
        yield call("calendar_move", id=e["id"], start=shift(e["start"], sign * a["minutes"]))
        return "done"

    REGISTRY[name] = Template(name, 2, text, sample, plan)


_shift_template("calendar_push_back", 'Push "{title}" back by {minutes} minutes (same day).', 1)
_shift_template("calendar_bring_forward", 'Move "{title}" {minutes} minutes earlier (same day).', -1)


def _s_next_week(w: World, rng: random.Random) -> Instance:
    e = rng.choice(events(w))
    return Instance({"title": e.title}, (moved(e, add_days(e.date, 7), e.start),))


@template("calendar_next_week", 2, 'Move "{title}" to the same time one week later.', _s_next_week)
def _p_next_week(a: Mapping[str, Any]) -> Plan:
    e = yield from find_event(a["title"])
    yield call("calendar_move", id=e["id"], date=add_days(e["date"], 7), start=e["start"])
    return "done"


def _s_cancel(w: World, rng: random.Random) -> Instance:
    e = rng.choice(events(w))
    return Instance({"title": e.title}, (cancelled(e),))


@template("calendar_cancel", 2, 'Cancel "{title}".', _s_cancel)
def _p_cancel(a: Mapping[str, Any]) -> Plan:
    e = yield from find_event(a["title"])
    yield call("calendar_cancel", id=e["id"])
    return "done"


def _s_cancel_two(w: World, rng: random.Random) -> Instance:
    e1, e2 = rng.sample(events(w), 2)
    return Instance({"title1": e1.title, "title2": e2.title}, (cancelled(e1), cancelled(e2)))


@template("calendar_cancel_two", 4, 'Cancel "{title1}" and "{title2}".', _s_cancel_two)
def _p_cancel_two(a: Mapping[str, Any]) -> Plan:
    for key in ("title1", "title2"):
        e = yield from find_event(a[key])
        yield call("calendar_cancel", id=e["id"])
    return "done"


def _s_cancel_day(w: World, rng: random.Random) -> Instance | None:
    per_day = Counter(e.date for e in events(w))
    days = sorted(d for d, n in per_day.items() if n == 2)
    if not days:
        return None
    day = rng.choice(days)
    return Instance({"date": day}, tuple(cancelled(e) for e in events(w) if e.date == day))


@template("calendar_cancel_day", 3, "Cancel all my events on {date}.", _s_cancel_day)
def _p_cancel_day(a: Mapping[str, Any]) -> Plan:
    found = yield call("calendar_list", date=a["date"])
    for e in found:
        yield call("calendar_cancel", id=e["id"])
    return "done"


def _s_invite(w: World, rng: random.Random) -> Instance | None:
    e, c = rng.choice(events(w)), contacts(w, rng, 1)[0]
    if c.email in e.attendees:
        return None
    return Instance({"name": c.name, "title": e.title}, (attendees(e, [*e.attendees, c.email]),))


@template("calendar_invite", 3, 'Invite {name} to "{title}".', _s_invite)
def _p_invite(a: Mapping[str, Any]) -> Plan:
    e = yield from find_event(a["title"])
    c = yield from find_contact(a["name"])
    yield call("calendar_invite", id=e["id"], email=c["email"])
    return "done"


def _s_invite_two(w: World, rng: random.Random) -> Instance | None:
    e, (c1, c2) = rng.choice(events(w)), contacts(w, rng, 2)
    if c1.email in e.attendees or c2.email in e.attendees:
        return None
    change = attendees(e, [*e.attendees, c1.email, c2.email])
    return Instance({"name1": c1.name, "name2": c2.name, "title": e.title}, (change,))


@template("calendar_invite_two", 5, 'Invite {name1} and {name2} to "{title}".', _s_invite_two)
def _p_invite_two(a: Mapping[str, Any]) -> Plan:
    e = yield from find_event(a["title"])
    for key in ("name1", "name2"):
        c = yield from find_contact(a[key])
        yield call("calendar_invite", id=e["id"], email=c["email"])
    return "done"


def _s_uninvite(w: World, rng: random.Random) -> Instance | None:
    e = rng.choice(events(w, (1, 2, 3)))
    c = w.contact_by_email(rng.choice(e.attendees))
    if c is None:
        return None
    change = attendees(e, [a for a in e.attendees if a != c.email])
    return Instance({"name": c.name, "title": e.title}, (change,))


@template("calendar_uninvite", 3, 'Remove {name} from the attendees of "{title}".', _s_uninvite)
def _p_uninvite(a: Mapping[str, Any]) -> Plan:
    e = yield from find_event(a["title"])
    c = yield from find_contact(a["name"])
    yield call("calendar_uninvite", id=e["id"], email=c["email"])
    return "done"


def created(title: str, date: str, start: str, end: str, people: list[str] | None = None) -> Change:
    """A new confirmed event with these fields (and exactly these attendees, when given)."""
    equals = {"title": title, "date": date, "start_time": start, "end_time": end, "status": "confirmed"}
    if people is not None:
        equals["attendees"] = ",".join(sorted(people))
    return Change("insert", "events", f'"{title}" on {date} {start}-{end} created', equals=equals)


def _create_template(name: str, n: int, text: str) -> None:
    keys = ("name1", "name2")[:n]

    def sample(w: World, rng: random.Random) -> Instance:
        people = contacts(w, rng, n)
        title = new_title(w, rng)
        date, start, end = new_slot(rng, rng.choice((30, 60)))
        args = {"title": title, "date": date, "start": start, "end": end}
        args.update({k: c.name for k, c in zip(keys, people, strict=True)})
        return Instance(args, (created(title, date, start, end, [c.email for c in people]),))

    def plan(a: Mapping[str, Any]) -> Plan:
        people = []
        for key in keys:
            c = yield from find_contact(a[key])
            people.append(c["email"])
        yield call(
            "calendar_create",
            title=a["title"],
            date=a["date"],
            start=a["start"],
            end=a["end"],
            attendees=people,
        )
        return "done"

    REGISTRY[name] = Template(name, n + 1, text, sample, plan)


_create_template("calendar_create", 1, 'Schedule "{title}" with {name1} on {date} from {start} to {end}.')
_create_template(
    "calendar_create_two", 2, 'Schedule "{title}" with {name1} and {name2} on {date} from {start} to {end}.'
)


def _s_follow_up(w: World, rng: random.Random) -> Instance:
    e = rng.choice(events(w, (1, 2, 3)))
    title, date = new_title(w, rng), add_days(e.date, 7)
    return Instance(
        {"title": title, "old": e.title}, (created(title, date, e.start, e.end, list(e.attendees)),)
    )


@template(
    "calendar_follow_up",
    3,
    'Schedule "{title}" one week after "{old}", at the same time and with the same attendees.',
    _s_follow_up,
)
def _p_follow_up(a: Mapping[str, Any]) -> Plan:
    full = yield from event_details(a["old"])
    yield call(
        "calendar_create",
        title=a["title"],
        date=add_days(full["date"], 7),
        start=full["start"],
        end=full["end"],
        attendees=full["attendees"],
    )
    return "done"


def _s_after(w: World, rng: random.Random) -> Instance | None:
    e1, e2 = rng.sample(events(w), 2)
    if (e2.date, e2.end) == (e1.date, e1.start):
        return None
    return Instance({"title1": e1.title, "title2": e2.title}, (moved(e1, e2.date, e2.end),))


@template(
    "calendar_move_after",
    3,
    'Move "{title1}" so that it starts when "{title2}" ends, on the same day.',
    _s_after,
)
def _p_after(a: Mapping[str, Any]) -> Plan:
    e1 = yield from find_event(a["title1"])
    e2 = yield from find_event(a["title2"])
    yield call("calendar_move", id=e1["id"], date=e2["date"], start=e2["end"])
    return "done"


# --- questions ------------------------------------------------------------------------------------


def _s_location(w: World, rng: random.Random) -> Instance:
    e = rng.choice(events(w))
    return Instance({"title": e.title}, (), e.location)


@template("ask_event_location", 2, 'Where does "{title}" take place?', _s_location)
def _p_location(a: Mapping[str, Any]) -> Plan:
    full = yield from event_details(a["title"])
    return str(full["location"])


def _s_attendee_count(w: World, rng: random.Random) -> Instance:
    e = rng.choice(events(w))
    return Instance({"title": e.title}, (), str(len(e.attendees)))


@template(
    "ask_attendee_count",
    2,
    'How many people besides me are invited to "{title}"? Answer with a number.',
    _s_attendee_count,
)
def _p_attendee_count(a: Mapping[str, Any]) -> Plan:
    full = yield from event_details(a["title"])
    return str(len(full["attendees"]))


def _s_meeting_with(w: World, rng: random.Random) -> Instance | None:
    e = rng.choice(events(w, (1,)))
    c = w.contact_by_email(e.attendees[0])
    return None if c is None else Instance({"title": e.title}, (), c.name)


@template(
    "ask_meeting_with", 3, 'Who am I meeting in "{title}"? Answer with their full name.', _s_meeting_with
)
def _p_meeting_with(a: Mapping[str, Any]) -> Plan:
    full = yield from event_details(a["title"])
    found = yield call("contacts_search", query=full["attendees"][0])
    return str(pick(found, "email", full["attendees"][0])["name"])
