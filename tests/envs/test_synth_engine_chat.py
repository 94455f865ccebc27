"""An LLM user and an LLM tool writer served by a steprl engine in the env's own process
(`envs/synth/engine_chat.py`), with no endpoint: a real `LlamaForCausalLM` and tokenizer saved as
a Hugging Face directory (random weights: what an untrained or confused LLM says)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

import cli_zygote
from steprl.envs.registry import get_spec
from steprl.envs.synth import SynthSpecError

ROOT = Path(__file__).resolve().parents[2]
SHOP = ROOT / "configs" / "synth" / "shop.yaml"
TEMPLATE = ROOT / "configs" / "templates" / "tiny_chat.jinja"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from steprl.models.tiny import TinyModelSpec, build_model, build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = TEMPLATE.read_text()
    model = build_model(
        len(tok),
        TinyModelSpec(max_positions=4096),  # the writer's prompt is ~2k characters
        seed=0,
        pad_id=tok.pad_token_id,
        bos_id=tok.bos_token_id,
        eos_id=tok.eos_token_id,
    )
    out = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_an_engine_user_answers_in_process_and_its_mistakes_are_marked(model_dir: Path) -> None:
    """`user: {engine: hf, model: DIR}`: the reply is the model's own greedy continuation of the
    conversation its chat template renders (as `generate` gives it), sent as a user turn; a reply
    that does not state the hidden value is marked user_error (ERPO masks it)."""
    import torch
    from openai_test_server import ask_the_user_once
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from steprl.envs.synth.users import _messages

    user = {"engine": "hf", "model": str(model_dir), "chat_template": str(TEMPLATE), "max_tokens": 24}
    params = {"spec": str(SHOP), "ask_user": 1.0, "user_error_rate": 0.0, "user": user}
    _, task, env, reply = ask_the_user_once(params)
    assert reply.info["role"] == "user" and reply.info["user_error"] is True

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    text = tok.apply_chat_template(
        _messages(task.prompt, "which value?", task.params["intent"]),
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=tok.eos_token_id)
    expected = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
    assert expected and reply.observation == expected

    # a reply past timeout_s is cancelled with one line; the engine then serves the next one
    from steprl.envs.synth.engine_chat import EngineChat

    slow = EngineChat("hf", str(model_dir), str(TEMPLATE), timeout_s=1e-4)
    messages = _messages(task.prompt, "which value?", task.params["intent"])
    with pytest.raises(TimeoutError, match="on engine hf gave no reply in 0.0001 s"):
        slow.complete(messages, temperature=0.0, max_tokens=200)
    assert (
        EngineChat("hf", str(model_dir), str(TEMPLATE)).complete(messages, temperature=0.0, max_tokens=24)
        == expected
    )

    for bad, says in (
        ({"engine": "trt", "model": "x"}, "env.params.user.engine: one of hf, vllm, got 'trt'"),
        ({"engine": "hf"}, "env.params.user.model: required with engine"),
        ({"engine": "hf", "model": "x", "base_url": "u"}, "env.params.user.base_url: unknown with engine"),
        ({"engine": "hf", "model": "x", "dtype": "int4"}, "env.params.user.dtype: one of float32, bfloat16"),
        (
            {"engine": "hf", "model": "x", "timeout_s": "soon"},
            "env.params.user.timeout_s: a number of at least",
        ),
        (
            {"engine": "hf", "model": "x", "max_tokens": 6.5},
            "env.params.user.max_tokens: an int of at least 1",
        ),
        (
            {"engine": "hf", "model": "no/such-model"},
            "env.params.user: cannot serve 'no/such-model' on engine hf",
        ),
    ):
        with pytest.raises(SynthSpecError, match=f"^{says}"):
            get_spec("synth", {**params, "user": bad})


def test_an_engine_writer_from_the_plain_cli(model_dir: Path, tmp_path: Path) -> None:
    """`steprl synth SPEC -o DIR --writer-engine hf --writer-model DIR`: the model in process is
    asked for a `template: written` tool's code; a model that never writes code that passes the
    checks ends in one line after its attempts; the flags' misuse is one line too."""
    from openai_test_server import TRANSFER_STOCK

    raw = yaml.safe_load(SHOP.read_text())
    raw["tools"].append(dict(TRANSFER_STOCK))
    (tmp_path / "shop2.yaml").write_text(yaml.safe_dump(raw))
    steprl = [sys.executable, "-c", "from steprl.cli import main; main()", "synth", "shop2.yaml", "-o", "out"]
    for flags, says in (
        (["--writer-engine", "hf", "--writer-model", str(model_dir)], "failed its checks 3 times"),
        (["--writer-engine", "hf"], "--writer-model goes with either --writer-url"),
        (["--writer-engine", "tpu", "--writer-model", "m"], "--writer-engine: one of hf, vllm, got 'tpu'"),
    ):
        done = cli_zygote.run([*steprl, *flags], cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 2 and says in done.stdout, done.stdout + done.stderr
        assert done.stdout.strip().count("\n") == 0
    assert not (tmp_path / "out").exists()
