"""Email templates: send, reply, forward, delete, and questions about the inbox (2 to 4 calls)."""

from __future__ import annotations

import random
import re
from collections.abc import Generator, Mapping
from typing import Any

from steprl.envs.library.apps.checks import Change, insert, update
from steprl.envs.library.apps.templates.base import (
    MESSAGES,
    REGISTRY,
    SUBJECTS,
    Call,
    Instance,
    Plan,
    Template,
    call,
    chat_emails,
    contacts,
    pick,
    reply_subject,
    senders,
    template,
)
from steprl.envs.library.apps.world import Contact, Email, World

_CODE = re.compile(r"\b\d{6}\b")


def find_contact(name: str) -> Generator[Call, Any, Mapping[str, Any]]:
    """Search a contact by full name; its search row {id, name, email, phone} (`yield from`)."""
    found = yield call("contacts_search", query=name)
    return pick(found, "name", name)


def find_email(subject: str) -> Generator[Call, Any, int]:
    """The id of the inbox email with this subject (`yield from`)."""
    found = yield call("email_list", query=subject)
    return int(pick(found, "subject", subject)["id"])


def latest_from(address: str) -> Generator[Call, Any, Mapping[str, Any]]:
    """The newest inbox email from `address` (the list is newest first)."""
    found = yield call("email_list", query=address)
    return pick(found, "from", address)


def sent(c: Contact | str, subject: str, label: str, body: str | list[str] | None = None) -> Change:
    """An email to `c` with `subject` (and `body` substrings) exists in the sent folder."""
    to = c if isinstance(c, str) else c.email
    return insert(
        "emails", label, {"body": body} if body else None, folder="sent", recipient=to, subject=subject
    )


def trashed(e: Email) -> Change:
    return update("emails", e.id, f'email "{e.subject}" in the trash', folder="trash")


def _s_send(w: World, rng: random.Random) -> Instance:
    c = contacts(w, rng, 1)[0]
    subject, body = rng.choice(SUBJECTS), rng.choice(MESSAGES)
    change = sent(c, subject, f'email "{subject}" sent to {c.name}', body)
    return Instance({"name": c.name, "subject": subject, "body": body}, (change,))


@template("email_send", 2, 'Email {name} with the subject "{subject}" and the message "{body}"', _s_send)
def _p_send(a: Mapping[str, Any]) -> Plan:
    c = yield from find_contact(a["name"])
    yield call("email_send", to=c["email"], subject=a["subject"], body=a["body"])
    return "done"


def _s_send_two(w: World, rng: random.Random) -> Instance:
    c1, c2 = contacts(w, rng, 2)
    subject, body = rng.choice(SUBJECTS), rng.choice(MESSAGES)
    changes = tuple(sent(c, subject, f'email "{subject}" sent to {c.name}', body) for c in (c1, c2))
    return Instance({"name1": c1.name, "name2": c2.name, "subject": subject, "body": body}, changes)


@template(
    "email_send_two",
    4,
    'Send {name1} and {name2} the same email, one each: subject "{subject}", message "{body}"',
    _s_send_two,
)
def _p_send_two(a: Mapping[str, Any]) -> Plan:
    first = yield from find_contact(a["name1"])
    second = yield from find_contact(a["name2"])
    for c in (first, second):
        yield call("email_send", to=c["email"], subject=a["subject"], body=a["body"])
    return "done"


_SHARE = (  # (column, prompt, needs contacts_get)
    ("phone", 'Email {name2} the phone number of {name1}, with the subject "{subject}".', False),
    ("email", 'Send {name2} the email address of {name1}, with the subject "{subject}".', False),
    ("company", 'Tell {name2} by email which company {name1} works for (subject "{subject}").', True),
    ("birthday", 'Email {name2} the birthday of {name1} as YYYY-MM-DD (subject "{subject}").', True),
)


def _share_template(column: str, text: str, needs_get: bool) -> None:
    def sample(w: World, rng: random.Random) -> Instance:
        c1, c2 = contacts(w, rng, 2)
        subject, value = rng.choice(SUBJECTS), str(getattr(c1, column))
        change = sent(c2, subject, f"{c1.name}'s {column} emailed to {c2.name}", value)
        return Instance({"name1": c1.name, "name2": c2.name, "subject": subject}, (change,))

    def plan(a: Mapping[str, Any]) -> Plan:
        about = yield from find_contact(a["name1"])
        if needs_get:
            about = yield call("contacts_get", id=about["id"])
        to = yield from find_contact(a["name2"])
        body = f"{a['name1']}'s {column}: {about[column]}"
        yield call("email_send", to=to["email"], subject=a["subject"], body=body)
        return "done"

    name = f"email_share_{column}"
    REGISTRY[name] = Template(name, 4 if needs_get else 3, text, sample, plan)


