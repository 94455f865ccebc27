"""The apps' API: contacts, email and calendar functions over one episode's database.

`Apps` holds the functions; `FUNCTIONS` describes each one (app, signature, JSON schema,
whether it changes state). Every function validates its arguments itself and raises
`ToolError` (a short message the model sees) for anything wrong, so no model input can reach
SQLite as an error: a `sqlite3` exception here is an env bug and propagates as infrastructure.

`Apps.call(name, arguments)` is the one entry point every executor uses: `ToolEnv` calls it for
JSON function calls, and the python executor (`code_actions.py`: snippets run in
`steprl.envs.sandbox`) forwards each API call a snippet makes to it over the sandbox session's
RPC channel. Results are compact JSON.

Modules: `base` (the `Function` record, argument checks, the episode `Store`), one per app
(`contacts`, `email`, `calendar`); this one joins them and adds ``api_docs``.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Mapping
from typing import Any

from steprl.envs.base import ToolError
from steprl.envs.library.apps.api import calendar, contacts, email
from steprl.envs.library.apps.api.base import Function, Store, define, text_arg
from steprl.envs.tool_env import check_arguments

APPS = ("contacts", "email", "calendar")

FUNCTIONS: tuple[Function, ...] = (
    define("api_docs", "app", "list an app's functions (app: contacts, email or calendar)", "app:string"),
    *contacts.FUNCTIONS,
    *email.FUNCTIONS,
    *calendar.FUNCTIONS,
)
BY_NAME: Mapping[str, Function] = {f.name: f for f in FUNCTIONS}
MUTATING = frozenset(f.name for f in FUNCTIONS if f.mutates)


def api_docs_text(app: str) -> str:
    """The function list of `app`, one `signature: summary` per line."""
    return "\n".join(f.doc for f in FUNCTIONS if f.app == app)


class Apps:
    """The API functions over the attached episode database (`attach` at every reset)."""

    def __init__(self) -> None:
        self.store = Store()
        apps: dict[str, Any] = {
            "api": self,
            "contacts": contacts.Contacts(self.store),
            "email": email.Email(self.store),
            "calendar": calendar.Calendar(self.store),
        }
        self._methods: dict[str, Callable[..., Any]] = {
            f.name: getattr(apps[f.app], f.name) for f in FUNCTIONS
        }

    def attach(self, conn: sqlite3.Connection | None) -> None:
        """Point every app at `conn` (the episode's SQLite connection), or at nothing (None)."""
        self.store.attach(conn)

    def call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """Run API function `name` with keyword `arguments`; its result as compact JSON."""
        function = BY_NAME.get(name)
        if function is None:
            raise ToolError(f"unknown function '{str(name)[:32]}'")
        error = check_arguments(arguments, function.parameters)
        if error is not None:
            raise ToolError(error)
        result = self._methods[name](**arguments)
        return result if isinstance(result, str) else json.dumps(result, separators=(",", ":"))

    def api_docs(self, app: str) -> str:
        name = text_arg(app, "app").lower()
        if name not in APPS:
            raise ToolError(f"unknown app; apps: {', '.join(APPS)}")
        return api_docs_text(name)
