"""Seeded synthetic data for the apps: one `World` (contacts, emails, events) per data seed.

A world is a pure function of its seed (its own `random.Random`, no set iteration, no clock),
so the golden database built from it, and its state hash, are the same in every process and on
every machine (reliability ENV-09). All text is printable ASCII (the tiny model's vocabulary).

Uniqueness rules keep tasks unambiguous: full names, addresses, email subjects and event titles
are unique within a world, and no full name or address is a substring of another, so a search
by a full name or an address finds exactly one contact.
"""

from __future__ import annotations

import datetime as dt
import functools
import random
from dataclasses import dataclass

FIRST_NAMES = (
    "Alice", "Bruno", "Chloe", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Isabel", "Jonas",
    "Keiko", "Liam", "Maya", "Nikhil", "Olivia", "Pablo", "Quinn", "Rosa", "Samir", "Tara",
    "Umar", "Vera", "Wei", "Ximena", "Yusuf", "Zoe", "Amara", "Bjorn", "Carmen", "Diego",
    "Esther", "Felix", "Gita", "Hector", "Ingrid", "Jamal", "Kofi", "Lena", "Marco", "Nadia",
    "Oscar", "Priya", "Rafael", "Sofia", "Tomas", "Uma", "Victor", "Wanda", "Yara", "Zain",
    "Anders", "Bianca", "Cyrus", "Dalia", "Emeka", "Freya",
)  # fmt: skip
LAST_NAMES = (
    "Okafor", "Lindqvist", "Moreau", "Tanaka", "Castillo", "Haddad", "Novak", "Brennan", "Sato",
    "Fischer", "Mensah", "Kowalski", "Reyes", "Iyer", "Duarte", "Whitaker", "Petrov", "Nakamura",
    "Oduya", "Larsen", "Delgado", "Ferreira", "Kaur", "Abbott", "Vargas", "Holm", "Quintero",
    "Rahman", "Stein", "Yilmaz", "Bianchi", "Clarke", "Eze", "Gallagher", "Jensen", "Morales",
)  # fmt: skip
COMPANIES = (
    "Northwind Traders", "Bluepeak Labs", "Harbor Analytics", "Cedar Health", "Quill Media",
    "Ironbridge Capital", "Lumen Robotics", "Fernway Foods", "Solace Energy", "Tidewater Logistics",
    "Orchid Software", "Granite Legal",
)  # fmt: skip
CITIES = (
    "Lisbon", "Toronto", "Nairobi", "Osaka", "Denver", "Krakow", "Austin", "Melbourne", "Dublin",
    "Seoul", "Bogota", "Oslo", "Chennai", "Porto",
)  # fmt: skip
TOPICS = (
    "Budget", "Roadmap", "Hiring", "Marketing", "Design", "Security", "Onboarding", "Vendor",
    "Launch", "Research", "Pricing", "Compliance", "Analytics", "Support", "Partnership", "Infra",
)  # fmt: skip
ROOMS = ("Room 2A", "Room 3B", "Room 4C", "Main boardroom", "Video call", "Library room")
RESTAURANTS = ("Cafe Luna", "The Green Fork", "Noodle Bar", "Bistro 22", "Harvest Kitchen")
SERVICES = ("Skyfare", "Parcelly", "Bankwise", "Cloudvault", "Mealbox", "Ticketly")
NEWSLETTERS = (
    ("digest@cityweekly.example", "City Weekly: events this weekend"),
    ("news@runnersclub.example", "Runners Club: spring race calendar"),
    ("updates@bookhaven.example", "Book Haven: new arrivals"),
    ("hello@plantpost.example", "Plant Post: caring for ferns"),
)
SOLO_EVENTS = (
    ("Dentist appointment", "Smile Dental"),
    ("Gym session", "Fitlab"),
    ("Car service", "Autocare Garage"),
    ("Haircut", "Studio Nine"),
    ("Passport renewal", "City Hall"),
)

