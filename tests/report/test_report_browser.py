"""The report opens in a real browser: headless Chromium (the Debian package `chromium`, which
`make venv` installs) loads the file offline, runs its script without a console message, lists
the run's episodes, colours a model token by its advantage, shows each turn's step
credit and draws the health timeline."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from fixture_run import make_run

from steprl.report import write_report

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
#: everything that would reach a network or a profile is off: the page must need none of it
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--enable-logging=stderr", "--v=0",
)  # fmt: skip


@pytest.mark.slow
def test_the_report_renders_in_headless_chromium(tmp_path):
    if not shutil.which(CHROMIUM):
        pytest.skip("chromium is not installed (Debian package chromium; `make venv` installs it as root)")
    written = write_report(make_run(tmp_path), tmp_path / "report.html")
    done = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", written.path.as_uri()],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    # Chromium logs every console message (errors, uncaught exceptions) as an INFO:CONSOLE line;
    # the page writes none unless something failed
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    assert not console, "\n".join(console)
    dom = done.stdout
    rows = re.findall(r'<tr class="ep-row[^"]*" data-index="\d+"', dom)
    assert len(rows) == written.episodes == 8, dom[-3000:]
    assert re.search(r'class="tok act" data-adv="0\.7"[^>]*style="background: rgba\(33, 102, 172', dom)
    assert re.search(r'class="tok masked"', dom) and "first difference" in dom
    assert re.search(r'class="credit" data-credit="0\.25"[^>]*> · step credit 0\.25<', dom)  # per turn
    # the health timeline: a marker per firing on the strip, a row per firing below it
    assert len(re.findall(r'<circle [^>]*class="firing" data-rule="', dom)) == 2, dom[-3000:]
    assert len(re.findall(r'<tr class="firing-row" data-step="\d+"', dom)) == 2
