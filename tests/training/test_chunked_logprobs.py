"""Chunked log-probs (training/learn/batching.py) equal the full (B, T, V) computation they replace.

`full_logprobs` is the old path, kept here as the reference: full logits, fp32, / temperature,
log-softmax over the whole vocabulary.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from steprl.errors import UserError
from steprl.training.learn.batching import last_hidden, logprobs_at, token_logprobs

B, T = 3, 12


def full_logprobs(model, input_ids, attention, temperature=1.0):
    """The old path: (B, T-1, V) fp32 logits. Returns logp, entropy: (B, T-1) at every position."""
    logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1, :].float()
    if temperature > 0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _sharpen(model: nn.Module, scale: float) -> nn.Module:
    """Random init gives near-uniform predictions; bigger head weights test a real distribution."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    return model


def make_model(arch: str, vocab: int = 32_768) -> nn.Module:
    torch.manual_seed(0)
    small = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    if arch == "llama":
        model: nn.Module = LlamaForCausalLM(LlamaConfig(**small, tie_word_embeddings=True))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**small, head_dim=16, tie_word_embeddings=False))
    elif arch in ("gemma3", "gemma3_capped"):
        cap = 3.0 if arch == "gemma3_capped" else None  # small: tanh is far from linear here
        cfg = Gemma3TextConfig(
            **small, head_dim=16, sliding_window=4, query_pre_attn_scalar=16, final_logit_softcapping=cap
        )
        model = Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    return _sharpen(model, 20.0).eval()


