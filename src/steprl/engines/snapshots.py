"""Cross-policy sampling (AgentRL, arXiv 2510.04206): the engine keeps the K-1 weight versions
before its current one, and each request (one turn of an episode) is sampled by a version drawn
with configured probabilities, so one trajectory's turns mix policy versions on purpose.

- The draw is a pure function of (engine seed, request seed): which version samples a turn never
  depends on batching or timing, so rollouts stay reproducible and a resume stays exact. A lag
  whose snapshot is not held yet (the first K-1 versions of a run) falls back to the oldest held.
- Each snapshot is a plain `HFEngine` with its own copy of the weights, scheduler, KV and prefix
  caches, so its tokens record its version and their log-probs are its own: the learner's
  decoupled objective (`decoupled_ppo`) reweights them by pi_prox / pi_snapshot.
- `rotate` (on every new version) copies the current weights into the oldest snapshot's model (or
  a new copy while fewer than K-1 are held): K full model copies in memory. With LoRA the current
  engine holds merged weights, so snapshots are of the merged weights.
- A checkpoint holds the snapshots (`state_dict`): they are past weights no resume could rebuild.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from steprl.engines.sampling import request_uniforms

#: keeps the version draw's uniform apart from the token draws' (which use the engine seed itself)
_DRAW_SALT = 0x5EED_C0DE_CAFE


@dataclass(frozen=True)
class CrossPolicy:
    """probs[j]: the chance that a request is sampled by the version `j` behind the current one
    (probs[0]: the current weights). len(probs) = K, the versions held."""

    probs: tuple[float, ...] = (1.0,)

    def __post_init__(self) -> None:
        if not self.probs or any(p < 0 for p in self.probs) or abs(sum(self.probs) - 1.0) > 1e-6:
            raise ValueError(f"cross-policy probs must be >= 0 and sum to 1, got {list(self.probs)}")

    @property
    def snapshots(self) -> int:
        return len(self.probs)


def draw_lags(policy: CrossPolicy, engine_seed: int, request_seeds: Sequence[int]) -> list[int]:
    """The lag (versions behind the current one) each seeded request is sampled at: inverse CDF
    of `policy.probs` at a uniform hashed from (engine seed, request seed)."""
    u = request_uniforms(engine_seed ^ _DRAW_SALT, request_seeds, 0).tolist()
    cdf, acc = [], 0.0
    for p in policy.probs:
        acc += p
        cdf.append(acc)
    last = max(j for j, p in enumerate(policy.probs) if p > 0)
    return [min(next((j for j, c in enumerate(cdf) if x < c), last), last) for x in u]


class Snapshots:
    """The K-1 older versions of one engine, newest first, each served by its own engine."""

    def __init__(self, policy: CrossPolicy, make_engine: Callable[[torch.nn.Module, int], Any]) -> None:
        self.policy = policy
        self._make = make_engine  # (model, version) -> an HFEngine without snapshots
        self.engines: list[Any] = []  # engines[j - 1] serves lag j

    def engine_for(self, lag: int) -> Any | None:
        """The snapshot engine for `lag` (>= 1), or the oldest held; None when none is held."""
        if not self.engines:
            return None
        return self.engines[min(lag, len(self.engines)) - 1]

    def rotate(self, current: torch.nn.Module, version: int) -> None:
        """Keep `current` (the weights of `version`, about to be replaced) as the newest snapshot."""
        keep = self.policy.snapshots - 1
        if keep <= 0:
            return
        if len(self.engines) < keep:
            engine = self._make(copy.deepcopy(current), version)
        else:
            engine = self.engines.pop()  # the oldest: its rows in flight continue on these weights
            with torch.no_grad():
                engine.update_weights(current.state_dict(), version)
        self.engines.insert(0, engine)

    def reset_scheduler(self) -> None:
        for e in self.engines:
            e.reset_scheduler()

    def state_dict(self) -> dict[str, Any]:
        """Every snapshot's version and weights (on CPU), newest first."""
        return {
            "versions": [e.version for e in self.engines],
            "weights": [
                {k: v.detach().cpu().clone() for k, v in e.model.state_dict().items()} for e in self.engines
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any], template: torch.nn.Module) -> None:
        """Hold exactly the snapshots of `state` (models shaped like `template`)."""
        engines = []
        for i, (version, weights) in enumerate(zip(state["versions"], state["weights"], strict=True)):
            engine = (
                self.engines[i] if i < len(self.engines) else self._make(copy.deepcopy(template), version)
            )
            engine.update_weights(weights, int(version))
            engines.append(engine)
        self.engines = engines


__all__ = ["CrossPolicy", "Snapshots", "draw_lags"]
