"""Run components: the parts of a run that live across RL steps and must survive a resume.

A task source (what the next step trains on) and a controller (what the step's results change:
the KL coefficient, a stop) are both components: each says what it carries between steps as a
plain dict, and the checkpoint stores every component's dict under its name
(`component_states`), so a resume restores each one exactly (`load_component_states`) and no
`TrainState` field, `make_batch` keyword or `if` in the trainer is added for a new one.

What a `state_dict` holds must be what `torch.save` writes and `torch.load(weights_only=True)`
reads back: numbers, strings, bools, None, lists, tuples, dicts and tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from steprl.errors import UserError


@runtime_checkable
class Stateful(Protocol):
    """Anything that lives across steps: its state out, and back in, exactly."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def component_states(components: Mapping[str, Stateful]) -> dict[str, dict[str, Any]]:
    """Every component's state, by name: what a checkpoint stores."""
    return {name: component.state_dict() for name, component in components.items()}


def load_component_states(components: Mapping[str, Stateful], saved: Mapping[str, Mapping[str, Any]]) -> None:
    """Restore each component from a checkpoint's `component_states`. A component the run has
    and the checkpoint lacks (or the reverse) is an error that names it: resuming it from
    nothing would silently continue a different run."""
    missing, extra = set(components) - set(saved), set(saved) - set(components)
    if missing or extra:
        raise UserError(  # one line: e.g. a resume under run.allow_config_change that changed kl_ctrl
            f"the checkpoint's run components do not match this run's: missing {sorted(missing)}, "
            f"unexpected {sorted(extra)}; resume with the configuration the run was started with"
        )
    for name, component in components.items():
        component.load_state_dict(saved[name])


__all__ = [
    "Stateful",
    "component_states",
    "load_component_states",
]
