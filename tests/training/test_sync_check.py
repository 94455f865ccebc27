"""Every weight sync proven (`training/loop/sync_check.py`): after a sync the engine's probe
log-probs equal the learner's within 1e-6 (fp32), and each way an engine can end up serving
something else stops the run in one line naming the engine and the version: an engine left on
the old version, one that took the version but computes other weights, and a bucket changed in
flight (the transports' checksums)."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
import torch

from steprl.engines import weights
from steprl.engines.hf import HFEngine
from steprl.engines.weights import WeightUpdate, seal
from steprl.training.loop import sync_check
from steprl.training.loop.pipeline import Pipeline
from steprl.training.loop.producers import LocalProducer
from steprl.training.loop.sync_check import SyncProbe, WeightProbeError
from steprl.training.sources.stream import StreamSource
from tiny_runs import make_learner


def _nudge(model: torch.nn.Module, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


class _InFlight:
    """The learner, whose updates lose one byte of a bucket on the way (each bucket sealed, as
    the object store and the files seal theirs)."""

    def __init__(self, learner: Any) -> None:
        self.learner = learner

    def weights(self, version: int) -> WeightUpdate:
        update = self.learner.weights(version)
        buckets = [seal(b) for b in update.buckets()]
        name, tensor = next(iter(buckets[0].tensors.items()))
        broken = tensor.clone()
        broken.view(-1)[0] += 1.0
        buckets[0] = replace(buckets[0], tensors={**buckets[0].tensors, name: broken})
        return WeightUpdate(version, update.names, lambda: iter(buckets), nbytes=update.nbytes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.learner, name)


def test_a_synced_engine_passes_the_probe_and_a_stale_wrong_or_corrupted_one_stops_the_run(
    small_model, tokenizer
):
    learner = make_learner(copy.deepcopy(small_model).train())
    engine = HFEngine(
        copy.deepcopy(small_model), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    producer = LocalProducer(None, engine, group_size=1, seed=0)  # type: ignore[arg-type]
    pipe = Pipeline(StreamSource(lambda: iter(())), producer, tasks_per_step=1, max_staleness=0, version=0)
    probe = SyncProbe.of(tokenizer, 1.0, "float32")
    try:
        _nudge(learner.model)
        metrics = sync_check.publish(pipe, learner, probe, 1)
        assert metrics["weights/probe_gap"] <= 1e-6, metrics
        untied = weights.untied(small_model.state_dict())  # the tied head travels once
        assert metrics["weights/sync_bytes"] == sum(t.numel() * t.element_size() for t in untied.values())

        _nudge(learner.model)  # version 2 exists in the learner; the engine never got it
        answers = producer.probe(probe.prompt_ids, probe.sampling)
        with pytest.raises(
            WeightProbeError, match=r"version 2: the engine answered the probe with version\(s\) \[1\]"
        ):
            probe.check(learner, answers, 2)

        pipe.publish(learner.weights(2), 2)  # it takes version 2, then one tensor is wrong
        with torch.no_grad():
            next(p for n, p in engine.model.named_parameters() if "q_proj" in n).mul_(3.0)
        with pytest.raises(
            WeightProbeError, match=r"version 2: the engine's log-probs differ .* serves other weights"
        ):
            probe.check(learner, producer.probe(probe.prompt_ids, probe.sampling), 2)

        with pytest.raises(
            WeightProbeError, match=r"sync to version 3 failed: bucket 0 .* changed in flight"
        ):
            sync_check.publish(pipe, _InFlight(learner), probe, 3)
        assert engine.version == 2  # the refused update was not applied as version 3
    finally:
        producer.close()
