"""The run report: one self-contained HTML file (`<run_dir>/report.html`, or `steprl report RUN
[--vs RUN2 ...] [-o FILE]`) holding the config, the curves, a trajectory browser (tokens coloured
by advantage, masked tokens greyed) and the learning diff of a held-out task; no server, no
network. Sections are entries of `SECTIONS` (registry.py); `check_section` checks one."""

from steprl.report.build import Written, render, report_data, write_report
from steprl.report.registry import SECTIONS, SectionSpec, check_section
from steprl.report.run_data import Caps, RunData, empty_run, load_run

__all__ = [
    "SECTIONS",
    "Caps",
    "RunData",
    "SectionSpec",
    "Written",
    "check_section",
    "empty_run",
    "load_run",
    "render",
    "report_data",
    "write_report",
]
