"""LoRA (peft): adapters-only training, merged generation, adapter-only updates, the base as KL
reference, target errors, checkpoints, and a short end-to-end run.

Two small random-init architectures: the tiny Llama and a Qwen3 (q/k norms, GQA), fp32 on CPU.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import pickle
from types import SimpleNamespace

import pytest
import torch

peft = pytest.importorskip("peft")

from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from steprl.engines.hf import EngineSettings, HFEngine  # noqa: E402
from steprl.engines.lora_merge import AdapterUpdate, LoraMergeError, LoraMerger  # noqa: E402
from steprl.models import tiny  # noqa: E402
from steprl.training.learn.batching import device_of, token_logprobs  # noqa: E402
from steprl.training.learn.checkpoint import load_checkpoint_model, save_checkpoint, write_model  # noqa: E402
from steprl.training.learn.lora import (  # noqa: E402
    AdaptersDisabled,
    LoraConfigError,
    adapter_update,
    apply_lora,
    is_peft,
)
from tiny_runs import make_learner, small_config  # noqa: E402

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _spec(targets=ATTN, r=4, alpha=8.0):
    return SimpleNamespace(r=r, alpha=alpha, dropout=0.0, target_modules=targets)


def _llama(tokenizer):
    spec = tiny.TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    ids = {
        "pad_id": tokenizer.pad_token_id,
        "bos_id": tokenizer.bos_token_id,
        "eos_id": tokenizer.eos_token_id,
    }
    return tiny.build_model(len(tokenizer), spec, seed=0, **ids)


def _qwen3(tokenizer):
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen3ForCausalLM(config)


@pytest.fixture(params=["llama", "qwen3"])
def base(request, tokenizer):
    model = _llama(tokenizer) if request.param == "llama" else _qwen3(tokenizer)
    return model.float().eval()


def _perturb(model, seed, scale=0.2):
    """Random values in every adapter (B starts at 0, so fresh adapters are a no-op)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(scale * torch.randn(p.shape, generator=g))


