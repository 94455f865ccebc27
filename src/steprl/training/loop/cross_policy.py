"""What cross-policy sampling (`engines/snapshots.py`) does to a step's batch, by lag
(the current version minus the version that sampled a token):

    cross_policy/token_share/<lag>   the share of trained tokens sampled that many versions back
    cross_policy/ratio_mean/<lag>    mean pi_current / pi_behaviour over those tokens: decoupled
                                     PPO's behaviour weight (its proximal policy is the current one)
    cross_policy/ratio_max/<lag>     its largest value (a snapshot far from the policy shows here)

One extra forward pass over the batch (the learner's weights before the update), only when
`rollout.cross_policy` is set.
"""

from __future__ import annotations

import math
from collections import defaultdict

from steprl.rollout.views import Sample
from steprl.training.learn.learner_protocol import Learner
from steprl.training.loop.step_batch import StepBatch
from steprl.types import Trajectory

_LOG_RATIO_CLAMP = 20.0  # as in the decoupled loss


def token_lags(sample: Sample, traj: Trajectory, version: int) -> list[tuple[int, int]]:
    """(position in `sample`, lag) of every trained token of the row."""
    versions = [s.token_versions for s in traj.steps]
    seen: dict[int, int] = defaultdict(int)
    out = []
    for t, step in enumerate(sample.token_step):
        if step < 0:
            continue
        k = seen[step]
        seen[step] += 1
        if sample.loss_mask[t]:
            out.append((t, version - versions[step][k]))
    return out


def ratio_metrics(learner: Learner, batch: StepBatch, version: int, lags: int) -> dict[str, float]:
    """The metrics above for lags 0..`lags` (shares always; ratios where a lag has tokens);
    none without cross-policy sampling (`lags` 0)."""
    samples, trajectories = batch.samples, batch.trajectories
    if not lags or not samples:
        return {}
    logps = learner.compute(samples, logprobs=True).logprobs or ()  # logps[t - 1]: input token t's
    ratios: dict[int, list[float]] = defaultdict(list)
    for sample, logp in zip(samples, logps, strict=True):
        for t, lag in token_lags(sample, trajectories[sample.traj_index], version):
            log_ratio = float(logp[t - 1]) - sample.old_logprobs[t]
            ratios[lag].append(math.exp(max(-_LOG_RATIO_CLAMP, min(_LOG_RATIO_CLAMP, log_ratio))))
    total = max(sum(len(r) for r in ratios.values()), 1)
    out = {f"cross_policy/token_share/{lag}": len(ratios.get(lag, [])) / total for lag in range(lags + 1)}
    for lag, r in sorted(ratios.items()):
        out[f"cross_policy/ratio_mean/{lag}"] = sum(r) / len(r)
        out[f"cross_policy/ratio_max/{lag}"] = max(r)
    return out


__all__ = ["ratio_metrics", "token_lags"]
