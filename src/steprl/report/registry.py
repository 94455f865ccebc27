"""The report's sections, in page order: one visible dict. A feature adds its section as one new
module (a function `RunData -> JSON-able data`) plus one entry here; `check_section` (run by the
tests over every entry) proves it builds from an empty run without raising and that its data is
JSON. A section draws with a renderer the page's script defines (`RENDERERS`), or with its own:
`script` is JavaScript that sets `RENDERERS["<name>"] = (el, data, page) => {...}`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from steprl.registry import Registry, instance_of
from steprl.report import admission, config_section, curves, episodes, health, learning_diff, steering
from steprl.report.budget import size
from steprl.report.run_data import RunData, empty_run

#: the renderers the page's own script defines (report/script.py)
RENDERERS = ("config", "curves", "episodes", "learning_diff", "table")


@dataclass(frozen=True)
class SectionSpec:
    title: str
    build: Callable[[RunData], Any]  # the section's data: JSON-able (dicts, lists, str, finite numbers)
    renderer: str  # a name in RENDERERS, or the one `script` defines
    script: str = ""  # JavaScript defining `renderer`, for a section that brings its own


SECTIONS: Registry[SectionSpec] = Registry(
    {
        "config": SectionSpec("Config", config_section.build, "config"),
        "curves": SectionSpec("Curves", curves.build, "curves"),
        "learning_diff": SectionSpec("Learning diff", learning_diff.build, "learning_diff"),
        "episodes": SectionSpec("Episodes", episodes.build, "episodes"),
        "alarms": SectionSpec("Alarms and interventions", health.build, health.RENDERER, health.SCRIPT),
        "curriculum": SectionSpec("Curriculum stages", steering.curriculum, "table"),
        "env_weights": SectionSpec("Per-env weights", steering.env_weights, "table"),
        "admission": SectionSpec("Task admission", admission.build, "table"),
        "admission_shapes": SectionSpec("Task admission by shape", admission.by_shape, "table"),
    },
    key="report section",
    what="section",
    accept=instance_of(SectionSpec),
    expected="a SectionSpec (report/registry.py)",
    checker="steprl.report.registry:check_section",
)


def section_data(name: str, spec: SectionSpec, run: RunData) -> Any:
    """`spec.build(run)`, checked to be JSON (NaN and infinities are not), errors naming the section."""
    return sized_section_data(name, spec, run)[0]


def sized_section_data(name: str, spec: SectionSpec, run: RunData) -> tuple[Any, int]:
    """`section_data`, and the bytes it adds to the page (measured in the one JSON encoding that
    also checks it)."""
    data = spec.build(run)
    try:
        return data, size(data)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"report section {name!r} returned data that is not JSON ({exc}); return dicts, lists, "
            "strings and finite numbers"
        ) from exc


def check_section(name: str, spec: SectionSpec | None = None, run: RunData | None = None) -> None:
    """Raise unless `spec` (default: the entry `name`) builds JSON from `run` (default: an empty
    run) and names a renderer the page has."""
    spec = spec if spec is not None else SECTIONS.lookup(name)
    if spec.renderer not in RENDERERS and f'RENDERERS["{spec.renderer}"]' not in spec.script:
        raise ValueError(
            f"report section {name!r}: renderer {spec.renderer!r} is not one of {RENDERERS}; "
            f'define it in the spec\'s script as RENDERERS["{spec.renderer}"] = (el, data, page) => ...'
        )
    section_data(name, spec, run if run is not None else empty_run())
