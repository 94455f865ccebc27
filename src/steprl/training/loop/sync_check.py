"""Every weight sync proven: after the learner's weights reach the engines, each engine copy
answers a fixed probe (a short prompt, `PROBE_TOKENS` sampled tokens at the run's temperature),
and the learner scores the same tokens. The largest difference between an engine's log-probs
and the learner's is `weights/probe_gap`; beside it `weights/sync_s` (the push and the probe)
and `weights/sync_bytes` (what one engine receives).

What it catches that the transports' own checks (buckets in order, checksums) cannot: an engine
that took the bytes but computes something else (a tensor loaded into the wrong place, an
adapter merged twice or not at all, a stale copy still serving), the failure users report as
runs that "trained" on the wrong weights for hours. A gap beyond the bound, or an engine whose
probe tokens carry another version, stops the run in one line naming the engine, the version
and the last good checkpoint.

The bound is by the engines' dtype: 1e-4 in fp32 (the engine tests' bound; measured gaps are
about 1e-7 here), 5e-2 in bf16/fp16 (a bf16 logit rounds at 4e-3 relative). A stale engine
after one small update can stay under it: the version check covers that case.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from steprl.config import Config
from steprl.engines.base import Generation, SamplingParams
from steprl.engines.weights import BUCKET_BYTES, WeightSyncError
from steprl.errors import UserError
from steprl.rollout.views import Sample
from steprl.training.learn.learner_protocol import Learner
from steprl.training.loop.pipeline import Pipeline

#: a few tokens of ordinary text, the same for every run (its ids depend on the tokenizer)
PROBE_TEXT = "Weights probe: 12 + 30 ="
PROBE_TOKENS = 4
BOUND_FP32, BOUND_HALF = 1e-4, 5e-2


class WeightProbeError(UserError):
    """An engine computes something other than the learner after a sync: the run stops."""


@dataclass(frozen=True)
class SyncProbe:
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    bound: float

    @staticmethod
    def of(tokenizer: Any, temperature: float, dtype: str, bound: float | None = None) -> SyncProbe:
        ids = tuple(tokenizer.encode(PROBE_TEXT, add_special_tokens=False)) or (0,)
        sampling = SamplingParams(temperature=temperature, top_p=1.0, max_new_tokens=PROBE_TOKENS)
        default = BOUND_FP32 if dtype == "float32" else BOUND_HALF
        return SyncProbe(ids, sampling, default if bound is None else bound)

    def check(self, learner: Learner, answers: Mapping[str, Generation], version: int) -> float:
        """The largest |engine - learner| log-prob over every engine's probe tokens; raises
        `WeightProbeError` (one line) for an engine beyond the bound or on another version."""
        named = [(name, gen) for name, gen in answers.items() if gen.token_ids]
        for name, gen in named:
            if gen.versions and set(gen.versions) != {version}:
                raise WeightProbeError(
                    f"weight sync to version {version}: {name} answered the probe with version(s) "
                    f"{sorted(set(gen.versions))}: it did not take the new weights"
                )
        if not named:
            return 0.0
        p = len(self.prompt_ids)
        rows = [
            Sample(
                self.prompt_ids + gen.token_ids,
                (0,) * p + (1,) * len(gen.token_ids),
                (0.0,) * p + gen.logprobs,
                k,
            )
            for k, (_, gen) in enumerate(named)
        ]
        computed = learner.compute(rows, logprobs=True, eval_mode=True).logprobs  # no dropout, no RNG drawn
        assert computed is not None
        worst = 0.0
        for (name, gen), lp in zip(named, computed, strict=True):
            ours = lp[p - 1 : p - 1 + len(gen.token_ids)].tolist()  # target-aligned: token t at t-1
            gap = max(abs(a - b) for a, b in zip(ours, gen.logprobs, strict=True))
            if not gap <= self.bound:  # NaN too
                raise WeightProbeError(
                    f"weight sync to version {version}: {name}'s log-probs differ from the learner's by "
                    f"{gap:.3g} on the probe (bound {self.bound:g}, runtime.weight_probe_bound): it serves "
                    "other weights"
                )
            worst = max(worst, gap)
        return worst


def probe_for(cfg: Config, tokenizer: Any) -> SyncProbe | None:
    """The run's probe (None: `runtime.weight_probe: false`), bounded for the coarser of the
    learner's and the engines' dtypes."""
    if not cfg.runtime.weight_probe:
        return None
    engine_dtype = cfg.model.dtype if cfg.model.engine_dtype == "auto" else cfg.model.engine_dtype
    dtype = "float32" if cfg.model.dtype == engine_dtype == "float32" else "bfloat16"
    return SyncProbe.of(tokenizer, cfg.rollout.temperature, dtype, cfg.runtime.weight_probe_bound)


def publish(
    pipeline: Pipeline,
    learner: Learner,
    probe: SyncProbe | None,
    version: int,
    bucket_bytes: int = BUCKET_BYTES,
) -> dict[str, float]:
    """The learner's weights to every engine as `version` in buckets of at most `bucket_bytes`,
    then (`probe`) each engine's probe checked against the learner: `weights/*` metrics, or one
    `WeightProbeError` line."""
    t0 = time.perf_counter()
    update = learner.weights(version).rebucketed(bucket_bytes)
    try:
        sent = pipeline.publish(update, version)
        answers = pipeline.producer.probe(probe.prompt_ids, probe.sampling) if probe else {}
    except (WeightSyncError, RuntimeError) as exc:  # a bucket refused, a deadline, an engine gone
        raise WeightProbeError(f"weight sync to version {version} failed: {exc}") from None
    finally:  # learner ranks: a copy gathered here for an engine in this process is not kept
        getattr(update.remote, "forget", lambda: None)()
    gap = probe.check(learner, answers, version) if probe else 0.0
    received = update.nbytes if sent is None else sent  # a delta: what crossed, not the model
    metrics = {"weights/sync_s": time.perf_counter() - t0, "weights/sync_bytes": float(received)}
    return metrics | ({"weights/probe_gap": gap} if probe else {})


__all__ = ["PROBE_TEXT", "SyncProbe", "WeightProbeError", "probe_for", "publish"]
