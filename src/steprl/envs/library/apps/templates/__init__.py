"""All task templates, by name (sorted, so the order never depends on import order)."""

from steprl.envs.library.apps.templates import calendar, contacts, cross, email  # noqa: F401 (registers)
from steprl.envs.library.apps.templates.base import REGISTRY, Call, Instance, Plan, Template

TEMPLATES: dict[str, Template] = dict(sorted(REGISTRY.items()))

__all__ = ["TEMPLATES", "Call", "Instance", "Plan", "Template"]
