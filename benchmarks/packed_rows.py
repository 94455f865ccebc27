"""Prefix-tree rows vs per-step rows for history-editing contexts: tokens the learner processes
and seconds per learner update, at T turns (default 8), one run, medians. Prints numbers; the
equality of the two (log-probs 1e-5, gradients 1e-5 relative) is tests/training/test_packing.py.

    .venv/bin/python benchmarks/packed_rows.py [--turns 8] [--repeats 5]

Trajectories are synthetic but shaped like the calculator's: a 40-token task prompt, 16-token
actions, 24-token observations, 8 tasks x 8 samples; each rule builds its prompts itself
(`rollout/context.py`), so the rows are exactly what the trainer would train on.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time

import torch

from steprl.algorithms import POLICY_LOSSES
from steprl.models.tiny import TinyModelSpec, build_model, build_tokenizer
from steprl.rollout.context import DropOldObservations, KeepLastK, StripThinking
from steprl.rollout.views import Sample
from steprl.training.learn.learner import LocalLearner

PROMPT, ACTION, OBS, TASKS, SAMPLES = 40, 16, 24, 8, 8
CLOSE = 15  # the `</think>` id for strip_thinking: put mid-action, so half of each action is cut


def rows_for(rule, turns: int, rng: random.Random) -> list[Sample]:
    out = []
    for task in range(TASKS):
        initial = (1, *[rng.randrange(20, 100) for _ in range(PROMPT - 1)])
        for sample in range(SAMPLES):
            history: list[tuple[tuple[int, ...], tuple[int, ...], bool]] = []
            for t in range(turns):
                prompt = rule.next_prompt(initial, history)
                action = [rng.randrange(20, 100) for _ in range(ACTION)]
                action[ACTION // 2] = CLOSE
                n = len(prompt)
                adv = rng.uniform(-1, 1)
                out.append(
                    Sample(
                        prompt + tuple(action),
                        (0,) * n + (1,) * ACTION,
                        (0.0,) * n + tuple(-rng.uniform(1, 5) for _ in action),
                        task * SAMPLES + sample,
                        (-1,) * n + (t,) * ACTION,
                        (0.0,) * n + (adv,) * ACTION,
                    )
                )
                # a query every other turn: strip_thinking cuts the actions before it
                history.append((tuple(action), tuple(rng.randrange(20, 100) for _ in range(OBS)), t % 2 == 1))
    return out


def learner(model, pack: bool) -> LocalLearner:
    return LocalLearner(
        model,
        policy_loss=POLICY_LOSSES["ppo_clip"].fn,
        needs_proximal=False,
        aggregation="token-mean",
        loss_scale_factor=None,
        lr=1e-4,
        weight_decay=0.0,
        betas=(0.9, 0.99),
        grad_clip=1.0,
        micro_batch_size=64,
        pad_id=0,
        temperature=1.0,
        pack=pack,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from steprl.training.learn.batching import collate
    from steprl.training.learn.packing import pack

    tok = build_tokenizer()
    base = build_model(len(tok), TinyModelSpec(), seed=0, pad_id=0, bos_id=1, eos_id=2)
    print(f"packed_rows: {time.strftime('%Y-%m-%d %H:%M')}, tiny demo model, {TASKS}x{SAMPLES} trajectories,")
    print(
        f"  {args.turns} turns, prompt {PROMPT}, action {ACTION}, observation {OBS} tokens; "
        f"medians of {args.repeats}"
    )
    rules = {
        "drop_old_observations(k=1)": DropOldObservations(1),
        "strip_thinking": StripThinking((CLOSE,), frozenset()),
        "keep_last_k(k=2)": KeepLastK(2),
    }
    for name, rule in rules.items():
        samples = rows_for(rule, args.turns, random.Random(0))
        # what the learner runs its model over: each row's tokens, or each tree node once
        tokens = {
            False: sum(len(s.input_ids) for s in samples),
            True: sum(len(t.ids) for t in pack(samples)[0]),
        }
        padded = sum(
            int(collate(samples[i : i + 64], 0).input_ids.numel()) for i in range(0, len(samples), 64)
        )
        secs: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for packed in (False, True):  # alternate A B A B
                lrn = learner(copy.deepcopy(base).train(), packed)
                t0 = time.perf_counter()
                lrn.update(samples, epochs=1, mini_batches=1, generator=torch.Generator().manual_seed(0))
                secs[packed].append(time.perf_counter() - t0)
        plain, packed = statistics.median(secs[False]), statistics.median(secs[True])
        print(
            f"  {name:28s} tokens {tokens[False]:6d} ({padded} padded) -> {tokens[True]:6d} "
            f"(x{tokens[False] / tokens[True]:.2f} fewer); "
            f"update {plain:.3f} s -> {packed:.3f} s (x{plain / packed:.2f} faster)"
        )


if __name__ == "__main__":
    main()
