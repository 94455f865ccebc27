"""The template-collapse probe (issue 27): RAGEN-2's mutual-information proxy on the step's own
rollouts, teacher-forced with the learner's current model. No sampling: the reasonings are the
first actions the engine already sampled, so the probe costs N * N * K forward rows and nothing else.

The math is `health/mutual_info.py`; this module picks the rows and scores them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from steprl.health.mutual_info import mi_from_scores
from steprl.rollout.views import Sample
from steprl.training.learn.learner_protocol import Learner
from steprl.types import Trajectory

Ids = tuple[int, ...]


def probe_groups(
    trajectories: Sequence[Trajectory], prompts: int, samples: int
) -> list[tuple[Ids, list[Ids]]]:
    """The first `prompts` groups (in order of first appearance) with >= `samples` trajectories
    whose first action has tokens: each group's first-turn prompt ids (its first trajectory's)
    and the first `samples` first-turn action ids.

    A group is the trajectories sharing a `group_id` (one task of the batch). A group whose first
    prompt equals one already picked (the same task twice in a batch, or an env whose prompt
    does not vary) is skipped: two identical prompts cannot be told apart by construction, which
    would read as collapse whatever the policy does.
    """
    by_group: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        if t.steps and t.steps[0].action_ids:
            by_group.setdefault(t.group_id, []).append(t)
    out: list[tuple[Ids, list[Ids]]] = []
    seen: set[Ids] = set()
    for group in by_group.values():
        prompt = group[0].steps[0].prompt_ids
        if len(group) < samples or prompt in seen:
            continue
        seen.add(prompt)
        out.append((prompt, [t.steps[0].action_ids for t in group[:samples]]))
        if len(out) == prompts:
            break
    return out


def score_matrix(learner: Learner, groups: Sequence[tuple[Ids, Sequence[Ids]]]) -> torch.Tensor:
    """(N, N, K) float64: [j, i, k] = sum over the tokens of action k of group i of their log-probs
    under group j's prompt (teacher forcing, logits / learner.temperature, as the learner trains).

    Rows go prompt-major so a packing learner shares each prompt across its N * K rows. The
    forward runs in eval mode under `torch.no_grad` and a forked RNG: no global RNG moves."""
    n, k = len(groups), len(groups[0][1])
    rows = []
    for j, (prompt, _) in enumerate(groups):
        for _, actions in groups:
            for a in actions:
                rows.append(
                    Sample(prompt + a, (0,) * len(prompt) + (1,) * len(a), (0.0,) * (len(prompt) + len(a)), j)
                )
    computed = learner.compute(rows, logprobs=True, eval_mode=True)  # no dropout, no RNG moved
    assert computed.logprobs is not None
    logps = computed.logprobs  # (len-1,) each, target-aligned, 0 off the action
    sums = torch.tensor([float(lp.double().sum()) for lp in logps], dtype=torch.float64)
    return sums.view(n, n, k)


def mi_probe(
    learner: Learner, trajectories: Sequence[Trajectory], *, prompts: int, samples: int
) -> dict[str, float]:
    """RAGEN-2's MI proxy and prompt-retrieval accuracy of the current policy (`health/mi_*`).

    `learner`: any `Learner` (its `compute`, in eval mode); a LoRA model needs nothing special.
    N = `prompts` groups of `samples`
    reasonings each (`probe_groups`); fewer than 2 usable groups: {} (nothing to compare).
    Deterministic for the same model and rollouts; consumes no global RNG; the model's train/eval
    mode is restored. `time/health_mi_probe_s` is its wall time (the one non-deterministic value).
    """
    start = time.perf_counter()
    groups = probe_groups(trajectories, prompts, samples)
    if len(groups) < 2:
        return {}
    mi, acc = mi_from_scores(score_matrix(learner, groups))
    n = len(groups)
    return {
        "health/mi": mi,
        "health/mi_retrieval_acc": acc,
        "health/mi_retrieval_gap": acc - 1.0 / n,
        "health/mi_chance": 1.0 / n,
        "health/mi_prompts": float(n),
        "time/health_mi_probe_s": time.perf_counter() - start,
    }
