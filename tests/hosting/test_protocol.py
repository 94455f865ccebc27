"""`json_safe`: whatever an env puts in `info` reaches the client as plain JSON."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass

from steprl.hosting.protocol import json_safe


class Colour(enum.Enum):
    RED = "red"


@dataclass
class Point:
    x: int
    y: tuple[int, int]


def test_a_plain_info_dict_passes_as_is() -> None:
    info = {"action_kind": "tool_call", "turn": 3, "valid": True, "score": 0.5, "note": None}
    assert json_safe(info) is info  # no copy on the hot path
    nested = {"reward_components": {"outcome": 1.0}, "calls": [{"name": "add", "args": [1, 2]}]}
    assert json_safe(nested) is nested


def test_values_json_cannot_carry_are_converted() -> None:
    info = {
        1: (1, 2),
        "nan": math.nan,
        "inf": -math.inf,
        "set": {3, 1, 2},
        "colour": Colour.RED,
        "bytes": b"h\xffi",
        "point": Point(1, (2, 3)),
        "nested": {"ok": [1.5, {"deep": float("inf")}]},
        "object": object,
    }
    got = json_safe(info)
    assert got == {
        "1": [1, 2],
        "nan": "nan",
        "inf": "-inf",
        "set": [1, 2, 3],
        "colour": "red",
        "bytes": "h\ufffdi",
        "point": {"x": 1, "y": [2, 3]},
        "nested": {"ok": [1.5, {"deep": "inf"}]},
        "object": "<class 'object'>",
    }
    json.dumps(got, allow_nan=False)  # strict JSON


def test_a_non_finite_float_or_a_non_str_key_is_never_passed_as_is() -> None:
    assert json_safe({"x": math.nan}) == {"x": "nan"}
    assert json_safe({2: "two"}) == {"2": "two"}
    inner_tuple = {"x": [{"y": (1, 2)}]}
    assert json_safe(inner_tuple) == {"x": [{"y": [1, 2]}]} and json_safe(inner_tuple) is not inner_tuple


def test_structures_deeper_than_the_limit_are_cut() -> None:
    deep: dict[str, object] = {"v": 1}
    for _ in range(40):
        deep = {"d": [deep]}
    text = json.dumps(json_safe(deep))
    assert "<too deep>" in text
