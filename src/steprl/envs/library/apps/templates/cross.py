"""Cross-app templates: tasks that read one app and change another (2 to 4 calls)."""

from __future__ import annotations

import random
from collections.abc import Generator, Mapping
from typing import Any

from steprl.envs.library.apps.checks import delete, insert, update
from steprl.envs.library.apps.templates.base import (
    MESSAGES,
    SUBJECTS,
    Call,
    Instance,
    Plan,
    call,
    chat_emails,
    contacts,
    events,
    new_person,
    new_slot,
    new_title,
    pick,
    reply_subject,
    senders,
    template,
)
from steprl.envs.library.apps.templates.calendar import (
    attendees,
    cancelled,
    created,
    event_details,
    find_event,
    moved,
)
from steprl.envs.library.apps.templates.email import find_contact, find_email, latest_from, sent, trashed
from steprl.envs.library.apps.world import World


def _email_contact(a: Mapping[str, Any], body: str) -> Generator[Call, Any, None]:
    """Email the contact named ``a["name"]`` with the subject ``a["subject"]`` (`yield from`)."""
    c = yield from find_contact(a["name"])
    yield call("email_send", to=c["email"], subject=a["subject"], body=body)


def _s_move_notify(w: World, rng: random.Random) -> Instance | None:
    e, c = rng.choice(events(w)), contacts(w, rng, 1)[0]
    date, start, _ = new_slot(rng)
    if (date, start) == (e.date, e.start):
        return None
    subject = rng.choice(SUBJECTS)
    changes = (moved(e, date, start), sent(c, subject, f"{c.name} told the new time", [date, start]))
    return Instance(
        {"title": e.title, "date": date, "start": start, "name": c.name, "subject": subject}, changes
    )


@template(
    "cross_move_notify",
    4,
    'Move "{title}" to {date} at {start}, then email {name} about it with the subject "{subject}".',
    _s_move_notify,
)
def _p_move_notify(a: Mapping[str, Any]) -> Plan:
    e = yield from find_event(a["title"])
    yield call("calendar_move", id=e["id"], date=a["date"], start=a["start"])
    yield from _email_contact(a, f'"{a["title"]}" is now on {a["date"]} at {a["start"]}.')
    return "done"


def _s_cancel_notify(w: World, rng: random.Random) -> Instance:
    e, c, subject = rng.choice(events(w)), contacts(w, rng, 1)[0], rng.choice(SUBJECTS)
    changes = (cancelled(e), sent(c, subject, f'{c.name} told about "{e.title}"'))
    return Instance({"title": e.title, "name": c.name, "subject": subject}, changes)


@template(
    "cross_cancel_notify",
    4,
    'Cancel "{title}" and let {name} know by email (subject "{subject}").',
    _s_cancel_notify,
)
def _p_cancel_notify(a: Mapping[str, Any]) -> Plan:
    e = yield from find_event(a["title"])
    yield call("calendar_cancel", id=e["id"])
    yield from _email_contact(a, f'"{a["title"]}" is cancelled.')
    return "done"


def _s_email_location(w: World, rng: random.Random) -> Instance:
    e, c, subject = rng.choice(events(w)), contacts(w, rng, 1)[0], rng.choice(SUBJECTS)
    change = sent(c, subject, f'location of "{e.title}" emailed to {c.name}', e.location)
    return Instance({"title": e.title, "name": c.name, "subject": subject}, (change,))


@template(
    "cross_email_location",
    4,
    'Email {name} the location of "{title}" (subject "{subject}").',
    _s_email_location,
)
def _p_email_location(a: Mapping[str, Any]) -> Plan:
    full = yield from event_details(a["title"])
    yield from _email_contact(a, f"It is at {full['location']}.")
    return "done"


def _s_email_time(w: World, rng: random.Random) -> Instance:
    e, c, subject = rng.choice(events(w)), contacts(w, rng, 1)[0], rng.choice(SUBJECTS)
    change = sent(c, subject, f'start of "{e.title}" emailed to {c.name}', [e.date, e.start])
    return Instance({"title": e.title, "name": c.name, "subject": subject}, (change,))