def make_batch(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids (B, T), attention (B, T) and a random target-aligned mask (B, T-1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (B, T), generator=g)
    lengths = torch.tensor([T, T - 3, 5])
    attention = (torch.arange(T)[None, :] < lengths[:, None]).long()
    ids = ids * attention  # pad id 0
    mask = (torch.rand(B, T - 1, generator=g) < 0.6) & (attention[:, 1:] > 0)
    return ids, attention, mask.float()


ARCHS = ["llama", "qwen3", "gemma3", "gemma3_capped"]
shared_eval_model = functools.cache(make_model)  # for tests that only read the model


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk_size", [1, 7, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_full(arch, chunk_size, temperature):
    model = shared_eval_model(arch)
    ids, attn, mask = make_batch(model.config.vocab_size)
    n = int(mask.sum())
    assert n % 7 != 0  # 7 does not divide N: a short last chunk
    with torch.no_grad():
        ref_lp, ref_ent = full_logprobs(model, ids, attn, temperature)
        lp, ent = token_logprobs(model, ids, attn, temperature, mask=mask, chunk_size=chunk_size)
    on = mask.bool()
    assert lp.shape == ent.shape == (B, T - 1) and lp.dtype == torch.float32
    assert (ref_ent[on] < torch.log(torch.tensor(float(model.config.vocab_size))) - 0.5).all()  # not uniform
    # one chunk of all N rows is bit-identical; a smaller chunk picks another matmul kernel and
    # moves a logit by an fp32 ulp (2e-6 at the |logits| ~ 30 of these sharpened heads)
    torch.testing.assert_close(lp[on], ref_lp[on], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent[on], ref_ent[on], atol=1e-5, rtol=0)
    if chunk_size is None:
        assert torch.equal(lp[on], ref_lp[on]) and torch.equal(ent[on], ref_ent[on])
    assert (lp[~on] == 0).all() and (ent[~on] == 0).all()


@pytest.mark.parametrize("chunk_size", [1, 7, None])
def test_default_mask_is_every_real_target(small_model, tokenizer, chunk_size):
    """The embedded tiny model (the default demo's policy) with no mask: every unpadded target."""
    ids, attn, _ = make_batch(len(tokenizer))
    with torch.no_grad():
        ref_lp, ref_ent = full_logprobs(small_model, ids, attn, 1.0)
        lp, ent = token_logprobs(small_model, ids, attn, 1.0, chunk_size=chunk_size)
    real = attn[:, 1:].bool()
    if chunk_size is None:  # the default: all of a micro-batch in one chunk, bit-identical
        assert torch.equal(lp[real], ref_lp[real]) and torch.equal(ent[real], ref_ent[real])
    # 1e-6 relative: two fp32 ulps of an entropy near log(117) = 4.8
    torch.testing.assert_close(lp[real], ref_lp[real], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent[real], ref_ent[real], atol=1e-6, rtol=1e-6)
    assert (lp[~real] == 0).all()


def _loss(lp, ent, mask, terms="both"):
    """A weighted sum over the mask: of log-probs, entropies or both (the learner's cases)."""
    w = torch.linspace(0.5, 1.5, mask.numel()).reshape(mask.shape)
    total = {"logp": w * lp, "entropy": 0.3 * ent, "both": w * lp + 0.3 * ent}[terms]
    return (total * mask).sum()


def _assert_grads_close(got: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    """Within 1e-4 of the tensor's largest entry: chunked fp32 sums reorder the accumulation (1e-5 seen)."""
    torch.testing.assert_close(got, ref, atol=1e-4 * float(ref.abs().max()), rtol=1e-4, msg=name)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("terms", ["logp", "entropy", "both"])
def test_gradients_equal_full(arch, terms):
    model = make_model(arch).train()
    ids, attn, mask = make_batch(model.config.vocab_size)
    _loss(*full_logprobs(model, ids, attn, 0.8), mask, terms).backward()
    ref = _grads(model)
    model.zero_grad(set_to_none=True)
    _loss(*token_logprobs(model, ids, attn, 0.8, mask=mask, chunk_size=5), mask, terms).backward()
    got = _grads(model)
    assert ref.keys() == got.keys() and len(got) > 5
    for name, g in ref.items():
        _assert_grads_close(got[name], g, name)


def test_empty_mask_still_backpropagates():
    model = make_model("llama").train()
    ids, attn, mask = make_batch(model.config.vocab_size)
    lp, ent = token_logprobs(model, ids, attn, mask=torch.zeros_like(mask))
    assert (lp == 0).all() and lp.requires_grad
    _loss(lp, ent, mask).backward()  # a micro-batch with no trained token: zero grads, no error


class _ShapeLog(TorchDispatchMode):
    """Records the shape of every tensor any aten op returns (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def test_no_btv_tensor_is_made():
    """Forward and backward: the head sees chunks only, the model's own logits are (B, 1, V)."""
    model = make_model("gemma3").train()
    vocab, chunk = model.config.vocab_size, 4
    ids, attn, mask = make_batch(vocab)
    seen: list[tuple[int, ...]] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    try:
        with _ShapeLog() as log:
            _loss(*token_logprobs(model, ids, attn, mask=mask, chunk_size=chunk), mask).backward()
    finally:
        hook.remove()
    assert seen == [(B, 1, vocab)]  # the model's own head ran on the last position only
    with_vocab = [s for s in log.shapes if vocab in s and sorted(s) != sorted((vocab, 32))]  # not W, dW
    assert with_vocab, "the dispatch log saw the head's outputs"
    assert max(torch.Size(s).numel() for s in with_vocab) <= max(chunk, B) * vocab


def test_non_linear_head_runs_its_own_forward_in_chunks():
    """A head that is not an nn.Linear (a peft LoRA layer on lm_head) is called per chunk."""
    peft = pytest.importorskip("peft")
    model = make_model("qwen3")
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
    )
    lora.eval()  # a training-mode head of its own is not checked: its dropout may differ per call
    head = lora.get_output_embeddings()
    assert not isinstance(head, nn.Linear)
    ids, attn, mask = make_batch(model.config.vocab_size)
    rows: list[int] = []
    hook = head.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[0]))
    try:
        with torch.no_grad():
            ref_lp, ref_ent = full_logprobs(lora, ids, attn)
            rows.clear()
            lp, ent = token_logprobs(lora, ids, attn, mask=mask, chunk_size=6)
    finally:
        hook.remove()
    on = mask.bool()
    torch.testing.assert_close(lp[on], ref_lp[on], atol=1e-5, rtol=0)  # ulps, as above
    torch.testing.assert_close(ent[on], ref_ent[on], atol=1e-5, rtol=0)
    # B = 3 rows twice (its own last-position call, the head check), then chunks of <= 6
    assert rows[:2] == [B, B] and len(rows) > 3 and max(rows) <= 6


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "lm_head"]])
def test_peft_lora_gradients_equal_full(targets):
    """Adapters only; with lm_head adapted the head is peft's layer, differentiated through its forward."""
    peft = pytest.importorskip("peft")
    base = make_model("qwen3")
    config = peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False)  # B != 0: real grads
    model = peft.get_peft_model(base, config)
    model.train()
    ids, attn, mask = make_batch(base.config.vocab_size)
    _loss(*full_logprobs(model, ids, attn), mask).backward()
    ref = _grads(model)
    model.zero_grad(set_to_none=True)
    _loss(*token_logprobs(model, ids, attn, mask=mask, chunk_size=3), mask).backward()
    got = _grads(model)
    assert ref.keys() == got.keys() and all("lora" in n for n in got)
    assert any("lm_head" in n for n in got) == ("lm_head" in targets)
    for name, g in ref.items():
        _assert_grads_close(got[name], g, name)


