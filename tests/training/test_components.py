"""A checkpoint's run components must match the run's: a mismatch is one line naming them."""

from __future__ import annotations

from typing import Any

import pytest

from steprl.errors import UserError
from steprl.training.components import component_states, load_component_states


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: Any) -> None:
        self.n = int(state["n"])


def test_states_round_trip_by_name_and_a_mismatch_names_the_components() -> None:
    a = Counter()
    a.n = 3
    saved = component_states({"controller:a": a})
    b = Counter()
    load_component_states({"controller:a": b}, saved)
    assert b.n == 3
    with pytest.raises(UserError, match=r"missing \['controller:kl'\], unexpected \['controller:a'\]"):
        load_component_states({"controller:kl": Counter()}, saved)
