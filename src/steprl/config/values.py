"""What a config value may be, and the one line that says so when it is not.

`steprl.config` declares the sections (strict types: `'8'` is not an integer, `true` is not a
count; ranges on every number with an obvious domain); this module holds what those
declarations need around them:

* `load_yaml`: YAML as users write numbers: `3e-4` is a float (YAML 1.1, PyYAML's default,
  reads it as a string, which a strict integer or float field would then refuse), read within
  `steprl.bounded_yaml`'s bounds (size, nesting, alias expansion);
* `check_params` (`steprl.params`, re-exported): the `*_params` mappings, checked against the
  signature of the function their name picks: the keys, and each value against the parameter's
  own annotation (strict) and the domain of its name (`PARAM_RANGES`);
* `format_errors`: a `ValidationError` as one line, `key: problem (got ...); allowed values: ...`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from steprl.bounded_yaml import MAX_BYTES, BoundedLoader, load_yaml_bounded
from steprl.errors import ConfigError
from steprl.params import PARAM_RANGES, allowed_values, check_params

__all__ = [
    "PARAM_RANGES",
    "ConfigError",
    "WandbSection",
    "allowed_values",
    "anchor_paths",
    "check_params",
    "format_errors",
    "load_yaml",
    "load_yaml_bounded",
    "parse_override",
    "read_yaml",
]


class _Loader(BoundedLoader):
    """safe_load within bounds, plus YAML 1.2's floats without a dot (`1e-4`, `3E5`)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(text: str, where: str = "YAML") -> Any:
    """`text` as YAML; over a bound, a one-line `YamlTooLarge` that names `where`."""
    return load_yaml_bounded(text, where, _Loader)


def _field_at(model: type[BaseModel], loc: Sequence[str | int]) -> tuple[type[BaseModel] | None, Any]:
    """The section that holds `loc`'s last model field, and that field (None past a mapping)."""
    cls: Any = model
    field = None
    for part in loc:
        if cls is None:
            break
        field = cls.model_fields.get(str(part))
        if field is None:
            return cls, None
        kinds = (field.annotation, *get_args(field.annotation))  # X | None
        cls = next((t for t in kinds if isinstance(t, type) and issubclass(t, BaseModel)), None)
    return cls, field


def format_errors(err: ValidationError, root: type[BaseModel]) -> str:
    """One line: `key: problem` per error, joined by "; ". A check over several fields (a
    model validator) names its fields itself and never echoes the whole section back."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        msg = str(e["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
        if e["type"] == "extra_forbidden":
            holder, _ = _field_at(root, e["loc"][:-1])
            allowed = sorted(holder.model_fields) if holder is not None else []
            lines.append(f"{key}: unknown key; allowed keys here: {', '.join(allowed)}")
        elif e["type"] == "value_error":  # our validators: the message names its keys and values
            section = f"{e['loc'][0]}." if e["loc"] else ""
            lines.append(msg if section and msg.startswith(section) else f"{key}: {msg}".lstrip(": "))
        else:
            got = repr(e.get("input"))
            line = f"{key}: {msg} (got {got if len(got) <= 80 else got[:77] + '...'})"
            _, field = _field_at(root, e["loc"])
            if field is not None and e["type"] != "literal_error":  # a Literal's message lists them
                line += f"; allowed values: {allowed_values(field.annotation, field.metadata)}"
            lines.append(line)
    return "invalid config: " + "; ".join(" ".join(line.split()) for line in lines)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a","b","c"], value parsed as YAML, so 3 -> int, true -> bool)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value (e.g. trainer.lr=3e-4)")
    key, raw = item.split("=", 1)
    try:
        value = load_yaml(raw, f"override {item!r}")
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(
            f"override {item!r}: the value is not valid YAML ({problem}); quote it, e.g. {key}='...'"
        ) from None
    return key.strip().split("."), value


def read_yaml(p: Path) -> Any:
    """A config file's YAML; a syntax error or an unreadable file is one line naming where."""
    try:
        size = p.stat().st_size  # checked before reading: the text's own check comes too late
        if size > MAX_BYTES:
            raise ConfigError(
                f"config file {p}: {size:,} bytes, over the {MAX_BYTES:,} a config may have; "
                "is it the right file?"
            )
        return load_yaml(p.read_text(), str(p))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
        problem = getattr(err, "problem", None) or " ".join(str(err).split())
        raise ConfigError(f"{where}: YAML syntax error: {problem}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {p} cannot be read: {err}") from None


#: the config's paths to files it comes with, as (section, key); and each env's task_file.path.
#: Not rollout.vllm_python: its default is the checkout's venv (the working directory's), and
#: every saved config.yaml holds it.
_PATH_KEYS = (("model", "chat_template"), ("model", "cache_dir"))


def anchor_paths(data: dict[str, Any], base: Path, *, in_file: bool) -> None:
    """Make each relative path the config names absolute against `base`: the config file's
    folder for a path written in it (`in_file`: a config runs from any directory), the working
    directory for one given with --set (as a shell user means it). A saved config (a
    checkpoint's) then names the same files from anywhere. The paths: `_PATH_KEYS`, each env's
    `task_file.path`, and, in a file, `model.name` when it is a path ('/' or .gguf) to something
    beside the config (otherwise a Hub id or a built-in name, kept as written). Not
    `run.output_dir`: where a command writes is the working directory's, as for every tool."""

    def anchored(value: str) -> str:
        return str((base / Path(value).expanduser()).absolute())

    for section, key in _PATH_KEYS:
        node = data.get(section)
        if isinstance(node, dict) and isinstance(node.get(key), str):
            node[key] = anchored(node[key])
    for entry in _env_entries(data.get("env")):
        tf = entry.get("task_file")
        if isinstance(tf, dict) and isinstance(tf.get("path"), str):
            tf["path"] = anchored(tf["path"])
    model = data.get("model")
    name = model.get("name") if isinstance(model, dict) else None
    if in_file and isinstance(model, dict) and isinstance(name, str) and _local_path(name, base):
        model["name"] = anchored(name)


def _local_path(name: str, base: Path) -> bool:
    """`model.name` names a model directory or a .gguf file under `base`, not a Hub id or a
    built-in model (a bare name)."""
    return ("/" in name or name.endswith(".gguf")) and (base / Path(name).expanduser()).exists()


def _env_entries(env: Any) -> list[dict[str, Any]]:
    """`env` as its entries: one env, a YAML list of them, or one with `mix`."""
    entries = (
        env if isinstance(env, list) else [env, *(env.get("mix") or [])] if isinstance(env, dict) else []
    )
    return [e for e in entries if isinstance(e, dict)]


class WandbSection(BaseModel):
    """`logging.wandb`: log to Weights & Biases too (the `wandb` extra); absent = off. The same
    scalars as metrics.jsonl, and a table of `table_episodes` sample episodes every `table_every`
    steps (`steprl.diagnostics.wandb_sink`). Here, not in `steprl.config`, only for its size."""

    # as `steprl.config`'s sections: unknown keys refused, values never coerced
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    project: str = Field("steprl", min_length=1)
    entity: str | None = None  # the W&B user or team; None: the logged-in user's default
    # offline: written under the run directory only (`wandb sync` uploads it later)
    mode: Literal["online", "offline", "disabled"] = "online"
    table_every: int = Field(10, ge=0)  # steps between sample-episode tables; 0: no tables
    table_episodes: int = Field(4, gt=0)  # episodes per table
