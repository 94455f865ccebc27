"""Build a report: every section's data (registry.py) into one JSON blob, inlined with the page's
CSS and script into one HTML file that opens offline (no server, no network, nothing fetched).

A section that fails (a damaged file the checker never saw) shows its error on the page instead
of its content; the rest of the report is still written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from steprl.report import page, script
from steprl.report.registry import SECTIONS, SectionSpec, section_data
from steprl.report.run_data import Caps, RunData, load_run, run_label


@dataclass(frozen=True)
class Written:
    path: Path
    bytes: int
    episodes: int  # shown in the trajectory browser


def report_data(run: RunData, sections: Mapping[str, SectionSpec] = SECTIONS) -> dict[str, Any]:
    """The page's data: run labels, notes, each section's {name, title, renderer, data or error},
    and the token table (`tokens`: {id: text} of every id an episode uses)."""
    built = []
    for name, spec in sections.items():
        entry: dict[str, Any] = {"name": name, "title": spec.title, "renderer": spec.renderer}
        try:
            entry["data"] = section_data(name, spec, run)
        except Exception as exc:  # one broken section must not cost the whole report
            entry["error"] = f"{type(exc).__name__}: {exc}"
        built.append(entry)
    return {
        "title": run.label if not run.vs else f"{run.label} vs " + ", ".join(r.label for r in run.vs),
        "runs": [{"label": r.label, "path": str(r.path)} for r in (run, *run.vs)],
        "notes": [*run.notes, *(n for r in run.vs for n in r.notes)],
        "sections": built,
        "tokens": run.tokens.table(),
    }


def render(data: Mapping[str, Any], sections: Mapping[str, SectionSpec] = SECTIONS) -> str:
    """The HTML file's text. The JSON goes inside a <script> element, so every "<" is escaped
    (a token "</script>" would otherwise end it early)."""
    blob = json.dumps(data, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    blob = blob.replace("<", "\\u003c").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    extra = [spec.script for spec in sections.values() if spec.script]
    return page.html(str(data.get("title", "run")), blob, "\n".join([script.SCRIPT, *extra]))


def _distinct(others: Sequence[RunData], main_dir: str | Path) -> list[RunData]:
    """The compared runs, each labelled apart from the main run and the others (two runs of one
    config share a name): a repeated label gets its directory's parent, then a number."""
    main = run_label(Path(main_dir))
    taken = {main}
    out = []
    for k, r in enumerate(others, start=2):
        label = r.label
        if label in taken:
            label = f"{r.label} ({r.path.parent.name})"
        if label in taken:
            label = f"{r.label} #{k}"
        taken.add(label)
        out.append(replace(r, label=label))
    return out


def write_report(
    run_dir: str | Path,
    out: str | Path | None = None,
    *,
    vs: Sequence[str | Path] = (),
    decode: Callable[[list[int]], str] | None = None,
    caps: Caps = Caps(),
) -> Written:
    """Write the report of `run_dir` (compared with the runs `vs`) to `out` (default
    `<run_dir>/report.html`), atomically: a reader sees the old file or the new one."""
    others = [load_run(v, caps=caps, episodes=False) for v in vs]  # compared: config and curves
    run = load_run(run_dir, decode=decode, caps=caps, vs=_distinct(others, run_dir))
    data = report_data(run)
    text = render(data)
    target = Path(out) if out is not None else run.path / "report.html"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, target)
    shown: dict[str, Any] = next(
        (s["data"] for s in data["sections"] if s["name"] == "episodes" and "data" in s), {}
    )
    return Written(target, len(text.encode("utf-8")), len(shown.get("episodes", [])))
