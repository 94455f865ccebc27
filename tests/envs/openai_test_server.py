"""An OpenAI-compatible `/v1/chat/completions` on loopback for the tests of the LLM-backed
simulated user and the LLM tool writer (test_synth.py).

Models behind it: `tiny`, steprl's real tiny `LlamaForCausalLM` (random weights: what an
untrained or confused LLM says) run with `generate`; `echo`, a rule that states what the system
prompt says the user has in mind (an LLM that follows its instructions); `coder`, a rule that
answers a tool-writing prompt with code that writes the wrong table, and after feedback with
code that works (an LLM that fixes its mistake). The tests check what steprl does with each
answer, not a model's quality.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request

from steprl.hosting.local_server import free_port

#: A shop tool no template expresses (`template: written`, no code): what the writers are asked for.
TRANSFER_STOCK: dict[str, Any] = {
    "name": "transfer_stock",
    "description": "Move units of stock from one product to another.",
    "parameters": {
        "type": "object",
        "properties": {
            "from_sku": {"type": "string", "x-type": "sku"},
            "to_sku": {"type": "string", "x-type": "sku"},
            "qty": {"type": "integer", "x-type": "int"},
        },
    },
    "writes": ["products.stock"],
    "template": "written",
    "phrase": "move {qty} units of stock from {from_sku} to {to_sku}",
}

CODE_FIXED = """Here it is:
```python
def call(world, args):
    products = world["products"]
    for key in (args["from_sku"], args["to_sku"]):
        if key not in products:
            raise ToolError(f"no product {key}")
    products[args["from_sku"]]["stock"] -= int(args["qty"])
    products[args["to_sku"]]["stock"] += int(args["qty"])
    return str(products[args["to_sku"]]["stock"])
```"""
CODE_WRONG_TABLE = CODE_FIXED.replace("return str(", 'world["customers"].clear()\n    return str(')


def ask_the_user_once(params: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """A synth env from `params`, reset on its first train task, after one `ask_user` call: (the
    env spec, the task, the env, the user's reply), what the simulated-user tests start from."""
    from steprl.envs.registry import get_spec
    from steprl.envs.synth.env import render_call

    spec = get_spec("synth", params)
    task = next(spec.tasks("train", 0))
    env = spec.factory(**params)
    env.reset(task, 0)
    return spec, task, env, env.step(render_call("ask_user", {"question": "which value?"}))


def _app() -> FastAPI:
    import torch

    from steprl.models.tiny import TinyModelSpec, build_model, build_tokenizer

    tok = build_tokenizer()
    model = build_model(
        len(tok),
        TinyModelSpec(),
        seed=0,
        pad_id=tok.pad_token_id,
        bos_id=tok.bos_token_id,
        eos_id=tok.eos_token_id,
    ).eval()
    app = FastAPI()
    app.state.requests = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        body = await request.json()
        app.state.requests.append(body)
        system, question = body["messages"][0]["content"], body["messages"][-1]["content"]
        if body["model"] == "coder":
            text = CODE_FIXED if len(body["messages"]) > 1 else CODE_WRONG_TABLE
        elif body["model"] == "echo":
            mind = re.search(r"What you have in mind: (.*?)\. Answer", system)
            text = (mind.group(1) if mind else "I do not know") + "."
            text = text[0].upper() + text[1:]
        else:
            ids = tok(question, return_tensors="pt").input_ids[:, -64:]
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=int(body.get("max_tokens", 16)), do_sample=False)
            text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        return {
            "id": "u",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        }

    return app


@contextlib.contextmanager
def chat_server() -> Iterator[tuple[str, FastAPI]]:
    """The server on a free loopback port, in a thread; yields (base_url, app)."""
    app, port = _app(), free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1", app
    finally:
        server.should_exit = True
        thread.join(10)