@template(
    "cross_email_time",
    3,
    'Tell {name} by email when "{title}" starts, as YYYY-MM-DD HH:MM (subject "{subject}").',
    _s_email_time,
)
def _p_email_time(a: Mapping[str, Any]) -> Plan:
    e = yield from find_event(a["title"])
    yield from _email_contact(a, f"It starts {e['date']} {e['start']}.")
    return "done"


def _s_invite_sender(w: World, rng: random.Random) -> Instance | None:
    m, e = rng.choice(chat_emails(w)), rng.choice(events(w))
    if m.sender in e.attendees:
        return None
    return Instance({"subject": m.subject, "title": e.title}, (attendees(e, [*e.attendees, m.sender]),))


@template(
    "cross_invite_sender", 3, 'Invite the sender of the email "{subject}" to "{title}".', _s_invite_sender
)
def _p_invite_sender(a: Mapping[str, Any]) -> Plan:
    found = yield call("email_list", query=a["subject"])
    sender = pick(found, "subject", a["subject"])["from"]
    e = yield from find_event(a["title"])
    yield call("calendar_invite", id=e["id"], email=sender)
    return "done"


def _s_meet_sender(w: World, rng: random.Random) -> Instance:
    m = rng.choice([e for e in w.emails if e.folder == "inbox" and e.kind in ("chat", "intro")])
    title = new_title(w, rng)
    date, start, end = new_slot(rng)
    args = {"title": title, "date": date, "start": start, "end": end, "subject": m.subject}
    return Instance(args, (created(title, date, start, end, [m.sender]),))


@template(
    "cross_meet_sender",
    2,
    'Schedule "{title}" on {date} from {start} to {end} with the person who sent me "{subject}".',
    _s_meet_sender,
)
def _p_meet_sender(a: Mapping[str, Any]) -> Plan:
    found = yield call("email_list", query=a["subject"])
    sender = pick(found, "subject", a["subject"])["from"]
    yield call(
        "calendar_create",
        title=a["title"],
        date=a["date"],
        start=a["start"],
        end=a["end"],
        attendees=[sender],
    )
    return "done"


def _s_add_invite(w: World, rng: random.Random) -> Instance:
    first, last, address = new_person(w, rng)
    e = rng.choice(events(w))
    changes = (
        insert("contacts", f"contact {first} {last} added", first_name=first, last_name=last, email=address),
        attendees(e, [*e.attendees, address]),
    )
    return Instance({"first": first, "last": last, "email": address, "title": e.title}, changes)


@template(
    "cross_add_invite",
    3,
    'Add {first} {last} ({email}) to my contacts and invite them to "{title}".',
    _s_add_invite,
)
def _p_add_invite(a: Mapping[str, Any]) -> Plan:
    yield call("contacts_add", first_name=a["first"], last_name=a["last"], email=a["email"])
    e = yield from find_event(a["title"])
    yield call("calendar_invite", id=e["id"], email=a["email"])
    return "done"


def _s_add_sender(w: World, rng: random.Random, reply: bool = False) -> Instance:
    person = rng.choice(w.strangers)
    m = next(e for e in w.emails if e.sender == person.email)
    changes = [
        insert(
            "contacts",
            f"contact {person.name} added",
            first_name=person.first_name,
            last_name=person.last_name,
            email=person.email,
        )
    ]
    args = {"subject": m.subject, "first": person.first_name, "last": person.last_name}
    if reply:
        args["body"] = rng.choice(MESSAGES)
        changes.append(
            sent(person.email, reply_subject(m.subject), f"reply to {person.name} sent", args["body"])
        )
    return Instance(args, tuple(changes))


@template(
    "cross_add_sender",
    2,
    'Add the person who sent me "{subject}" to my contacts as {first} {last}.',
    _s_add_sender,
)
def _p_add_sender(a: Mapping[str, Any]) -> Plan:
    found = yield call("email_list", query=a["subject"])
    sender = pick(found, "subject", a["subject"])["from"]
    yield call("contacts_add", first_name=a["first"], last_name=a["last"], email=sender)
    return "done"


@template(
    "cross_add_sender_reply",
    3,
    'Add the person who sent me "{subject}" to my contacts as {first} {last}, '
    'and reply "{body}" to their email.',
    lambda w, rng: _s_add_sender(w, rng, reply=True),
)
def _p_add_sender_reply(a: Mapping[str, Any]) -> Plan:
    found = yield call("email_list", query=a["subject"])
    m = pick(found, "subject", a["subject"])
    yield call("contacts_add", first_name=a["first"], last_name=a["last"], email=m["from"])
    yield call("email_reply", id=m["id"], body=a["body"])
    return "done"