def _ids(tokenizer, seed=0, shape=(3, 12)):
    return torch.randint(4, len(tokenizer), shape, generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()


def _learner(model):
    return make_learner(model)


# (1) only the adapters train ---------------------------------------------------------------------


def test_only_adapters_require_grad_and_the_optimizer_holds_exactly_them(base):
    n_base = sum(p.numel() for p in base.parameters())
    pm = apply_lora(base, _spec())
    assert is_peft(pm) and not is_peft(base)
    trainable = {n for n, p in pm.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(not p.requires_grad for n, p in pm.named_parameters() if "lora_" not in n)
    assert sum(p.numel() for p in pm.parameters() if not p.requires_grad) == n_base
    learner = _learner(pm)
    held = {id(p) for g in learner.optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for p in pm.parameters() if p.requires_grad}


# (2) the engine generates with merged weights ----------------------------------------------------


def test_engine_merged_logits_equal_the_peft_model_and_updates_do_not_accumulate(base, tokenizer):
    plain = copy.deepcopy(base)
    w0 = {n: p.detach().clone() for n, p in plain.named_parameters()}
    pm = apply_lora(base, _spec()).eval()
    engine = HFEngine(plain, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    ids = _ids(tokenizer)
    for version, seed in ((1, 1), (2, 2), (3, 2)):  # the last one repeats: an idempotent merge
        _perturb(pm, seed)
        engine.update_weights(adapter_update(pm), version)
        assert engine.version == version
        torch.testing.assert_close(_logits(engine.model, ids), _logits(pm, ids), atol=1e-5, rtol=0)
    # zero adapters give back W0 bit for bit: every merge starts from the base, never from the last one
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.zero_()
    engine.update_weights(adapter_update(pm), 4)
    for n, p in plain.named_parameters():
        assert torch.equal(p, w0[n]), n
    # W0 is kept only for the targeted weights
    assert len(engine._lora.modules) == 4 * 2  # 4 projections x 2 layers
    # a full state dict still works, and a later adapter update merges into those weights
    engine.update_weights({k: v.clone() for k, v in plain.state_dict().items()}, 5)
    assert engine._lora is None


def test_merger_refuses_an_update_that_does_not_fit(base):
    pm = apply_lora(copy.deepcopy(base), _spec(["q_proj"]))
    update = adapter_update(pm)
    bad = AdapterUpdate(
        (update.deltas[0].__class__("model.nope", update.deltas[0].a, update.deltas[0].b, 1.0),)
    )
    with pytest.raises(LoraMergeError, match="model.nope"):
        LoraMerger(base).apply(bad)
    d = update.deltas[0]
    wrong = AdapterUpdate((d.__class__(d.module, d.a[:, :-1], d.b, d.scaling),))
    with pytest.raises(LoraMergeError, match="the weight is"):
        LoraMerger(base).apply(wrong)


# (3) a weight update sends only the adapters ----------------------------------------------------


def test_adapter_update_holds_only_lora_tensors_and_pickles(base):
    n_model = sum(p.numel() for p in base.parameters())
    pm = apply_lora(base, _spec(["q_proj", "v_proj"]))
    _perturb(pm, 3)
    update = adapter_update(pm)
    n_adapters = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    assert update.numel() == n_adapters < n_model / 10
    assert update.nbytes() == 4 * n_adapters  # fp32
    assert {m.rsplit(".", 1)[-1] for m in update.modules} == {"q_proj", "v_proj"}
    assert all(d.scaling == 8.0 / 4 for d in update.deltas)
    # a copy: the optimizer's later steps do not change what was sent
    a0 = update.deltas[0].a.clone()
    _perturb(pm, 4)
    assert torch.equal(update.deltas[0].a, a0)
    # what Ray ships to the rollout workers (`RayRolloutPool.sync_weights`: `.to("cpu")`, pickled)
    back = pickle.loads(pickle.dumps(update.to("cpu")))
    assert back.modules == update.modules
    assert all(torch.equal(x.b, y.b) for x, y in zip(back.deltas, update.deltas, strict=True))


def test_a_rollout_worker_merges_an_adapter_update(tokenizer, base):
    """The worker's path (`RolloutWorker.update_weights` -> engine) after a pickle round trip."""
    from steprl.engines.base import SamplingParams
    from steprl.rollout.chat import PlainFormat
    from steprl.rollout.context import AppendOnly
    from steprl.rollout.loop import Budgets

    ray_workers = pytest.importorskip("steprl.rollout.ray_workers")
    from steprl.envs.registry import get_spec

    worker = ray_workers.RolloutWorker(
        pickle.loads(pickle.dumps(copy.deepcopy(base))),  # what the actor gets from the object store
        PlainFormat(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        envs=ray_workers.WorkerEnvs("calculator"),
        factories={"calculator": get_spec("calculator").factory},
        rule=AppendOnly(),
        sampling=SamplingParams(),
        budgets=Budgets(max_turns=1, max_tokens_per_turn=4),
        engine_settings=EngineSettings(max_batch_size=8),
        version=0,
        torch_threads=torch.get_num_threads(),
    )
    pm = apply_lora(base, _spec()).eval()
    _perturb(pm, 5)
    update = pickle.loads(pickle.dumps(adapter_update(pm).to("cpu")))
    assert asyncio.run(worker.update_weights(update, 1))  # an async actor method
    ids = _ids(tokenizer, 1)
    torch.testing.assert_close(_logits(worker.engine.model, ids), _logits(pm, ids), atol=1e-5, rtol=0)
    assert worker.engine.version == 1


@pytest.mark.e2e
@pytest.mark.soak  # a Ray cluster and worker for one merge (60 s); the adapter's Ray transport and the
# worker's merge are each checked in make test (test_weight_sync.py, the test above)
def test_ray_rollout_pool_syncs_adapter_updates(tokenizer):
    """`RayRolloutPool.sync_weights(AdapterUpdate)`: the worker merges into its base copy and rolls
    out exactly what an in-process engine with the same merge does."""
    ray = pytest.importorskip("ray")
    import asyncio
    from itertools import islice

    from steprl.engines.base import SamplingParams
    from steprl.envs.registry import make_env, make_tasks
    from steprl.rollout.chat import PlainFormat
    from steprl.rollout.context import AppendOnly
    from steprl.rollout.loop import Budgets, RolloutSetup, rollout_groups
    from steprl.rollout.ray_workers import RayRolloutPool, WorkerEnvs

    model = _llama(tokenizer).eval()
    plain = copy.deepcopy(model)
    pm = apply_lora(model, _spec()).eval()
    _perturb(pm, 10)
    update = adapter_update(pm)
    fmt, rule, sampling = PlainFormat(tokenizer), AppendOnly(), SamplingParams()
    budgets = Budgets(max_turns=2, max_tokens_per_turn=8)
    tasks = list(islice(make_tasks("calculator", "train", 1), 2))
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        pool = RayRolloutPool(
            copy.deepcopy(plain),
            fmt,
            pad_token_id=tokenizer.pad_token_id,
            num_workers=1,
            envs=WorkerEnvs("calculator"),
            rule=rule,
            sampling=sampling,
            budgets=budgets,
            engine_settings=EngineSettings(seed=5),
            torch_threads=torch.get_num_threads(),  # same thread count: the same bits
        )
        try:
            before = pool.rollout_groups(tasks, 2, seed=3)
            pool.sync_weights(update, version=1)
            after = pool.rollout_groups(tasks, 2, seed=3)
        finally:
            pool.close()
    finally:
        if started:
            ray.shutdown()
    engine = HFEngine(
        copy.deepcopy(plain), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, seed=5
    )
    engine.update_weights(update, 1)
    setup = RolloutSetup(lambda t: make_env("calculator"), engine, fmt, rule, sampling, budgets)
    assert after == asyncio.run(rollout_groups(tasks, 2, setup, seed=3))
    assert after != before
    assert {s.policy_version for g in after for t in g.trajectories for s in t.steps} == {1}


# (4) the KL reference is the base, adapters off ---------------------------------------------------


def test_adapters_disabled_gives_the_base_and_leaves_the_policy_alone(base, tokenizer):
    plain = copy.deepcopy(base)
    pm = apply_lora(base, _spec()).train()
    _perturb(pm, 6)
    ref = AdaptersDisabled(pm).eval().to("cpu")
    assert pm.training  # .eval() on the reference does not reach the policy
    assert list(ref.parameters()) == []  # and no weights of its own
    assert device_of(ref) == torch.device("cpu")  # so the step rewards ask its head where it runs
    ids = _ids(tokenizer, 2)
    assert not torch.allclose(_logits(pm, ids), _logits(plain, ids), atol=1e-3)  # the adapters matter
    torch.testing.assert_close(_logits(ref, ids), _logits(plain, ids), atol=1e-6, rtol=0)
    assert pm.training and all(m.training for m in pm.modules())  # modes restored after the forward
    # what the learner calls: chunked log-probs from hidden states + get_output_embeddings()
    attention = torch.ones_like(ids)
    with torch.no_grad():
        lp_ref, _ = token_logprobs(ref, ids, attention)
        lp_base, _ = token_logprobs(plain, ids, attention)
    torch.testing.assert_close(lp_ref, lp_base, atol=1e-5, rtol=0)
    assert ref.config is pm.config
    # the adapters still train after the reference ran (peft toggles requires_grad)
    assert all(p.requires_grad for n, p in pm.named_parameters() if "lora_" in n)


# (5) a target the model does not have ----------------------------------------------------------


def test_unknown_target_module_is_one_line_listing_the_linear_modules(base):
    with pytest.raises(LoraConfigError) as info:
        apply_lora(base, _spec(["q_proj", "query", "lm_head"]))
    msg = str(info.value)
    assert "\n" not in msg
    assert "query, lm_head" in msg
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert name in msg
    assert "lm_head," not in msg.split("Linear modules:")[1]  # the head is not offered
    with pytest.raises(LoraConfigError, match="is empty"):
        apply_lora(base, _spec([]))
    assert not any("lora" in n for n, _ in base.named_modules())  # nothing was injected


# (6) checkpoints: adapters that name their base -------------------------------------------------


def _save(pm, root, tokenizer):
    learner = _learner(pm)
    return save_checkpoint(
        root,
        1,
        write_model=functools.partial(write_model, pm),
        tokenizer=tokenizer,
        state={"optimizer": learner.optimizer.state_dict()},
        config_yaml="x: 1\n",
        keep_last=1,
    )


def test_checkpoint_of_an_in_memory_base_saves_it_and_round_trips(base, tokenizer, tmp_path):
    pm = apply_lora(base, _spec()).eval()
    _perturb(pm, 7)
    ids = _ids(tokenizer, 3)
    want = _logits(pm, ids)
    for _ in range(2):  # the second save replaces the first (and its base copy) atomically
        ckpt = _save(pm, tmp_path / "checkpoints", tokenizer)
    assert (ckpt / "adapter_model.safetensors").exists() and not (ckpt / "model.safetensors").exists()
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((ckpt / "base").resolve())
    assert config["r"] == 4 and sorted(config["target_modules"]) == sorted(ATTN)
    state = torch.load(ckpt / "state.pt", weights_only=False)
    n_adapter_tensors = sum(1 for p in pm.parameters() if p.requires_grad)
    assert len(state["optimizer"]["param_groups"][0]["params"]) == n_adapter_tensors
    # back: the named base + the adapters, as peft loads them, and merged for generation
    loaded = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]), ckpt
    ).eval()
    torch.testing.assert_close(_logits(loaded, ids), want, atol=1e-5, rtol=0)
    merged = load_checkpoint_model(ckpt)
    assert not is_peft(merged)
    torch.testing.assert_close(_logits(merged, ids), want, atol=1e-5, rtol=0)
    assert pm.peft_config["default"].base_model_name_or_path is None  # the run's config is untouched


def test_checkpoint_of_a_saved_base_names_its_directory(base, tokenizer, tmp_path):
    base.save_pretrained(tmp_path / "base_model")
    loaded_base = AutoModelForCausalLM.from_pretrained(tmp_path / "base_model")
    pm = apply_lora(loaded_base, _spec(["q_proj", "v_proj"])).eval()
    _perturb(pm, 8)
    ckpt = _save(pm, tmp_path / "checkpoints", tokenizer)
    assert not (ckpt / "base").exists()
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "base_model").resolve())
    ids = _ids(tokenizer, 4)
    torch.testing.assert_close(_logits(load_checkpoint_model(ckpt), ids), _logits(pm, ids), atol=1e-5, rtol=0)