N_CONTACTS, N_STRANGERS = 26, 5
#: Today in every world; events lie after it, received emails before it.
TODAY = dt.date(2024, 5, 13)
NOW = "2024-05-13 08:00"  # timestamp of the emails the agent sends


@dataclass(frozen=True)
class Contact:
    id: int
    first_name: str
    last_name: str
    email: str
    phone: str
    company: str
    city: str
    birthday: str  # YYYY-MM-DD

    @property
    def name(self) -> str:
        return f"{self.first_name} {self.last_name}"


@dataclass(frozen=True)
class Email:
    id: int
    folder: str  # inbox | sent | trash
    sender: str
    recipient: str
    subject: str
    body: str
    date: str  # YYYY-MM-DD HH:MM
    kind: str = "chat"  # how it was generated (not stored): chat, code, new_phone, new_email, intro, news


@dataclass(frozen=True)
class Event:
    id: int
    title: str
    date: str
    start: str  # HH:MM
    end: str
    location: str
    attendees: tuple[str, ...]  # sorted addresses (the owner is implied)
    status: str = "confirmed"  # confirmed | cancelled


@dataclass(frozen=True)
class Person:
    """Someone who is not a contact (wrote an intro email), or the world's owner."""

    first_name: str
    last_name: str
    email: str

    @property
    def name(self) -> str:
        return f"{self.first_name} {self.last_name}"


@dataclass(frozen=True)
class World:
    """Everything in the golden database of one data seed, plus generation-time facts."""

    seed: int
    owner: Person
    contacts: tuple[Contact, ...]
    emails: tuple[Email, ...]
    events: tuple[Event, ...]
    strangers: tuple[Person, ...]
    codes: tuple[tuple[int, str], ...]  # (email id, verification code in its body)
    new_values: tuple[tuple[int, str], ...]  # (email id, new phone/address announced in its body)

    def contact(self, cid: int) -> Contact:
        return next(c for c in self.contacts if c.id == cid)

    def contact_by_email(self, address: str) -> Contact | None:
        return next((c for c in self.contacts if c.email == address), None)

    def inbox_from(self, address: str) -> list[Email]:
        """Inbox emails from `address`, newest first."""
        found = [e for e in self.emails if e.folder == "inbox" and e.sender == address]
        return sorted(found, key=lambda e: (e.date, e.id), reverse=True)

    def active_events(self) -> list[Event]:
        return [e for e in self.events if e.status == "confirmed"]


def _no_substrings(values: list[str]) -> bool:
    low = [v.lower() for v in values]
    return not any(a != b and a in b for a in low for b in low)


def _domain(company: str) -> str:
    return company.split()[0].lower() + ".example"


def _phone(rng: random.Random, used: set[str]) -> str:
    while True:
        phone = f"555-{rng.randint(200, 989)}-{rng.randint(1000, 9999)}"
        if phone not in used:
            used.add(phone)
            return phone


