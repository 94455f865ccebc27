"""`steprl serve-policy CONFIG`: the config's policy behind the gateway (`steprl.gateway`), an
OpenAI-compatible endpoint on loopback, for a harness to call and a person to try.

The model is `model.name` loaded as a run loads it (`load_policy`: a HF directory, a Hub id,
the Qwen3 test bed, Gemma-3-270M; `model.init`, LoRA), served by the run's engine (`engine_for`)
and rendered with its chat template (a model without one, like the tiny model, is one line).
The API key is `$STEPRL_GATEWAY_TOKEN`, or a fresh one printed at start; `<key>.<session>` keys
a session per harness episode. Every call's exact ids and log-probs are recorded in memory
(`Gateway.sessions`, the oldest dropped past `max_sessions`); `gateway/*` metrics go to the log
on exit.

The server is hardened as `serve-env` is (`server_config`): loopback `Host` names only, the body
capped from the model's context, a deadline on headers; on SIGTERM calls in flight get
`GRACE_S`, then are cancelled (their generations stop between two tokens) and it exits 0.
"""

from __future__ import annotations

import gc
import os
import secrets
import signal
from collections.abc import Callable
from typing import Any

from steprl.config import Config
from steprl.errors import UserError
from steprl.gateway.policy_gateway import Gateway
from steprl.hosting import security
from steprl.rollout.chat_format import ChatFormat
from steprl.training.setup import env_setup
from steprl.training.setup.policy import load_policy
from steprl.training.setup.rollout_parts import engine_for

TOKEN_VAR = "STEPRL_GATEWAY_TOKEN"
#: on SIGTERM, calls in flight get this long to finish before they are cancelled
GRACE_S = 2
#: a request's headers must arrive within this (slowloris: `security.header_deadline_protocol`)
HEADER_TIMEOUT_S = 10.0


def build_gateway(cfg: Config, log: Callable[[str], None] = print) -> Gateway:
    if cfg.model.name == "tiny" and cfg.model.chat_template is None:
        raise UserError(
            "serve-policy: the tiny model has no chat template to render a harness's messages; give one "
            "with model.chat_template, or serve a chat model (e.g. model.name=qwen3-testbed)"
        )
    if cfg.model.init == "sft":
        raise UserError(
            "serve-policy: model.init=sft trains a warm start on an env's demonstrations first; serve the "
            "model as it is with model.init=pretrained"
        )
    policy = load_policy(cfg, log)
    fmt = env_setup.prompt_format(cfg, policy.tokenizer)
    if not isinstance(fmt, ChatFormat):
        raise UserError(
            f"serve-policy: model {cfg.model.name!r} has no chat template to render a harness's messages; "
            "give one with model.chat_template, or serve a chat model (e.g. model.name=qwen3-testbed)"
        )
    # prompt + completion must fit the positions the model has (a vLLM engine holds fewer)
    context = int(policy.model.config.max_position_embeddings)
    engine = engine_for(cfg, policy.model, policy.tokenizer)
    return Gateway(engine, fmt, cfg.model.name, context=min(context, engine.max_positions or context))


def server_config(gateway: Gateway, token: str, port: int) -> Any:
    """The uvicorn.Config that serves `gateway` on 127.0.0.1:`port`, as `serve-env` serves envs."""
    import uvicorn

    from steprl.gateway.app import make_app

    return uvicorn.Config(
        make_app(gateway, token, hosts=security.LOOPBACK_HOSTS, port=port),
        host="127.0.0.1",
        port=port,
        http=security.header_deadline_protocol(HEADER_TIMEOUT_S),
        ws="none",
        log_level="warning",
        access_log=False,  # URLs in a log are where keys leak
        proxy_headers=False,  # nothing sits in front of a loopback server: trust no X-Forwarded-*
        server_header=False,
        timeout_graceful_shutdown=GRACE_S,
    )


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)  # uvicorn re-raises the SIGTERM it caught once it has shut down


def serve_policy(cfg: Config, port: int, log: Callable[[str], None] = print) -> None:
    import uvicorn

    token = os.environ.get(TOKEN_VAR) or secrets.token_urlsafe(24)
    gateway = build_gateway(cfg, log)
    if not os.environ.get(TOKEN_VAR):
        log(f"API key (set {TOKEN_VAR} to choose it): {token}")
    log(f"serving {cfg.model.name} at http://127.0.0.1:{port}/v1 (OpenAI chat and completions API)")
    signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        uvicorn.Server(server_config(gateway, token, port)).run()
    finally:  # a SIGTERM ends here too, as SystemExit(0)
        if hasattr(gateway.engine, "close"):  # a vLLM engine's worker process
            gateway.engine.close()
        log(" ".join(f"{k}={v:.3f}" for k, v in gateway.metrics().items()))
        # the interpreter's last garbage collection walks every object the model and its
        # libraries made (measured: 10 s on a busy 2-core machine); the process is ending
        gc.freeze()
