"""Hostile report text (issue 44 items 9, 10): episodes whose observations are 1 MiB each, or
carry bidi overrides and a `</script>` that would end the page's data block, then the run's
report.html; and `steprl report -o` into a folder that is not there."""

from __future__ import annotations

from .common import HERE, MIB, Ctx, Probe, Verdict, defect, holds, judge
from .runs import NAME, finished_run

PLUGIN = ("--plugin", "hostile_envs")
#: 2 steps x 2 tasks x 2 episodes + 2 x 2 evaluations: 16 saved episodes of 1 MiB each
REPORT_CAP_MIB = 8
BIDI = ("\u202a", "\u202b", "\u202c", "\u202d", "\u202e", "\u2066", "\u2067", "\u2068", "\u2069")


def _report_of(ctx: Ctx, kind: str) -> tuple[Verdict | None, bytes]:
    sets = ["env.name=text_env", f"env.params={{kind: {kind}}}", "rollout.max_tokens_per_turn=4"]
    run = ctx.train(sets, deadline=300, plugin_path=[HERE / "plugins"], extra_args=PLUGIN, mem_cap_mb=4096)
    page = ctx.tmp / "runs" / NAME / "report.html"
    if run.rc != 0 or not page.is_file():
        return judge(run, (0,), why="no report.html: "), b""
    return None, page.read_bytes()


def huge_observations(ctx: Ctx) -> Verdict:
    failed, page = _report_of(ctx, "huge")
    if failed:
        return failed
    size = len(page) / MIB
    if size > REPORT_CAP_MIB:
        return defect(f"report.html is {size:.0f} MiB for 16 episodes of 1 MiB observations")
    return holds(f"report.html {size:.1f} MiB")


def bidi_and_script(ctx: Ctx) -> Verdict:
    failed, page = _report_of(ctx, "bidi")
    if failed:
        return failed
    text = page.decode("utf-8", errors="replace")
    raw = sum(text.count(c) for c in BIDI)
    injected = text.count("<script>document.title")
    if injected:
        return defect(f"the episode's </script><script> reached the page raw ({injected} times)")
    if raw:
        return defect(
            f"{raw} raw bidi controls in report.html (an override reorders the page's text after it)"
        )
    return holds("no raw bidi control or script in report.html")


def report_into_missing_folder(ctx: Ctx) -> Verdict:
    run_dir = finished_run(ctx)
    out = ctx.tmp / "no" / "such" / "folder" / "r.html"
    return judge(ctx.steprl(["report", str(run_dir), "-o", str(out)], deadline=120), (0, 2))


PROBES = [
    Probe("report", "1 MiB observations in report.html", "9", huge_observations),
    Probe("report", "bidi overrides and </script> in episodes", "9", bidi_and_script),
    Probe("report", "report -o into a missing folder", "10", report_into_missing_folder),
]
