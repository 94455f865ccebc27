"""YAML the CLI reads is bounded (issue 44, item 3a): a billion-laughs config, a nesting bomb, an
alias bomb given with --set, an alias that contains itself, a text over the size bound are one line
each (`steprl.bounded_yaml`), not minutes of expansion and a MemoryError or a RecursionError.

The commands run through `steprl.cli.main`, the `steprl` entry point, in this process (the cases
stop at the config, before any model or env work, so a subprocess would only add torch's import).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from steprl import cli
from steprl.bounded_yaml import MAX_BYTES, MAX_DEPTH, YamlTooLarge, load_yaml_bounded
from steprl.config import load_config


def _laughs(levels: int) -> str:
    """A flow list whose last item stands for 10**levels strings, in ~60 characters a level."""
    items = ["&b0 [" + ", ".join(["lol"] * 10) + "]"]
    items += [f"&b{i} [" + ", ".join([f"*b{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "[" + ", ".join(items) + "]"


def _steprl(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *argv: str
) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["steprl", *argv])
    with pytest.raises(SystemExit) as done:
        cli.main()
    captured = capsys.readouterr()
    return int(done.value.code or 0), (captured.out + captured.err).strip()


def _one_line(rc: int, out: str, *needles: str) -> None:
    assert rc == 2, out
    assert "Traceback" not in out and len(out.splitlines()) == 1, out[:2000]
    for needle in needles:
        assert needle in out, out[:2000]


def test_a_billion_laughs_config_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # run.name must be a string: the old loader let the 10^9 strings reach the error message's
    # repr (minutes, GBs); the bounded one refuses the file before validation
    config = tmp_path / "laughs.yaml"
    config.write_text(f"env: {{name: calculator}}\nrun: {{output_dir: {tmp_path}, name: {_laughs(9)}}}\n")
    rc, out = _steprl(monkeypatch, capsys, "train", str(config))
    _one_line(rc, out, str(config), "more than 1,000,000 values")


def test_a_nesting_bomb_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "deep.yaml"
    config.write_text("run: {name: " + "[" * 5_000 + "]" * 5_000 + "}\n")
    rc, out = _steprl(monkeypatch, capsys, "check-env", str(config))
    _one_line(rc, out, str(config), f"nested deeper than {MAX_DEPTH} levels")


def test_an_alias_bomb_given_with_set_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out = _steprl(
        monkeypatch, capsys, "check-env", "calculator", "--set", f"env.params.max_ops_per_call={_laughs(9)}"
    )
    _one_line(rc, out, "override 'env.params.max_ops_per_call=", "more than 1,000,000 values")


def test_an_alias_inside_its_own_value_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "cycle.yaml"
    config.write_text("env:\n  name: calculator\n  params: &p {x: *p}\n")
    with pytest.raises(YamlTooLarge, match=r"an alias refers to a value that contains it"):
        load_config(config)


def test_the_bounds_pass_what_configs_and_specs_hold() -> None:
    assert load_yaml_bounded(_laughs(5), "x")[-1][0][0][0][0][0] == "lol"  # 10^5 values: allowed
    assert load_yaml_bounded("a: " + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1), "x") is not None
    assert load_yaml_bounded("", "x") is None
    with pytest.raises(YamlTooLarge, match=r"^x: .* characters, over the"):
        load_yaml_bounded(" " * (MAX_BYTES + 1), "x")
