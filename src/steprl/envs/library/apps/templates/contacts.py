"""Contacts templates: updates, deletions, additions and questions (2 to 4 calls each)."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Mapping
from typing import Any

from steprl.envs.library.apps.checks import delete, insert, update
from steprl.envs.library.apps.templates.base import (
    REGISTRY,
    Instance,
    Plan,
    Template,
    call,
    contacts,
    new_address,
    new_person,
    new_phone,
    other_city,
    other_company,
    pick,
    template,
)
from steprl.envs.library.apps.world import Contact, World

_PHONE = re.compile(r"555-\d{3}-\d{4}")
_ADDRESS = re.compile(r"[\w.]+@[\w.]+\.example")


def _find(name: str) -> Plan:
    """Search a contact by full name; the result row (a sub-plan: use `yield from`)."""
    found = yield call("contacts_search", query=name)
    return pick(found, "name", name)["id"]


# --- one field of one contact ---------------------------------------------------------------------

_FIELDS: tuple[tuple[str, str, str, Callable[[World, random.Random, Contact], str]], ...] = (
    ("phone", "Update {name}'s phone number to {value}.", "phone", lambda w, r, c: new_phone(w, r)),
    ("email", "{name} has a new email address, {value}. Update the contact.", "email",
     lambda w, r, c: new_address(c, r)),
    ("company", "{name} now works at {value}. Update their contact.", "company",
     lambda w, r, c: other_company(c, r)),
    ("city", "{name} moved to {value}. Update their city.", "city", lambda w, r, c: other_city(c, r)),
)  # fmt: skip


def _field_template(
    column: str, text: str, word: str, value: Callable[[World, random.Random, Contact], str]
) -> None:
    def sample(w: World, rng: random.Random) -> Instance:
        c = contacts(w, rng, 1)[0]
        v = value(w, rng, c)
        return Instance(
            {"name": c.name, "value": v},
            (update("contacts", c.id, f"{c.name}'s {word} is {v}", **{column: v}),),
        )

    def plan(a: Mapping[str, Any]) -> Plan:
        cid = yield from _find(a["name"])
        yield call("contacts_update", id=cid, **{column: a["value"]})
        return "done"

    REGISTRY[f"contact_update_{column}"] = Template(f"contact_update_{column}", 2, text, sample, plan)


for _column, _text, _word, _value in _FIELDS:
    _field_template(_column, _text, _word, _value)


def _s_phone_city(w: World, rng: random.Random) -> Instance:
    c = contacts(w, rng, 1)[0]
    phone, city = new_phone(w, rng), other_city(c, rng)
    change = update("contacts", c.id, f"{c.name} has phone {phone} and city {city}", phone=phone, city=city)
    return Instance({"name": c.name, "phone": phone, "city": city}, (change,))


@template(
    "contact_update_phone_city",
    2,
    "{name} moved to {city} and has a new phone number, {phone}. Update the contact.",
    _s_phone_city,
)
def _p_phone_city(a: Mapping[str, Any]) -> Plan:
    cid = yield from _find(a["name"])
    yield call("contacts_update", id=cid, phone=a["phone"], city=a["city"])
    return "done"


def _s_delete(w: World, rng: random.Random) -> Instance:
    c = contacts(w, rng, 1)[0]
    return Instance({"name": c.name}, (delete("contacts", c.id, f"{c.name} deleted"),))


@template("contact_delete", 2, "Delete {name} from my contacts.", _s_delete)
def _p_delete(a: Mapping[str, Any]) -> Plan:
    cid = yield from _find(a["name"])
    yield call("contacts_delete", id=cid)
    return "done"


def _s_delete_two(w: World, rng: random.Random) -> Instance:
    c1, c2 = contacts(w, rng, 2)
    changes = (
        delete("contacts", c1.id, f"{c1.name} deleted"),
        delete("contacts", c2.id, f"{c2.name} deleted"),
    )
    return Instance({"name1": c1.name, "name2": c2.name}, changes)


@template("contact_delete_two", 4, "Remove {name1} and {name2} from my contacts.", _s_delete_two)
def _p_delete_two(a: Mapping[str, Any]) -> Plan:
    for key in ("name1", "name2"):
        cid = yield from _find(a[key])
        yield call("contacts_delete", id=cid)
    return "done"


def _s_swap(w: World, rng: random.Random) -> Instance:
    c1, c2 = contacts(w, rng, 2)
    changes = (
        update("contacts", c1.id, f"{c1.name}'s phone is {c2.phone}", phone=c2.phone),
        update("contacts", c2.id, f"{c2.name}'s phone is {c1.phone}", phone=c1.phone),
    )
    return Instance({"name1": c1.name, "name2": c2.name}, changes)


@template(
    "contact_swap_phones", 4, "{name1} and {name2} swapped phone numbers. Update both contacts.", _s_swap
)
def _p_swap(a: Mapping[str, Any]) -> Plan:
    first = pick((yield call("contacts_search", query=a["name1"])), "name", a["name1"])
    second = pick((yield call("contacts_search", query=a["name2"])), "name", a["name2"])
    yield call("contacts_update", id=first["id"], phone=second["phone"])
    yield call("contacts_update", id=second["id"], phone=first["phone"])
    return "done"


def _copy_template(column: str, text: str) -> None:
    def sample(w: World, rng: random.Random) -> Instance | None:
        c1, c2 = contacts(w, rng, 2)
        value = getattr(c2, column)
        if getattr(c1, column) == value:
            return None
        change = update("contacts", c1.id, f"{c1.name}'s {column} is {value}", **{column: value})
        return Instance({"name1": c1.name, "name2": c2.name}, (change,))

    def plan(a: Mapping[str, Any]) -> Plan:
        source = yield from _find(a["name2"])
        full = yield call("contacts_get", id=source)
        target = yield from _find(a["name1"])
        yield call("contacts_update", id=target, **{column: full[column]})
        return "done"

    REGISTRY[f"contact_same_{column}"] = Template(f"contact_same_{column}", 4, text, sample, plan)


_copy_template("company", "{name1} now works at the same company as {name2}. Update {name1}'s contact.")
_copy_template("city", "{name1} moved to the same city as {name2}. Update {name1}'s contact.")


def _s_coworker(w: World, rng: random.Random) -> Instance:
    c = contacts(w, rng, 1)[0]
    first, last, address = new_person(w, rng)
    change = insert(
        "contacts",
        f"contact {first} {last} at {c.company} added",
        first_name=first,
        last_name=last,
        email=address,
        company=c.company,
    )
    return Instance({"first": first, "last": last, "email": address, "name": c.name}, (change,))


@template(
    "contact_add_coworker",
    3,
    "Add {first} {last} ({email}) to my contacts. They work at the same company as {name}.",
    _s_coworker,
)
def _p_coworker(a: Mapping[str, Any]) -> Plan:
    cid = yield from _find(a["name"])
    full = yield call("contacts_get", id=cid)
    yield call(
        "contacts_add", first_name=a["first"], last_name=a["last"], email=a["email"], company=full["company"]
    )
    return "done"


def _question_template(column: str, text: str) -> None:
    def sample(w: World, rng: random.Random) -> Instance:
        c = contacts(w, rng, 1)[0]
        return Instance({"name": c.name}, (), str(getattr(c, column)))

    def plan(a: Mapping[str, Any]) -> Plan:
        cid = yield from _find(a["name"])
        full = yield call("contacts_get", id=cid)
        return str(full[column])

    REGISTRY[f"ask_contact_{column}"] = Template(f"ask_contact_{column}", 2, text, sample, plan)


_question_template("birthday", "When is {name}'s birthday? Answer with the date as YYYY-MM-DD.")
_question_template("company", "Which company does {name} work for?")
_question_template("city", "In which city does {name} live?")


def _from_email_template(kind: str, column: str, text: str, pattern: re.Pattern[str]) -> None:
    def sample(w: World, rng: random.Random) -> Instance | None:
        found = [e for e in w.emails if e.kind == kind]
        if not found:
            return None
        email = rng.choice(found)
        c = w.contact_by_email(email.sender)
        value = dict(w.new_values)[email.id]
        if c is None:
            return None
        change = update("contacts", c.id, f"{c.name}'s {column} is {value}", **{column: value})
        return Instance({"name": c.name, "subject": email.subject}, (change,))

    def plan(a: Mapping[str, Any]) -> Plan:
        listed = yield call("email_list", query=a["subject"])
        message = yield call("email_read", id=pick(listed, "subject", a["subject"])["id"])
        match = pattern.search(message["body"])
        if match is None:
            raise LookupError(f"no new {column} in {message['body']!r}")
        cid = yield from _find(a["name"])
        yield call("contacts_update", id=cid, **{column: match.group(0)})
        return "done"

    name = f"contact_{column}_from_email"
    REGISTRY[name] = Template(name, 4, text, sample, plan)


_from_email_template(
    "new_phone",
    "phone",
    '{name} sent me their new phone number in the email "{subject}". Update the contact.',
    _PHONE,
)
_from_email_template(
    "new_email",
    "email",
    '{name} told me their new email address in the email "{subject}". Update the contact.',
    _ADDRESS,
)
