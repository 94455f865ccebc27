"""steprl side by side with its peers, alternating A B A B in one process; prints medians and ratios.

(a) TRL `GRPOTrainer` vs steprl's RL step at TRL's baseline shape (`peer_shape.SHAPE`), with
    (c) the bare-torch floor at that shape: a plain KV-cached sampling loop plus one forward and
    backward; and the reward curve of each side over `--curve` steps.
(b) the multi-turn rollout: HF `generate` called once per turn (all episodes batched, the whole
    context re-prefilled each turn) vs steprl's engine under its agent loop, in sampled tokens/s.

TRL is not a steprl dependency; it lives in a bench venv (TRL 1.16.0 + transformers 5.24.0 and
the CPU torch worked here). Make it and run:

    make bench-venv          # .venv-bench: torch CPU, steprl, trl==1.16.0, datasets
    .venv-bench/bin/python benchmarks/vs_peers.py [--rounds 3] [--steps 8] [--curve 30] [--only a,b]

Without TRL installed, (a) reports steprl and the floor only. Run it on a quiet machine (nothing
else on the cores): the numbers are medians over rounds, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_shape import LONG_TAIL_SPEC, MULTI_TURN_SPEC, PROMPTS, SHAPE, digit_share  # noqa: E402
from steprl.config import load_config  # noqa: E402
from steprl.engines.base import SamplingParams  # noqa: E402
from steprl.engines.hf import HFEngine  # noqa: E402
from steprl.models.tiny import TinyModelSpec, build_model, build_tokenizer  # noqa: E402
from steprl.rollout.chat import PlainFormat  # noqa: E402
from steprl.rollout.context import AppendOnly  # noqa: E402
from steprl.rollout.loop import Budgets, RolloutSetup, rollout_groups  # noqa: E402
from steprl.training.loop.trainer import run_step, start_pipeline  # noqa: E402
from steprl.training.setup import env_setup  # noqa: E402
from steprl.training.setup.build import build  # noqa: E402
from steprl.training.state import RngState, TrainState  # noqa: E402

TOKENIZER = build_tokenizer()


def fresh_model(seed: int) -> torch.nn.Module:
    spec = TinyModelSpec(hidden_size=SHAPE.hidden, num_layers=SHAPE.layers, num_heads=SHAPE.heads)
    spec = TinyModelSpec(**{**asdict(spec), "intermediate_size": SHAPE.ffn})
    t = TOKENIZER
    return build_model(
        len(t), spec, seed=seed, pad_id=t.pad_token_id, bos_id=t.bos_token_id, eos_id=t.eos_token_id
    )


# ---- (a) steprl: the trainer's own run_step on built parts ------------------------------------
def steprl_overrides(tmp: str, seed: int) -> list[str]:
    return [
        f"run.output_dir={tmp}",
        "run.name=vs_peers",
        "run.overwrite=true",
        f"run.seed={seed}",
        "model.name=tiny",
        "model.init=scratch",
        f"model.tiny.hidden_size={SHAPE.hidden}",
        f"model.tiny.num_layers={SHAPE.layers}",
        f"model.tiny.num_heads={SHAPE.heads}",
        f"model.tiny.intermediate_size={SHAPE.ffn}",
        "env.name=peer_shape:SPEC",
        "rollout.system_prompt=none",
        f"rollout.tasks_per_step={SHAPE.prompts}",
        f"rollout.group_size={SHAPE.samples}",
        "rollout.max_turns=1",
        f"rollout.max_tokens_per_turn={SHAPE.max_new_tokens}",
        "algorithm.advantage=grpo",
        "algorithm.aggregation=token-mean",  # TRL's default loss_type="dapo": tokens of the batch
        f"trainer.lr={SHAPE.lr}",
        "trainer.mini_batches=1",
        "trainer.epochs=1",
        "trainer.weight_decay=0.0",
        "trainer.betas=[0.9,0.999]",  # TRL's (transformers') AdamW defaults
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.save_trajectories=false",
    ]


def run_steprl(steps: int, seed: int) -> list[tuple[float, float, dict[str, float]]]:
    """(seconds, mean reward, time/* parts) of each of `steps` RL steps."""
    out = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as cleanup:
        cfg = load_config(None, steprl_overrides(tmp, seed))
        envs = cleanup.enter_context(env_setup.env_pool(cfg))
        parts = build(cfg, env_setup.run_envs(cfg), envs, cleanup, lambda s: None, resuming=False)
        shuffle = torch.Generator().manual_seed(seed)
        state = TrainState(0, parts.engine.version, RngState.capture(shuffle))
        pipeline = start_pipeline(cfg, parts, parts.source, state, lambda s: None)
        cleanup.callback(pipeline.close)
        for _ in range(steps):
            t0 = time.perf_counter()
            kl = parts.controllers.current().kl_coef  # the adaptive KL's, when configured
            state, m, _, _ = run_step(cfg, parts, pipeline, state, shuffle, lambda s: None, reward_kl_coef=kl)
            times = {k: v for k, v in m.items() if k.startswith("time/")}
            out.append((time.perf_counter() - t0, m["reward/mean"], times))
    return out


# ---- (a) TRL GRPOTrainer ----------------------------------------------------------------------
def run_trl(steps: int, seed: int) -> list[tuple[float, float, dict[str, float]]] | None:
    try:
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        return None
    rows: list[tuple[float, float, dict[str, float]]] = []
    started: list[float] = []
    rewards: list[float] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            started.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            rows.append((time.perf_counter() - started[-1], float("nan"), {}))

        def on_log(self, args, state, control, logs=None, **kw):  # type: ignore[no-untyped-def]
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    def reward(completions: list[str], **kw: object) -> list[float]:
        return [digit_share(c) for c in completions]

    prompts = [f"<s>{p}\n" for p in PROMPTS] * (steps + 1)
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=SHAPE.prompts * SHAPE.samples,
            num_generations=SHAPE.samples,
            max_completion_length=SHAPE.max_new_tokens,
            learning_rate=SHAPE.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            max_steps=steps,
            temperature=1.0,
            top_k=0,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
            shuffle_dataset=False,
            seed=seed,
            bf16=False,
        )
        trainer = GRPOTrainer(
            model=fresh_model(seed),
            reward_funcs=reward,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=TOKENIZER,
            callbacks=[Clock()],
        )
        trainer.train()
    return [(s, r, t) for (s, _, t), r in zip(rows, rewards + [float("nan")] * len(rows), strict=False)]


# ---- (c) the bare-torch floor -----------------------------------------------------------------
def run_floor(steps: int, seed: int) -> list[tuple[float, float, dict[str, float]]]:
    """A plain KV-cached sampling loop, group-normalised rewards, one fwd+bwd and AdamW step."""
    model = fresh_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=SHAPE.lr)
    gen = torch.Generator().manual_seed(seed)
    n = SHAPE.prompts * SHAPE.samples
    out = []
    for step in range(steps):
        t0 = time.perf_counter()
        texts = [PROMPTS[(step * SHAPE.prompts + i // SHAPE.samples) % len(PROMPTS)] + "\n" for i in range(n)]
        enc = [[TOKENIZER.bos_token_id, *TOKENIZER.encode(t, add_special_tokens=False)] for t in texts]
        width = max(len(e) for e in enc)
        prompt = torch.full((n, width), TOKENIZER.pad_token_id)
        attn = torch.zeros((n, width), dtype=torch.long)
        for i, e in enumerate(enc):
            prompt[i, width - len(e) :], attn[i, width - len(e) :] = torch.tensor(e), 1
        model.eval()
        with torch.no_grad():
            pos = (attn.cumsum(-1) - 1).clamp(min=0)
            o = model(
                input_ids=prompt, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1
            )
            toks = []
            for _ in range(SHAPE.max_new_tokens):
                probs = torch.softmax(o.logits[:, -1].float(), -1)
                nxt = torch.multinomial(probs, 1, generator=gen)
                toks.append(nxt)
                attn = torch.cat([attn, torch.ones((n, 1), dtype=torch.long)], 1)
                pos = pos[:, -1:] + 1
                o = model(
                    input_ids=nxt, attention_mask=attn, position_ids=pos, past_key_values=o.past_key_values
                )
        completion = torch.cat(toks, 1)
        r = torch.tensor([digit_share(TOKENIZER.decode(c)) for c in completion.tolist()])
        g = r.view(SHAPE.prompts, SHAPE.samples)
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).view(-1)
        t_roll = time.perf_counter() - t0
        model.train()
        ids = torch.cat([prompt, completion], 1)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, width - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, completion[..., None]).squeeze(-1)
        loss = -(adv[:, None] * torch.exp(logp - logp.detach())).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        dt = time.perf_counter() - t0
        out.append((dt, float(r.mean()), {"time/rollout_s": t_roll, "time/learn_s": dt - t_roll}))
    return out


# ---- (b) multi-turn rollout -------------------------------------------------------------------
def _tasks(n: int) -> list:
    return [t for _, t in zip(range(n), MULTI_TURN_SPEC.tasks("train", 0), strict=False)]


#: (b)'s workloads: env spec and the turn budget. "lockstep": a random model rarely stops, so
#: nearly every turn runs the full 16 tokens; "long tail": turns stop early, a few run to 64.
WORKLOADS = {"lockstep": (MULTI_TURN_SPEC, SHAPE.max_new_tokens), "long tail": (LONG_TAIL_SPEC, 64)}


def run_engine_turns(
    seed: int, workload: str = "lockstep", *, continuous: bool = True, reuse: bool = True
) -> tuple[float, int]:
    """steprl's engine under the agent loop: (seconds, sampled tokens) for one batch of episodes."""
    spec, budget = WORKLOADS[workload]
    model = fresh_model(seed)
    fmt = PlainFormat(TOKENIZER)
    engine = HFEngine(
        model,
        eos_token_id=TOKENIZER.eos_token_id,
        pad_token_id=TOKENIZER.pad_token_id,
        seed=seed,
        continuous=continuous,
        prefix_cache_bytes=(1 << 30) if reuse else 0,
    )
    setup = RolloutSetup(
        make_env=lambda task: spec.factory(),
        engine=engine,
        fmt=fmt,
        rule=AppendOnly(),
        sampling=SamplingParams(temperature=1.0),
        budgets=Budgets(max_turns=SHAPE.turns, max_tokens_per_turn=budget, max_total_tokens=512),
    )
    t0 = time.perf_counter()
    groups = asyncio.run(rollout_groups(_tasks(SHAPE.prompts), SHAPE.samples, setup, seed=seed))
    dt = time.perf_counter() - t0
    return dt, sum(len(s.action_ids) for g in groups for t in g.trajectories for s in t.steps)


def run_hf_generate_turns(seed: int, workload: str = "lockstep") -> tuple[float, int]:
    """HF `generate` once per turn over all episodes, the context re-prefilled every turn."""
    spec, budget = WORKLOADS[workload]
    model = fresh_model(seed).eval()
    torch.manual_seed(seed)
    fmt = PlainFormat(TOKENIZER)
    stops = [TOKENIZER.eos_token_id, *fmt.stop_tokens(spec.factory().stop_strings)[0]]
    t0 = time.perf_counter()
    envs, contexts = [], []
    for task in _tasks(SHAPE.prompts):
        for _ in range(SHAPE.samples):
            env = spec.factory()
            first = env.reset(task, 0)
            envs.append(env)
            contexts.append(list(fmt.initial_ids("", first.text)))
    sampled = 0
    for _turn in range(SHAPE.turns):
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), TOKENIZER.pad_token_id)
        attn = torch.zeros_like(ids)
        for i, c in enumerate(contexts):
            ids[i, width - len(c) :], attn[i, width - len(c) :] = torch.tensor(c), 1
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=attn,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                max_new_tokens=budget,
                eos_token_id=stops,
                pad_token_id=TOKENIZER.pad_token_id,
                output_scores=True,
                return_dict_in_generate=True,
            )
        new = out.sequences[:, width:]
        _logps = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        for i, row in enumerate(new.tolist()):
            cut = next((j + 1 for j, t in enumerate(row) if t in stops), len(row))
            action = row[:cut]
            sampled += len(action)
            obs = envs[i].step(TOKENIZER.decode(action)).observation
            contexts[i] += action + list(fmt.observation_ids(obs))
    return time.perf_counter() - t0, sampled


# ---- report -----------------------------------------------------------------------------------
def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def compare_a(rounds: int, steps: int, seed: int) -> None:
    sides: dict[str, Callable[[int, int], list | None]] = {
        "steprl": run_steprl,
        "TRL GRPOTrainer": run_trl,
        "bare-torch floor": run_floor,
    }
    got: dict[str, list] = {k: [] for k in sides}
    for r in range(rounds):
        for name, fn in sides.items():
            rows = fn(steps + 1, seed)
            if rows is None:
                got[name] = []
                continue
            got[name] += rows[1:]  # the first step of a run pays one-off warm-up
        print(
            f"  round {r + 1}/{rounds}: "
            + ", ".join(f"{k} {med([x[0] for x in v]):.4f}s" for k, v in got.items())
        )
    print(f"(a) seconds per RL step, medians of {rounds} rounds x {steps} steps:")
    base = med([x[0] for x in got["steprl"]])
    for name, rows in got.items():
        if not rows:
            print(f"  {name:18s} not installed (make bench-venv)")
            continue
        s = med([x[0] for x in rows])
        parts = {k: med([x[2][k] for x in rows if k in x[2]]) for k in ("time/rollout_s", "time/learn_s")}
        shown = "  ".join(f"{k[5:-2]} {v:.4f}s" for k, v in parts.items() if v == v)
        print(f"  {name:18s} {s:.4f} s/step  (x{s / base:.2f} of steprl)  {shown}")


def curves(steps: int, seed: int) -> None:
    print(f"(a) reward curve over {steps} steps (mean digit share of the batch), seed {seed}:")
    for name, fn in (("steprl", run_steprl), ("TRL GRPOTrainer", run_trl), ("bare-torch floor", run_floor)):
        rows = fn(steps, seed)
        if rows is None:
            continue
        r = [x[1] for x in rows]
        marks = " ".join(f"{r[i]:.2f}" for i in range(0, steps, 5))
        print(f"  {name:18s} every 5th step: {marks}; mean of last 5: {statistics.fmean(r[-5:]):.3f}")


def compare_b(rounds: int, seed: int) -> None:
    sides: dict[str, Callable[[int, str], tuple[float, int]]] = {
        "steprl engine": run_engine_turns,
        "  without continuous batching": lambda s, w: run_engine_turns(s, w, continuous=False),
        "  without prefix reuse": lambda s, w: run_engine_turns(s, w, reuse=False),
        "HF generate per turn": run_hf_generate_turns,
    }
    n_eps = SHAPE.prompts * SHAPE.samples
    for workload, (_, budget) in WORKLOADS.items():
        got: dict[str, list[float]] = {k: [] for k in sides}
        tokens: dict[str, int] = {}
        for _ in range(rounds):
            for name, fn in sides.items():
                dt, n = fn(seed, workload)
                got[name].append(n / dt)
                tokens[name] = n
        print(
            f"(b) multi-turn rollout, {workload}: {n_eps} episodes x {SHAPE.turns} turns, <= {budget} "
            f"tokens a turn; sampled tokens/s (median of {rounds}):"
        )
        base = med(got["HF generate per turn"])
        for name, vals in got.items():
            ratio = med(vals) / base
            print(
                f"  {name:30s} {med(vals):7.0f} tok/s  (x{ratio:.2f} of HF generate; {tokens[name]} tokens)"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="measured steps per run (plus one warm-up)")
    ap.add_argument("--curve", type=int, default=30, help="steps of the reward curves (0: none)")
    ap.add_argument("--only", default="a,b", help="comparisons to run: a, b")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import transformers

    try:
        import trl

        trl_version = trl.__version__
    except ImportError:
        trl_version = "not installed"
    print(
        f"vs_peers: {time.strftime('%Y-%m-%d %H:%M')} {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} torch threads; torch {torch.__version__}, transformers "
        f"{transformers.__version__}, trl {trl_version}"
    )
    print(f"shape: {asdict(SHAPE)}")
    only = set(args.only.split(","))
    if "a" in only:
        compare_a(args.rounds, args.steps, args.seed)
        if args.curve:
            curves(args.curve, args.seed)
    if "b" in only:
        compare_b(args.rounds, args.seed)


if __name__ == "__main__":
    main()