def _s_attendee_phone(w: World, rng: random.Random) -> Instance | None:
    e = rng.choice(events(w, (1,)))
    c = w.contact_by_email(e.attendees[0])
    return None if c is None else Instance({"title": e.title}, (), c.phone)


@template(
    "cross_attendee_phone",
    3,
    'What is the phone number of the person I am meeting in "{title}"?',
    _s_attendee_phone,
)
def _p_attendee_phone(a: Mapping[str, Any]) -> Plan:
    full = yield from event_details(a["title"])
    found = yield call("contacts_search", query=full["attendees"][0])
    return str(pick(found, "email", full["attendees"][0])["phone"])


def _s_forward_attendee(w: World, rng: random.Random) -> Instance | None:
    e, m = rng.choice(events(w, (1,))), rng.choice(chat_emails(w))
    if m.sender == e.attendees[0]:
        return None
    change = sent(e.attendees[0], f"Fwd: {m.subject}", f'"{m.subject}" forwarded to the "{e.title}" attendee')
    return Instance({"subject": m.subject, "title": e.title}, (change,))


@template(
    "cross_forward_attendee",
    4,
    'Forward the email "{subject}" to the person I am meeting in "{title}".',
    _s_forward_attendee,
)
def _p_forward_attendee(a: Mapping[str, Any]) -> Plan:
    full = yield from event_details(a["title"])
    eid = yield from find_email(a["subject"])
    yield call("email_forward", id=eid, to=full["attendees"][0])
    return "done"


def _s_reply_time(w: World, rng: random.Random) -> Instance:
    m, e = rng.choice(chat_emails(w)), rng.choice(events(w))
    change = sent(m.sender, reply_subject(m.subject), f'reply with the start of "{e.title}" sent', e.start)
    return Instance({"subject": m.subject, "title": e.title}, (change,))


@template(
    "cross_reply_time",
    3,
    'Reply to the email "{subject}" with the start time (HH:MM) of "{title}".',
    _s_reply_time,
)
def _p_reply_time(a: Mapping[str, Any]) -> Plan:
    eid = yield from find_email(a["subject"])
    e = yield from find_event(a["title"])
    yield call("email_reply", id=eid, body=f"It starts at {e['start']}.")
    return "done"


def _s_birthday(w: World, rng: random.Random) -> Instance:
    c = contacts(w, rng, 1)[0]
    title = f"{c.name}'s birthday"
    return Instance({"name": c.name}, (created(title, "2024" + c.birthday[4:], "09:00", "09:30"),))


@template(
    "cross_birthday_event",
    3,
    'Add "{name}\'s birthday" to my calendar on their birthday in 2024, from 09:00 to 09:30.',
    _s_birthday,
)
def _p_birthday(a: Mapping[str, Any]) -> Plan:
    c = yield from find_contact(a["name"])
    full = yield call("contacts_get", id=c["id"])
    date = "2024" + full["birthday"][4:]
    yield call("calendar_create", title=f"{a['name']}'s birthday", date=date, start="09:00", end="09:30")
    return "done"


def _s_create_email(w: World, rng: random.Random) -> Instance:
    c, title = contacts(w, rng, 1)[0], new_title(w, rng)
    date, start, end = new_slot(rng)
    changes = (
        created(title, date, start, end, [c.email]),
        sent(c, title, f'{c.name} emailed about "{title}"'),
    )
    return Instance({"title": title, "name": c.name, "date": date, "start": start, "end": end}, changes)


@template(
    "cross_create_email",
    3,
    'Schedule "{title}" with {name} on {date} from {start} to {end}, '
    'then email them with the subject "{title}".',
    _s_create_email,
)
def _p_create_email(a: Mapping[str, Any]) -> Plan:
    c = yield from find_contact(a["name"])
    yield call(
        "calendar_create",
        title=a["title"],
        date=a["date"],
        start=a["start"],
        end=a["end"],
        attendees=[c["email"]],
    )
    body = f"See you on {a['date']} at {a['start']}."
    yield call("email_send", to=c["email"], subject=a["title"], body=body)
    return "done"