for _column, _text, _get in _SHARE:
    _share_template(_column, _text, _get)


def _s_reply(w: World, rng: random.Random) -> Instance:
    e, body = rng.choice(chat_emails(w)), rng.choice(MESSAGES)
    change = sent(e.sender, reply_subject(e.subject), f'reply to "{e.subject}" sent', body)
    return Instance({"subject": e.subject, "body": body}, (change,))


@template("email_reply", 2, 'Reply to the email "{subject}" with: {body}', _s_reply)
def _p_reply(a: Mapping[str, Any]) -> Plan:
    eid = yield from find_email(a["subject"])
    yield call("email_reply", id=eid, body=a["body"])
    return "done"


def _s_reply_latest(w: World, rng: random.Random) -> Instance:
    c, body = rng.choice(senders(w)), rng.choice(MESSAGES)
    e = w.inbox_from(c.email)[0]
    change = sent(c, reply_subject(e.subject), f"reply to {c.name}'s latest email sent", body)
    return Instance({"name": c.name, "body": body}, (change,))


@template("email_reply_latest", 3, 'Reply "{body}" to the most recent email from {name}.', _s_reply_latest)
def _p_reply_latest(a: Mapping[str, Any]) -> Plan:
    c = yield from find_contact(a["name"])
    e = yield from latest_from(c["email"])
    yield call("email_reply", id=e["id"], body=a["body"])
    return "done"


def _s_forward(w: World, rng: random.Random) -> Instance | None:
    e, c = rng.choice(chat_emails(w)), contacts(w, rng, 1)[0]
    if c.email == e.sender:
        return None
    change = sent(c, f"Fwd: {e.subject}", f'"{e.subject}" forwarded to {c.name}')
    return Instance({"subject": e.subject, "name": c.name}, (change,))


@template("email_forward", 3, 'Forward the email "{subject}" to {name}.', _s_forward)
def _p_forward(a: Mapping[str, Any]) -> Plan:
    eid = yield from find_email(a["subject"])
    c = yield from find_contact(a["name"])
    yield call("email_forward", id=eid, to=c["email"])
    return "done"


def _s_forward_latest(w: World, rng: random.Random) -> Instance | None:
    c1, c2 = rng.choice(senders(w)), contacts(w, rng, 1)[0]
    if c1 == c2:
        return None
    e = w.inbox_from(c1.email)[0]
    change = sent(c2, f"Fwd: {e.subject}", f"{c1.name}'s latest email forwarded to {c2.name}")
    return Instance({"name1": c1.name, "name2": c2.name}, (change,))


@template("email_forward_latest", 4, "Forward the latest email from {name1} to {name2}.", _s_forward_latest)
def _p_forward_latest(a: Mapping[str, Any]) -> Plan:
    c1 = yield from find_contact(a["name1"])
    e = yield from latest_from(c1["email"])
    c2 = yield from find_contact(a["name2"])
    yield call("email_forward", id=e["id"], to=c2["email"])
    return "done"


def _s_delete(w: World, rng: random.Random) -> Instance:
    e = rng.choice(chat_emails(w))
    return Instance({"subject": e.subject}, (trashed(e),))


@template("email_delete", 2, 'Delete the email "{subject}".', _s_delete)
def _p_delete(a: Mapping[str, Any]) -> Plan:
    eid = yield from find_email(a["subject"])
    yield call("email_delete", id=eid)
    return "done"


def _s_delete_two(w: World, rng: random.Random) -> Instance:
    e1, e2 = rng.sample(chat_emails(w), 2)
    return Instance({"subject1": e1.subject, "subject2": e2.subject}, (trashed(e1), trashed(e2)))


@template("email_delete_two", 4, 'Delete the emails "{subject1}" and "{subject2}".', _s_delete_two)
def _p_delete_two(a: Mapping[str, Any]) -> Plan:
    for key in ("subject1", "subject2"):
        eid = yield from find_email(a[key])
        yield call("email_delete", id=eid)
    return "done"


def _s_delete_from(w: World, rng: random.Random) -> Instance:
    c = rng.choice(senders(w, (2,)))
    return Instance({"name": c.name}, tuple(trashed(e) for e in w.inbox_from(c.email)))


