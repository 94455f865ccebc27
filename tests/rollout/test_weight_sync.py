"""Every weight transport in `WEIGHT_SYNC` leaves the engine's model bit-identical to the
learner's and refuses a stream with a bucket lost or reordered; the learner hands out views
(no second full copy), and an engine loads an update bucket by bucket."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from steprl.engines.transports import WEIGHT_SYNC, check_weight_sync
from steprl.engines.weights import Bucket, WeightSyncError, WeightUpdate, load_in_place, plan_buckets, untied


def _other(model: torch.nn.Module) -> torch.nn.Module:
    """A copy whose every tensor differs from the original's."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(1.0)
    return out


@pytest.mark.parametrize("name", sorted(WEIGHT_SYNC))
def test_every_transport_delivers_exactly_and_refuses_a_broken_stream(name, small_model, tmp_path):
    if name == "ray":
        import ray

        from steprl.hosting.ray_backend import ensure_ray

        ensure_ray(num_cpus=1)
    receiver = _other(small_model)
    try:
        buckets = check_weight_sync(WEIGHT_SYNC[name](tmp_path), small_model, receiver)
        if name not in ("files", "socket"):  # full tensors only (an adapter reaches vLLM as files)
            _adapter_round_trip(WEIGHT_SYNC[name](tmp_path))
    finally:
        if name == "ray":
            ray.shutdown()  # this test process goes on to other files
    # the checker's buckets: one tensor each, a tied one (the head: the embedding) sent once
    assert buckets == len(untied(small_model.state_dict())) == len(small_model.state_dict()) - 1
    assert not list(tmp_path.iterdir()), "the transport left files behind"


def _adapter_round_trip(transport) -> None:
    from steprl.engines.lora_merge import AdapterUpdate, LoraDelta

    adapter = AdapterUpdate((LoraDelta("layers.0.q_proj", torch.randn(2, 8), torch.randn(8, 2), 2.0),))
    handle = transport.send(WeightUpdate.of_adapter(adapter, 4))
    got = transport.receive(handle)
    assert got.version == 4 and got.adapter is not None
    assert got.adapter.modules == adapter.modules and got.adapter.deltas[0].scaling == 2.0
    assert torch.equal(got.adapter.deltas[0].a, adapter.deltas[0].a)
    transport.release(handle)


def test_buckets_are_bounded_views_in_order():
    sizes = {"a": 4, "b": 4, "c": 10, "d": 1}
    assert plan_buckets(sizes, 8) == [("a", "b"), ("c",), ("d",)]  # a larger tensor alone
    named = {"a": torch.zeros(2), "b": torch.ones(3)}
    update = WeightUpdate.of_tensors(named, version=3, bucket_bytes=8)
    first = next(iter(update.buckets()))
    assert first.tensors["a"].data_ptr() == named["a"].data_ptr()  # a view, not a copy
    named["b"].add_(1)  # read when consumed
    assert torch.equal(update.full()["b"], torch.full((3,), 2.0))


def test_an_update_that_leaves_out_an_untied_tensor_is_refused(small_model):
    own = small_model.state_dict()
    names = tuple(untied(own))[1:]  # the first tensor (not tied to anything sent) missing
    update = WeightUpdate(7, names, lambda: iter([Bucket(7, 0, 1, {n: own[n] for n in names})]))
    with pytest.raises(WeightSyncError, match="leaves out .* which this model does not tie"):
        load_in_place(_other(small_model), update)


def test_a_bucket_of_another_version_or_a_stranger_tensor_is_refused(small_model):
    own = small_model.state_dict()
    target = _other(small_model)
    name = next(iter(own))
    for bad, why in (
        (Bucket(6, 0, 1, {name: own[name]}), "version 6 arrived in the update to version 7"),
        (Bucket(7, 0, 1, {"no.such.weight": own[name]}), "adds tensors"),
    ):
        update = WeightUpdate(7, tuple(untied(own)), lambda bad=bad: iter([bad]))
        with pytest.raises(WeightSyncError, match=why):
            load_in_place(target, update)


def test_an_update_cut_again_into_smaller_buckets_carries_the_same_tensors(small_model):
    """`runtime.weight_bucket_mib`: `rebucketed` cuts the same views again, nothing copied."""
    own = small_model.state_dict()
    update = WeightUpdate.of_tensors(own, 3)
    assert len(list(update.produce())) == 1  # the tiny model fits one 256 MiB bucket
    smallest = min(t.numel() * t.element_size() for t in own.values())
    cut = update.rebucketed(smallest)
    assert len(list(cut.produce())) == len(untied(own)) and cut.names == update.names
    got = cut.full()
    assert all(torch.equal(got[k], own[k]) for k in cut.names) and cut.nbytes == update.nbytes


def test_a_delta_sync_rebuilds_a_bf16_engine_exactly_and_refuses_another_base(small_model):
    """`runtime.weight_delta`: the first sync is the full weights in the engine's dtype, each
    later one the compressed XOR against the version the engine holds; the bf16 engine ends
    bit-identical to the learner's weights rounded to bf16 after each, in fewer bytes than the
    full bf16 weights. A delta reaching an engine on another version, or changed in flight, is
    refused in one line."""
    import zlib

    from steprl.engines.delta import DeltaEncoder
    from steprl.engines.hf import HFEngine

    learner = copy.deepcopy(small_model)
    engine = HFEngine(copy.deepcopy(small_model).to(torch.bfloat16), eos_token_id=2, pad_token_id=0)
    encoder = DeltaEncoder({k: v.dtype for k, v in engine.model.state_dict().items()})
    sent = []
    for version in (1, 2, 3):
        update = encoder.encode(WeightUpdate.of_tensors(learner.state_dict(), version, bucket_bytes=4096))
        assert (update.delta_from is None) == (version == 1)
        engine.update_weights(update, version)
        encoder.commit()  # every engine holds it: the next delta is against it
        mine = engine.model.state_dict()
        for name, t in untied(learner.state_dict()).items():
            assert torch.equal(mine[name], t.to(torch.bfloat16)), (version, name)
        sent.append(update.nbytes)
        with torch.no_grad():  # an RL-sized step: most bf16 weights do not move
            for p in learner.parameters():
                p.add_(1e-4 * torch.randn(p.shape, generator=torch.Generator().manual_seed(version)))
    full = sum(t.numel() * 2 for t in untied(learner.state_dict()).values())
    assert sent[0] == full and max(sent[1:]) < full, (sent, full)

    stale = encoder.encode(WeightUpdate.of_tensors(learner.state_dict(), 5))  # from 3; engine holds 3
    engine._version = 2  # as if it missed version 3
    with pytest.raises(
        WeightSyncError, match="a delta from version 3 to 5 reached an engine holding version 2"
    ):
        engine.update_weights(stale, 5)
    engine._version = 3
    bucket = next(iter(stale.produce()))
    name = next(iter(bucket.tensors))
    raw = bytearray(zlib.decompress(bucket.tensors[name].numpy().tobytes()))
    raw[0] ^= 1  # a flipped bit of the XOR: a wrong weight, caught by the new version's CRC
    changed = torch.frombuffer(bytearray(zlib.compress(bytes(raw))), dtype=torch.uint8)
    bad = WeightUpdate(
        5,
        stale.names,
        lambda: iter([replace(bucket, tensors={**bucket.tensors, name: changed})]),
        delta_from=3,
    )
    with pytest.raises(WeightSyncError, match="changed in flight"):
        engine.update_weights(bad, 5)