def _time(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


@functools.lru_cache(maxsize=64)
def build_world(seed: int) -> World:
    """The world of data seed `seed` (cached; a pure function of the seed)."""
    rng = random.Random(f"steprl-apps-world:{seed}")
    while True:  # distinct first names; no full name (hence no address) inside another
        chosen = [(f, rng.choice(LAST_NAMES)) for f in rng.sample(FIRST_NAMES, 1 + N_CONTACTS + N_STRANGERS)]
        if _no_substrings([f"{f} {last}" for f, last in chosen]):
            break
    owner_first, owner_last = chosen[0]
    owner = Person(owner_first, owner_last, f"{owner_first}.{owner_last}@mailbox.example".lower())
    phones: set[str] = set()
    contacts = []
    for i, (first, last) in enumerate(chosen[1 : 1 + N_CONTACTS], start=1):
        company = rng.choice(COMPANIES)
        birthday = dt.date(rng.randint(1962, 2001), rng.randint(1, 12), rng.randint(1, 28))
        contacts.append(
            Contact(
                id=i,
                first_name=first,
                last_name=last,
                email=f"{first}.{last}@{_domain(company)}".lower(),
                phone=_phone(rng, phones),
                company=company,
                city=rng.choice(CITIES),
                birthday=birthday.isoformat(),
            )
        )
    strangers = tuple(
        Person(f, last, f"{f}.{last}@{rng.choice(('fastmail', 'postbox', 'inbox'))}.example".lower())
        for f, last in chosen[1 + N_CONTACTS :]
    )
    emails, codes, new_values = _emails(rng, owner, contacts, strangers, phones)
    events = _events(rng, contacts)
    return World(seed, owner, tuple(contacts), emails, events, strangers, codes, new_values)


_CHAT_SUBJECTS = (
    "{t} notes", "Question about {t}", "{t} draft for review", "Re: {t} timeline", "{t} numbers",
    "Thoughts on {t}", "{t} follow-up", "Quick {t} check-in", "{t} slides", "Feedback on {t}",
)  # fmt: skip
_CHAT_BODIES = (
    "Hi {o}, sharing my notes on {t}. Let me know what you think. {s}",
    "Hello {o}, do you have ten minutes this week to go over {t}? Thanks, {s}",
    "Hi {o}, the latest {t} figures are in the shared folder. Best, {s}",
    "{o}, quick reminder about the {t} deadline on Friday. Cheers, {s}",
)


def _emails(
    rng: random.Random,
    owner: Person,
    contacts: list[Contact],
    strangers: tuple[Person, ...],
    phones: set[str],
) -> tuple[tuple[Email, ...], tuple[tuple[int, str], ...], tuple[tuple[int, str], ...]]:
    # Who writes how many chat emails: a fixed multiset, shuffled (some senders with exactly 2).
    counts = [1] * 9 + [2] * 6 + [3] * 3 + [0] * (len(contacts) - 18)
    rng.shuffle(counts)
    subjects: set[str] = set()

    def subject_for(patterns: tuple[str, ...]) -> tuple[str, str]:
        while True:
            topic = rng.choice(TOPICS)
            s = rng.choice(patterns).format(t=topic)
            if s not in subjects and _no_substrings([*subjects, s]):
                subjects.add(s)
                return s, topic.lower()

    items: list[tuple[str, str, str, str, str, str]] = []  # folder, sender, to, subject, body, kind
    for contact, n in zip(contacts, counts, strict=True):
        for _ in range(n):
            subject, topic = subject_for(_CHAT_SUBJECTS)
            body = rng.choice(_CHAT_BODIES).format(o=owner.first_name, t=topic, s=contact.first_name)
            items.append(("inbox", contact.email, owner.email, subject, body, "chat"))
    # Contacts announcing a new phone number or address (the new value is in the body).
    announcers = rng.sample(contacts, 4)
    new_phone_subjects = ["New phone number", "My number changed"]
    new_email_subjects = ["New email address", "Updated contact details"]
    for contact, subject in zip(announcers[:2], new_phone_subjects, strict=True):
        phone = _phone(rng, phones)
        body = f"Hi {owner.first_name}, my new phone number is {phone}. Best, {contact.first_name}"
        items.append(("inbox", contact.email, owner.email, subject, body, "new_phone:" + phone))
        subjects.add(subject)
    for contact, subject in zip(announcers[2:], new_email_subjects, strict=True):
        address = f"{contact.first_name}.{contact.last_name}@{rng.choice(SERVICES).lower()}mail.example"
        body = f"Hi {owner.first_name}, please use {address.lower()} from now on. {contact.first_name}"
        items.append(("inbox", contact.email, owner.email, subject, body, "new_email:" + address.lower()))
        subjects.add(subject)
    for service in rng.sample(SERVICES, 4):
        code = str(rng.randint(100000, 999999))
        subject = f"Your {service} verification code"
        body = f"Your {service} verification code is {code}. It expires in 10 minutes."
        items.append(
            ("inbox", f"no-reply@{service.lower()}.example", owner.email, subject, body, "code:" + code)
        )
    for person in strangers:
        subject = f"Introduction: {person.first_name} from {rng.choice(COMPANIES).split()[0]}"
        body = (
            f"Hi {owner.first_name}, I am {person.name}. A mutual friend suggested we talk. "
            f"Best, {person.first_name}"
        )
        items.append(("inbox", person.email, owner.email, subject, body, "intro"))
    for address, subject in NEWSLETTERS:
        items.append(("inbox", address, owner.email, subject, "This week's highlights inside.", "news"))
    for contact in rng.sample(contacts, 8):
        subject, topic = subject_for(("Re: {t} plan", "{t} agenda", "Sending the {t} file", "{t} recap"))
        body = f"Hi {contact.first_name}, see the attached {topic} file. {owner.first_name}"
        items.append(("sent", owner.email, contact.email, subject, body, "chat"))
    # Distinct daytime timestamps (so "the latest email" is always well defined), random order.
    start = dt.datetime(2024, 4, 1)
    daytime = [d * 24 * 60 + m for d in range(42) for m in range(7 * 60, 21 * 60, 7)]
    minutes = sorted(rng.sample(daytime, len(items)))
    rng.shuffle(items)
    emails, codes, new_values = [], [], []
    for i, ((folder, sender, to, subject, body, kind), m) in enumerate(zip(items, minutes, strict=True), 1):
        date = (start + dt.timedelta(minutes=m)).strftime("%Y-%m-%d %H:%M")
        kind_name, _, value = kind.partition(":")
        emails.append(Email(i, folder, sender, to, subject, body, date, kind_name))
        if kind_name == "code":
            codes.append((i, value))
        elif kind_name in ("new_phone", "new_email"):
            new_values.append((i, value))
    return tuple(emails), tuple(codes), tuple(new_values)


def _events(rng: random.Random, contacts: list[Contact]) -> tuple[Event, ...]:
    days = [TODAY + dt.timedelta(days=d) for d in range(26) if (TODAY + dt.timedelta(days=d)).weekday() < 5]
    per_day = [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3]
    rng.shuffle(per_day)
    chosen_days = sorted(rng.sample(days, len(per_day)))
    titles: set[str] = set()
    drafts: list[tuple[str, str, str, str, str, tuple[str, ...], str]] = []
    solo = list(SOLO_EVENTS)
    rng.shuffle(solo)
    for day, n in zip(chosen_days, per_day, strict=True):
        slots = sorted(rng.sample(range(8 * 60, 17 * 60, 60), n))
        for slot in slots:
            kind = rng.random()
            if kind < 0.15 and solo:
                title, location = solo.pop()
                people: list[Contact] = []
                length = 60
            elif kind < 0.55:
                person = rng.choice(contacts)
                label = rng.choice(("1:1 with", "Lunch with", "Coffee with", "Call with"))
                title = f"{label} {person.first_name}"
                location = {"1:1 with": rng.choice(ROOMS), "Call with": "Video call"}.get(
                    label, rng.choice(RESTAURANTS)
                )
                people = [person]
                length = rng.choice((30, 60))
            else:
                title = f"{rng.choice(TOPICS)} {rng.choice(('review', 'sync', 'workshop', 'kickoff'))}"
                location = rng.choice(ROOMS)
                people = rng.sample(contacts, rng.randint(2, 3))
                length = rng.choice((30, 60, 90))
            if title in titles or not _no_substrings([*titles, title]):
                continue
            titles.add(title)
            attendees = tuple(sorted(p.email for p in people))
            drafts.append(
                (title, day.isoformat(), _time(slot), _time(slot + length), location, attendees, "")
            )
    events = [Event(i, t, d, s, e, loc, a) for i, (t, d, s, e, loc, a, _) in enumerate(drafts, 1)]
    # Two cancelled events stay in the table (hidden by calendar_list): noise for the agent.
    for index in rng.sample(range(len(events)), 2):
        old = events[index]
        events[index] = Event(
            old.id, old.title, old.date, old.start, old.end, old.location, old.attendees, "cancelled"
        )
    return tuple(events)