# dtypes: fp32 adapters over a bf16 base --------------------------------------------------------


def test_bf16_base_keeps_fp32_adapters_and_the_engine_merges_into_bf16(tokenizer):
    model = _llama(tokenizer).to(torch.bfloat16).eval()
    plain = copy.deepcopy(model)
    pm = apply_lora(model, _spec()).eval()
    assert {p.dtype for p in pm.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in pm.parameters() if not p.requires_grad} == {torch.bfloat16}
    _perturb(pm, 9)
    update = adapter_update(pm)
    w0 = plain.get_submodule(update.deltas[0].module).weight.detach().clone()
    engine = HFEngine(plain, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    engine.update_weights(update, 1)
    d = update.deltas[0]
    merged = plain.get_submodule(d.module).weight
    assert merged.dtype == torch.bfloat16
    assert torch.equal(merged, (w0.float() + d.scaling * d.b @ d.a).to(torch.bfloat16))  # one rounding
    ids = _ids(tokenizer, 5)
    torch.testing.assert_close(_logits(plain, ids), _logits(pm, ids), atol=0.1, rtol=0.05)


# (7) end to end ------------------------------------------------------------------------------


LORA = ["model.init=scratch", "model.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj]}"]


@pytest.mark.e2e
def test_lora_training_run_keeps_engine_and_learner_logprobs_equal(tmp_path):
    """Two steps with a KL term (the reference: the base, adapters off), on the tiny model."""
    from steprl.training.loop.trainer import train

    extra = [*LORA, "algorithm.kl_coef=0.1", "trainer.eval_tasks=4", "logging.tensorboard=false"]
    lines: list[str] = []
    result = train(small_config(tmp_path, "lora", extra), log=lines.append)
    assert any(line.startswith("LoRA r=4") for line in lines)
    assert len(result.history) == 2
    for m in result.history:
        assert m["traj/in"] == m["traj/out"]
        # step 2 samples from the engine's merge of step 1's adapters: the merge's fidelity
        # (without the merge this is ~3e-2 at step 2, measured)
        assert m["actor/engine_logprob_diff_max"] < 1e-4
        assert m["actor/optimizer_steps"] > 0
        assert 0.0 <= m["actor/kl_to_ref"] < 1.0
    assert result.history[1]["actor/kl_to_ref"] > 0.0  # the policy has moved off its base
    ckpt = (result.run_dir / "checkpoints" / "latest").resolve()
    assert (ckpt / "adapter_model.safetensors").exists() and (ckpt / "base" / "config.json").exists()
    trained = load_checkpoint_model(ckpt)
    base = AutoModelForCausalLM.from_pretrained(ckpt / "base")
    changed = {
        n
        for (n, p), (_, q) in zip(trained.named_parameters(), base.named_parameters(), strict=True)
        if not torch.equal(p, q)
    }
    assert changed and all(n.endswith(("q_proj.weight", "v_proj.weight")) for n in changed)