def _s_forget(w: World, rng: random.Random) -> Instance:
    c = rng.choice(senders(w))
    changes = (delete("contacts", c.id, f"{c.name} deleted"), trashed(w.inbox_from(c.email)[0]))
    return Instance({"name": c.name}, changes)


@template(
    "cross_forget_contact",
    4,
    "Delete {name} from my contacts and delete the most recent email they sent me.",
    _s_forget,
)
def _p_forget(a: Mapping[str, Any]) -> Plan:
    c = yield from find_contact(a["name"])
    yield call("contacts_delete", id=c["id"])
    m = yield from latest_from(c["email"])
    yield call("email_delete", id=m["id"])
    return "done"


def _s_move_invite(w: World, rng: random.Random) -> Instance | None:
    e, c = rng.choice(events(w)), contacts(w, rng, 1)[0]
    date, start, _ = new_slot(rng)
    if c.email in e.attendees or (date, start) == (e.date, e.start):
        return None
    changes = (moved(e, date, start), attendees(e, [*e.attendees, c.email]))
    return Instance({"title": e.title, "date": date, "start": start, "name": c.name}, changes)


@template("cross_move_invite", 4, 'Move "{title}" to {date} at {start} and invite {name}.', _s_move_invite)
def _p_move_invite(a: Mapping[str, Any]) -> Plan:
    e = yield from find_event(a["title"])
    yield call("calendar_move", id=e["id"], date=a["date"], start=a["start"])
    c = yield from find_contact(a["name"])
    yield call("calendar_invite", id=e["id"], email=c["email"])
    return "done"


def _s_cancel_delete(w: World, rng: random.Random) -> Instance:
    e, m = rng.choice(events(w)), rng.choice(chat_emails(w))
    return Instance({"title": e.title, "subject": m.subject}, (cancelled(e), trashed(m)))


@template("cross_cancel_delete", 4, 'Cancel "{title}" and delete the email "{subject}".', _s_cancel_delete)
def _p_cancel_delete(a: Mapping[str, Any]) -> Plan:
    e = yield from find_event(a["title"])
    yield call("calendar_cancel", id=e["id"])
    eid = yield from find_email(a["subject"])
    yield call("email_delete", id=eid)
    return "done"


def _s_welcome(w: World, rng: random.Random) -> Instance:
    c = contacts(w, rng, 1)[0]
    city = rng.choice([x for x in ("Lisbon", "Toronto", "Osaka", "Dublin", "Oslo") if x != c.city])
    subject = rng.choice(SUBJECTS)
    changes = (
        update("contacts", c.id, f"{c.name}'s city is {city}", city=city),
        sent(c, subject, f"welcome email sent to {c.name}", f"Welcome to {city}"),
    )
    return Instance({"name": c.name, "city": city, "subject": subject}, changes)


@template(
    "cross_city_welcome",
    3,
    "{name} moved to {city}. Update their contact, "
    'then email them "Welcome to {city}!" with the subject "{subject}".',
    _s_welcome,
)
def _p_welcome(a: Mapping[str, Any]) -> Plan:
    c = yield from find_contact(a["name"])
    yield call("contacts_update", id=c["id"], city=a["city"])
    yield call("email_send", to=c["email"], subject=a["subject"], body=f"Welcome to {a['city']}!")
    return "done"


def _s_email_attendees(w: World, rng: random.Random) -> Instance:
    e, subject, body = rng.choice(events(w, (2,))), rng.choice(SUBJECTS), rng.choice(MESSAGES)
    changes = tuple(sent(a, subject, f'"{subject}" sent to {a}', body) for a in e.attendees)
    return Instance({"title": e.title, "subject": subject, "body": body}, changes)


@template(
    "cross_email_attendees",
    4,
    'Email everyone invited to "{title}" (one email each) '
    'with the subject "{subject}" and the message "{body}"',
    _s_email_attendees,
)
def _p_email_attendees(a: Mapping[str, Any]) -> Plan:
    full = yield from event_details(a["title"])
    for address in full["attendees"]:
        yield call("email_send", to=address, subject=a["subject"], body=a["body"])
    return "done"
