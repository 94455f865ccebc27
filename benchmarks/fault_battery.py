"""The fault-injection battery (issue 44): probes that drive the real `steprl` command, or a server
it starts, with kills, a full disk, corrupt files, bad configs, sandbox escapes, HTTP attacks,
blocking and spinning envs, hostile report text, gateway abuse and synthesis abuse, and classify
each outcome as one of

    holds | ran code outside the sandbox | hung past its deadline | exhausted memory |
    deleted a finished run | traceback | other defect (what was seen)

    python benchmarks/fault_battery.py                 # every probe, one at a time
    python benchmarks/fault_battery.py --only synth --only http --json out.json
    python benchmarks/fault_battery.py --list

Every probe runs in a fresh temp directory (removed after it unless --keep), on loopback only,
one at a time, each command under a deadline and a memory cap (`fault_battery/common.py`). A
payload that escapes touches a marker file on the host; a finished run is compared file by file
before and after. The probes live in benchmarks/fault_battery/, one module per surface;
docs/security.md says what each covers and holds the last results.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fault_battery.common import ROOT, Ctx, Outcome, Probe, Result, Verdict, probe_dir

#: the surfaces, in the order they run; each is the module fault_battery/<name>.py and its PROBES
SURFACES = ("kills", "disk", "files", "configs", "sandbox", "http", "gateway", "envs", "report", "synth")


def probes_of(surface: str) -> list[Probe]:
    return list(importlib.import_module(f"fault_battery.{surface}").PROBES)


def run_probe(probe: Probe, shared: dict[str, Any], keep: bool) -> Result:
    started = time.monotonic()
    with probe_dir(keep) as tmp:
        ctx = Ctx(tmp, shared=shared, src=shared.get("src"))
        try:
            verdict = probe.run(ctx)
        except Exception as exc:  # the battery's own failure: shown as such, never as "holds"
            verdict = Verdict(Outcome.OTHER, f"the probe itself failed: {type(exc).__name__}: {exc}")
        finally:
            ctx.close()
        if keep:
            verdict = Verdict(verdict.outcome, f"{verdict.detail} [{tmp}]")
    took = time.monotonic() - started
    return Result(
        probe.surface, probe.name, probe.item, verdict.outcome.value, verdict.detail, took, ctx.peak_mb
    )


def print_row(r: Result) -> None:
    head = f"{r.surface:<8} {r.name[:46]:<46} {r.outcome:<28}"
    print(f"{head} {r.seconds:6.1f} {r.peak_mb:7.0f}  {r.detail[:160]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only", action="append", choices=sorted(SURFACES), help="Only this surface (repeatable)."
    )
    parser.add_argument("--probe", action="append", default=[], help="Only probes whose name contains this.")
    parser.add_argument("--list", action="store_true", help="List the probes and exit.")
    parser.add_argument("--json", type=Path, help="Write the results (and the commit) here as JSON.")
    parser.add_argument(
        "--src",
        type=Path,
        help="Run steprl from this src/ directory instead of the installed tree (an older commit: "
        "git archive COMMIT src | tar -x -C DIR, then --src DIR/src).",
    )
    parser.add_argument(
        "--keep", action="store_true", help="Keep each probe's temp directory (its path is shown)."
    )
    args = parser.parse_args()
    chosen = [p for s in (args.only or SURFACES) for p in probes_of(s)]
    chosen = [p for p in chosen if not args.probe or any(k in p.name for k in args.probe)]
    if args.list:
        for p in chosen:
            print(f"{p.surface:<8} {p.name:<50} item {p.item or '-'}")
        print(f"{len(chosen)} probes")
        return
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    where = f"the sources in {args.src}" if args.src else f"{commit} (and the working tree's edits)"
    print(f"fault battery on {where}: {len(chosen)} probes", flush=True)
    print(f"{'surface':<8} {'probe':<46} {'outcome':<28} {'seconds':>6} {'peak MB':>7}  detail")
    results: list[Result] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="steprl-fault-shared-") as shared_dir:
        shared: dict[str, Any] = {"root": Path(shared_dir), "closers": [], "src": args.src}
        try:
            for probe in chosen:
                results.append(run_probe(probe, shared, args.keep))
                print_row(results[-1])
        finally:
            for close in shared["closers"]:
                close()
    took = time.monotonic() - started
    counts = Counter(r.outcome for r in results)
    print(
        f"\n{len(results)} probes in {took:.0f} s: "
        + ", ".join(f"{counts[o.value]} {o.value}" for o in Outcome)
    )
    per_surface = Counter((r.surface, r.outcome == Outcome.HOLDS.value) for r in results)
    for s in dict.fromkeys(r.surface for r in results):
        print(f"  {s:<8} {per_surface[(s, True)]} hold, {per_surface[(s, False)]} defects")
    if args.json:
        record = {
            "commit": commit,
            "src": str(args.src or ""),
            "seconds": took,
            "results": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(record, indent=1))
    sys.exit(0)


if __name__ == "__main__":
    main()
