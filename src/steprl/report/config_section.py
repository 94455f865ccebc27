"""The config section: the run's config as YAML, and with `--vs` the settings that differ between
the runs, plus a "not comparable" flag where they train on a different env, model or tokenizer
(curves of such runs can be overlaid, but a difference in them says nothing about the algorithm)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import yaml

from steprl.report.budget import clip
from steprl.report.run_data import RunData

#: what makes two runs incomparable, by the config keys (dotted prefixes) that decide it
COMPARABILITY: dict[str, tuple[str, ...]] = {
    # not env.source (and its params): a curriculum over the same tasks is what --vs compares
    "env": ("env.name", "env.params", "env.task_params", "env.task_file", "env.mix"),
    "model": ("model.name", "model.tiny", "model.lora"),
    "tokenizer": ("model.name", "model.format", "model.chat_template"),
}
VALUE_CHARS = 500  # one setting's value in the diff
YAML_CHARS = 200_000  # the config as YAML (a config that inlines its task list can be longer)
#: settings that differ between any two runs and say nothing about them
_IGNORED = ("run.output_dir", "run.name", "run.overwrite", "run.resume")


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and scalars are leaves."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _shown(value: Any) -> str:
    """A setting as the diff shows it; unset, null and empty are one value (an older run's config
    lacks the settings added since, which is no difference)."""
    if value is None or value == {} or value == []:
        return "(unset)"
    text = json.dumps(value, default=str, sort_keys=True) if not isinstance(value, str) else value
    return clip(text, VALUE_CHARS)


def build(run: RunData) -> dict[str, Any]:
    runs = (run, *run.vs)
    data: dict[str, Any] = {
        "yaml": clip(yaml.safe_dump(dict(run.config), sort_keys=False), YAML_CHARS) if run.config else "",
        "runs": [r.label for r in runs],
        "diff": [],
        "not_comparable": [],
    }
    if not run.vs:
        return data
    flats = [flatten(r.config) for r in runs]
    keys = sorted({k for f in flats for k in f})
    for key in keys:
        values = [_shown(f.get(key)) for f in flats]
        if len(set(values)) > 1 and not key.startswith(_IGNORED):
            data["diff"].append({"key": key, "values": values})
    for what, prefixes in COMPARABILITY.items():
        differing = [d["key"] for d in data["diff"] if d["key"].startswith(prefixes)]
        if differing:
            data["not_comparable"].append(f"{what} differs ({', '.join(differing)})")
    return data