def test_bf16_model_trains_through_the_fp32_head():
    model = make_model("gemma3").to(torch.bfloat16).train()
    ids, attn, mask = make_batch(model.config.vocab_size)
    _loss(*token_logprobs(model, ids, attn, mask=mask, chunk_size=4), mask).backward()
    head = model.get_output_embeddings().weight
    assert head.grad is not None and head.grad.dtype == torch.bfloat16 and head.grad.abs().sum() > 0


def test_bf16_model_gives_fp32_logprobs_close_to_fp32():
    fp32 = make_model("gemma3")
    bf16 = make_model("gemma3").to(torch.bfloat16)
    ids, attn, mask = make_batch(fp32.config.vocab_size)
    with torch.no_grad():
        lp32, ent32 = token_logprobs(fp32, ids, attn, mask=mask)
        lp16, ent16 = token_logprobs(bf16, ids, attn, mask=mask)
    on = mask.bool()
    assert lp16.dtype == ent16.dtype == torch.float32
    # the bf16 backbone is what differs: its hidden states carry ~3 significant digits
    torch.testing.assert_close(lp16[on], lp32[on], atol=0.15, rtol=0.02)
    torch.testing.assert_close(ent16[on], ent32[on], atol=0.15, rtol=0.02)


class _ScaledLogits(nn.Module):
    """A model whose forward rescales its logits (like Cohere's logit_scale): not reproducible."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def get_output_embeddings(self) -> nn.Module:
        return self.inner.get_output_embeddings()

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        out.logits = out.logits * 0.0625
        return out


def test_a_model_whose_logits_cannot_be_reproduced_fails_loudly():
    model = _ScaledLogits(make_model("llama"))
    ids, attn, mask = make_batch(model.config.vocab_size)
    with pytest.raises(UserError, match="_ScaledLogits.*own logits"), torch.no_grad():
        token_logprobs(model, ids, attn, mask=mask)


def test_last_hidden_is_after_the_final_norm():
    """hidden_states[-1] of each architecture already has the final norm (the head's input)."""
    for arch in ("llama", "qwen3", "gemma3"):
        model = shared_eval_model(arch)
        ids, attn, mask = make_batch(model.config.vocab_size)
        with torch.no_grad():
            hidden = last_hidden(model, ids, attn)
            full = model(input_ids=ids, attention_mask=attn).logits
            lp, _ = logprobs_at(model, hidden, ids, torch.ones_like(mask))
        torch.testing.assert_close(model.get_output_embeddings()(hidden), full, atol=1e-5, rtol=1e-5)
        ref = torch.log_softmax(full[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        torch.testing.assert_close(lp, ref, atol=1e-6, rtol=0)


class _DropoutHeadModel(nn.Module):
    """Just what `logprobs_at` reads: a head (dropout, then a Linear) and a config."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Dropout(0.5), nn.Linear(hidden, vocab))
        self.config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_attention_heads=1)

    def get_output_embeddings(self) -> nn.Module:
        return self.head


def test_a_head_with_dropout_gets_the_forward_masks_gradient():
    """The backward recompute replays the forward's random state: same mask, exact gradient."""
    model = _DropoutHeadModel(16, 50).train()
    ids, _, mask = make_batch(50)
    hidden = torch.randn(B, T, 16, requires_grad=True)
    torch.manual_seed(1)
    sel = mask.bool()
    logp_all = torch.log_softmax(model.head(hidden[:, :-1][sel]), -1)
    ref = logp_all.gather(-1, ids[:, 1:][sel][:, None]).sum() - (logp_all.exp() * logp_all).sum()
    ref_grads = torch.autograd.grad(ref, [hidden, model.head[1].weight])
    torch.manual_seed(1)
    lp, ent = logprobs_at(model, hidden, ids, mask)  # one chunk: one mask drawn, as above
    torch.testing.assert_close(lp.sum() + ent.sum(), ref)
    grads = torch.autograd.grad(lp.sum() + ent.sum(), [hidden, model.head[1].weight])
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