@template("email_delete_all_from", 4, "Delete the two emails {name} sent me.", _s_delete_from)
def _p_delete_from(a: Mapping[str, Any]) -> Plan:
    c = yield from find_contact(a["name"])
    found = yield call("email_list", query=c["email"])
    for e in [e for e in found if e["from"] == c["email"]]:
        yield call("email_delete", id=e["id"])
    return "done"


def _then_delete(w: World, inst: Instance | None) -> Instance | None:
    """`inst`, and then its inbox email (``args["subject"]``) deleted."""
    if inst is None:
        return None
    e = next(e for e in w.emails if e.folder == "inbox" and e.subject == inst.args["subject"])
    return Instance(inst.args, (*inst.changes, trashed(e)))


def _s_forward_delete(w: World, rng: random.Random) -> Instance | None:
    return _then_delete(w, _s_forward(w, rng))


@template(
    "email_forward_delete", 4, 'Forward the email "{subject}" to {name}, then delete it.', _s_forward_delete
)
def _p_forward_delete(a: Mapping[str, Any]) -> Plan:
    eid = yield from find_email(a["subject"])
    c = yield from find_contact(a["name"])
    yield call("email_forward", id=eid, to=c["email"])
    yield call("email_delete", id=eid)
    return "done"


def _s_reply_delete(w: World, rng: random.Random) -> Instance | None:
    return _then_delete(w, _s_reply(w, rng))


@template(
    "email_reply_delete", 3, 'Reply "{body}" to the email "{subject}", then delete it.', _s_reply_delete
)
def _p_reply_delete(a: Mapping[str, Any]) -> Plan:
    eid = yield from find_email(a["subject"])
    yield call("email_reply", id=eid, body=a["body"])
    yield call("email_delete", id=eid)
    return "done"


# --- questions ------------------------------------------------------------------------------------


def _s_count(w: World, rng: random.Random) -> Instance:
    c = rng.choice(senders(w))
    return Instance({"name": c.name}, (), str(len(w.inbox_from(c.email))))


@template(
    "ask_email_count", 2, "How many emails from {name} are in my inbox? Answer with a number.", _s_count
)
def _p_count(a: Mapping[str, Any]) -> Plan:
    c = yield from find_contact(a["name"])
    found = yield call("email_list", query=c["email"])
    return str(sum(e["from"] == c["email"] for e in found))


def _s_latest_subject(w: World, rng: random.Random) -> Instance:
    c = rng.choice(senders(w))
    return Instance({"name": c.name}, (), w.inbox_from(c.email)[0].subject)


@template(
    "ask_latest_subject", 2, "What is the subject of the most recent email from {name}?", _s_latest_subject
)
def _p_latest_subject(a: Mapping[str, Any]) -> Plan:
    c = yield from find_contact(a["name"])
    e = yield from latest_from(c["email"])
    return str(e["subject"])


def _s_code(w: World, rng: random.Random) -> Instance:
    eid, code = rng.choice(w.codes)
    service = next(e for e in w.emails if e.id == eid).subject.split()[1]
    return Instance({"service": service}, (), code)


@template("ask_code", 2, "What verification code did {service} send me? Answer with the digits.", _s_code)
def _p_code(a: Mapping[str, Any]) -> Plan:
    subject = f"Your {a['service']} verification code"
    eid = yield from find_email(subject)
    e = yield call("email_read", id=eid)
    match = _CODE.search(e["body"])
    if match is None:
        raise LookupError(f"no code in {e['body']!r}")
    return match.group(0)


def _s_sender(w: World, rng: random.Random) -> Instance | None:
    e = rng.choice(chat_emails(w))
    c = w.contact_by_email(e.sender)
    return None if c is None else Instance({"subject": e.subject}, (), c.name)


@template("ask_sender", 2, 'Who sent me the email "{subject}"? Answer with their full name.', _s_sender)
def _p_sender(a: Mapping[str, Any]) -> Plan:
    found = yield call("email_list", query=a["subject"])
    address = pick(found, "subject", a["subject"])["from"]
    people = yield call("contacts_search", query=address)
    return str(pick(people, "email", address)["name"])


def _s_sent_count(w: World, rng: random.Random) -> Instance:
    c = contacts(w, rng, 1)[0]
    n = sum(e.folder == "sent" and e.recipient == c.email for e in w.emails)
    return Instance({"name": c.name}, (), str(n))


@template("ask_sent_count", 2, "How many emails have I sent to {name}? Answer with a number.", _s_sent_count)
def _p_sent_count(a: Mapping[str, Any]) -> Plan:
    c = yield from find_contact(a["name"])
    found = yield call("email_list", folder="sent", query=c["email"])
    return str(sum(e["to"] == c["email"] for e in found))
