"""Per-execution cost of the bubblewrap sandbox: `pass` in `Sandbox.run` against bare
`python3 -I -c pass` (the same interpreter), and a warm `SandboxSession` cell. A script that
prints numbers, not a timed test (SBX-19 is the test). Target: median overhead < 50 ms.

    .venv/bin/python benchmarks/sandbox_overhead.py [--runs 50]

Bare and sandboxed runs are interleaved so that background load hits both alike; the
"paired" line is the median of the per-pair differences, the most load-robust figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

from steprl.envs.sandbox import Sandbox, SandboxLimits, probe_capabilities


def _ms(xs: list[float], pct: int) -> float:
    """The `pct`-th percentile (nearest rank) of `xs` seconds, in ms."""
    ranked = sorted(xs)
    return ranked[min(len(ranked) - 1, max(0, round(pct / 100 * len(ranked)) - 1))] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    args = ap.parse_args()
    caps = probe_capabilities()
    if not caps.usable:
        raise SystemExit(f"the sandbox cannot run here: {caps.problems}")
    box = Sandbox(SandboxLimits(wall_s=10.0))
    bare_cmd = [caps.python, "-I", "-c", "pass"]
    for _ in range(3):  # warm up page cache and lazily created objects
        subprocess.run(bare_cmd, check=True)
        box.run("pass")
    bare, boxed, paired = [], [], []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        subprocess.run(bare_cmd, check=True)
        t1 = time.perf_counter()
        res = box.run("pass")
        t2 = time.perf_counter()
        assert res.ok, res
        bare.append(t1 - t0)
        boxed.append(t2 - t1)
        paired.append((t2 - t1) - (t1 - t0))
    cells = []
    with box.session() as session:
        session.run("pass")
        for _ in range(args.runs):
            t0 = time.perf_counter()
            assert session.run("pass").ok
            cells.append(time.perf_counter() - t0)

    load = os.getloadavg()[0]
    print(f"{args.runs} runs each; {os.cpu_count()} cores; 1-min load average {load:.2f}")
    print(f"{'':28s} {'median ms':>10s} {'p90 ms':>10s}")
    for name, xs in [
        ("bare python3 -I -c pass", bare),
        ("Sandbox.run('pass')", boxed),
        ("SandboxSession cell 'pass'", cells),
    ]:
        print(f"{name:28s} {statistics.median(xs) * 1000:10.1f} {_ms(xs, 90):10.1f}")
    overhead = (statistics.median(boxed) - statistics.median(bare)) * 1000
    print(f"overhead (median - median)   {overhead:10.1f} ms")
    print(f"overhead (paired median)     {statistics.median(paired) * 1000:10.1f} ms   target < 50 ms")


if __name__ == "__main__":
    main()
