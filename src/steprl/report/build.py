"""Build a report: every section's data (registry.py) into one JSON blob, inlined with the page's
CSS and script into one HTML file that opens offline (no server, no network, nothing fetched).

A section that fails (a damaged file the checker never saw) shows its error on the page instead
of its content; the rest of the report is still written. So does a section whose data is over
its share of the page (`Caps`: the episodes and the learning diff cut theirs to fit; any other
section gets `Caps.section_bytes`, and all of them `Caps.other_bytes`): the page stays under
10 MB whatever the run holds, and whatever a plugin's section returns.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from steprl.diagnostics.sinks import open_output
from steprl.errors import UserError
from steprl.report import page, script
from steprl.report.budget import blob, clip, visible_bidi
from steprl.report.registry import SECTIONS, SectionSpec, sized_section_data
from steprl.report.run_data import Caps, RunData, load_run, run_label


@dataclass(frozen=True)
class Written:
    path: Path
    bytes: int
    episodes: int  # shown in the trajectory browser


class ReportWriteError(UserError):
    """The report's file cannot be written where it was asked for (`-o`)."""


#: the sections that cut their own data to a share of the page (by name), in bytes
_OWN_SHARE = {"episodes": lambda caps: caps.episode_bytes, "learning_diff": lambda caps: caps.diff_bytes}


def report_data(run: RunData, sections: Mapping[str, SectionSpec] = SECTIONS) -> dict[str, Any]:
    """The page's data: run labels, notes, each section's {name, title, renderer, data or error},
    and the token table (`tokens`: {id: text} of every id an episode uses)."""
    built = []
    others_left = run.caps.other_bytes
    for name, spec in sections.items():
        entry: dict[str, Any] = {"name": name, "title": spec.title, "renderer": spec.renderer}
        mark, table_bytes = run.tokens.mark(), run.tokens.bytes
        own = _OWN_SHARE.get(name)
        share = own(run.caps) if own else min(run.caps.section_bytes, others_left)
        try:
            data, data_bytes = sized_section_data(name, spec, run)
            cost = data_bytes + run.tokens.bytes - table_bytes
            if cost > share:
                raise ValueError(
                    f"its data is {cost / 1e6:.2f} MB, over its {share / 1e6:.2f} MB share of the page "
                    "(steprl.report.Caps)"
                )
            entry["data"] = data
            others_left -= 0 if own else cost
        except Exception as exc:  # one broken section must not cost the whole report
            run.tokens.rollback(mark)
            entry["error"] = clip(f"{type(exc).__name__}: {exc}", 1000)
        built.append(entry)
    notes = [*run.notes, *(n for r in run.vs for n in r.notes)]
    shown = [clip(n, 500) for n in notes[: run.caps.notes]]
    return {
        "title": clip(
            run.label if not run.vs else f"{run.label} vs " + ", ".join(r.label for r in run.vs), 500
        ),
        "runs": [{"label": clip(r.label, 200), "path": str(r.path)} for r in (run, *run.vs)],
        "notes": shown + ([f"{len(notes) - len(shown)} more notes"] if len(notes) > len(shown) else []),
        "sections": built,
        "tokens": run.tokens.table(),
    }


def render(data: Mapping[str, Any], sections: Mapping[str, SectionSpec] = SECTIONS) -> str:
    """The HTML file's text, the data escaped for its <script> element (`budget.blob`)."""
    extra = [spec.script for spec in sections.values() if spec.script]
    title = visible_bidi(str(data.get("title", "run")))
    return page.html(title, blob(data), "\n".join([script.SCRIPT, *extra]))


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
    _write(target, text)
    shown: dict[str, Any] = next(
        (s["data"] for s in data["sections"] if s["name"] == "episodes" and "data" in s), {}
    )
    return Written(target, len(text.encode("utf-8")), len(shown.get("episodes", [])))


def _write(target: Path, text: str) -> None:
    """`text` to `target` through a temporary file beside it, renamed over it when whole; a
    folder, a path under a file, a disk that refuses: one line (`ReportWriteError`), and the
    temporary file, if it was made, removed."""
    tmp = target.with_name(f".{target.name}.tmp")
    made = False
    try:
        if target.is_dir():
            raise IsADirectoryError(21, "it is a folder", str(target))
        target.parent.mkdir(parents=True, exist_ok=True)
        with open_output(tmp, "w") as f:  # never through a link planted in the run directory
            made = True
            f.write(text)
        os.replace(tmp, target)
    except OSError as exc:
        if made:
            tmp.unlink(missing_ok=True)
        reason = exc.strerror or type(exc).__name__
        where = f" ({exc.filename})" if exc.filename else ""  # a full disk names no file
        raise ReportWriteError(
            f"cannot write the report to {target}: {reason}{where}; "
            "give -o a file name in a folder you can write"
        ) from exc
