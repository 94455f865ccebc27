"""The `Learner` protocol is the only way the run reaches the policy and its optimizer: the
in-process learner passes the protocol's checker, and a whole run (KL in the reward, EMPG
entropies, the MI probe, a health rollback, checkpoints, engine pushes) goes through a wrapper
that has the protocol's methods and nothing else, so any reach past it is an AttributeError."""

from __future__ import annotations

import copy
import functools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from cli_runs import TINY_SCRATCH
from steprl.algorithms import POLICY_LOSSES
from steprl.config import load_config
from steprl.engines.weights import WeightUpdate
from steprl.training.learn.learner_protocol import Computed, Learner, LearnerLevers, check_learner
from tiny_runs import make_learner


def test_the_local_learner_passes_the_protocols_checker(small_model, advantage_rows):
    loss = functools.partial(POLICY_LOSSES["ppo_clip"].fn, clip_low=0.2, clip_high=0.2)
    check_learner(lambda: make_learner(copy.deepcopy(small_model).train(), policy_loss=loss), advantage_rows)


class Counting:
    """A `Learner` that counts each call and passes it on; only the protocol's names exist.
    `row_sets`: each distinct sequence of rows it was handed (the objects, kept alive)."""

    def __init__(self, inner: Learner, calls: Counter[str]) -> None:
        self._inner, self._calls = inner, calls
        self.row_sets: list[Any] = []

    def _saw(self, rows: Any) -> None:
        if not any(rows is seen for seen in self.row_sets):
            self.row_sets.append(rows)

    @property
    def temperature(self) -> float:
        return self._inner.temperature

    def compute(self, rows: Any, **asked: bool) -> Computed:
        self._calls["compute:" + "+".join(sorted(k for k, v in asked.items() if v))] += 1
        self._saw(rows)
        return self._inner.compute(rows, **asked)

    def update(self, rows: Any, **kw: Any) -> dict[str, float]:
        self._calls["update"] += 1
        self._saw(rows)
        return self._inner.update(rows, **kw)

    def weights(self, version: int) -> WeightUpdate:
        self._calls["weights"] += 1
        return self._inner.weights(version)

    def apply(self, levers: LearnerLevers) -> None:
        self._calls["apply"] += 1
        self._inner.apply(levers)

    def snapshot(self) -> Any:
        self._calls["snapshot"] += 1
        return self._inner.snapshot()

    def restore(self, snapshot: Any) -> None:
        self._calls["restore"] += 1
        self._inner.restore(snapshot)

    def state_dict(self) -> dict[str, Any]:
        self._calls["state_dict"] += 1
        return self._inner.state_dict()

    def load_state_dict(self, state: Any, checkpoint: Path) -> None:
        self._calls["load_state_dict"] += 1
        self._inner.load_state_dict(state, checkpoint)

    def save_model(self, directory: Path, final: Path) -> None:
        self._calls["save_model"] += 1
        self._inner.save_model(directory, final)

    def close(self) -> None:
        self._calls["close"] += 1
        self._inner.close()


def test_a_whole_run_goes_through_the_protocol(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from steprl.training.loop.trainer import train
    from steprl.training.setup import build

    calls: Counter[str] = Counter()
    local = build.LocalLearner
    monkeypatch.setattr(build, "LocalLearner", lambda *a, **k: Counting(local(*a, **k), calls))
    rule = (
        "[{name: undo, when: [{signal: approx_kl, above: -1}], steps: 2, budget: 1, then: alert,"
        " cooldown: 10, actions: [{rollback: {k: 1}}]}]"
    )
    sets = [
        *TINY_SCRATCH,
        f"run.output_dir={tmp_path}",
        "trainer.total_steps=3",
        "trainer.checkpoint_every=3",
        "algorithm.kl_coef=0.05",
        "algorithm.kl_in=reward",
        "algorithm.empg={k: 1.0, k_f: 1.0, zeta: 0.1}",
        "health.mi_every=1",
        f"health.rules={rule}",
        "logging.tensorboard=false",
    ]
    run_dir = train(load_config("configs/calculator_tiny.yaml", sets), log=lambda _: None).run_dir
    fired = [json.loads(line) for line in (run_dir / "health.jsonl").read_text().splitlines()]
    assert "restored the weights of step 1" in fired[0]["outcome"], fired
    # per step: one pass for EMPG's entropies and the reward's KL together, one update, the
    # three learner levers (lr, entropy, KL), a snapshot for the ring, the weights to the
    # engine; the MI probe's pass when its groups allow; the rollback's restore and its
    # weights; one checkpoint at the end
    assert calls["compute:entropies+ref_logprobs"] == 3 and calls["update"] == 3, calls
    assert calls["apply"] == 3 * 3 and calls["snapshot"] == 4 and calls["restore"] == 1, calls
    assert calls["weights"] == 3 + 1, calls  # each step's, and the rollback's
    assert calls["state_dict"] == 1 and calls["save_model"] == 1, calls
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all("actor/reward_kl" in m for m in metrics if m["step"] > 0), metrics


def test_each_row_is_collated_once_per_set_of_rows_the_learner_is_handed(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every pass over a step's rows: make_batch's (entropies, the shared critic's values), the
    cross-policy ratios, the proximal and reference passes, 2 epochs x 2 mini-batches, the MI
    probe's rows. The step's rows reach the learner as two sets (the views before advantages,
    the rows after), and each row of a set becomes tensors once: at most twice per step."""
    from steprl.training.learn import batching
    from steprl.training.loop.trainer import train
    from steprl.training.setup import build

    calls: Counter[str] = Counter()
    made: list[Counting] = []
    converted: list[int] = []
    real = batching.row_tensors
    monkeypatch.setattr(batching, "row_tensors", lambda s: converted.append(1) or real(s))
    local = build.LocalLearner
    monkeypatch.setattr(
        build, "LocalLearner", lambda *a, **k: made.append(Counting(local(*a, **k), calls)) or made[-1]
    )
    sets = [
        *TINY_SCRATCH,
        f"run.output_dir={tmp_path}",
        "trainer.total_steps=2",
        "trainer.epochs=2",
        "trainer.mini_batches=2",
        "trainer.micro_batch_size=1",
        "algorithm.policy_loss=decoupled_ppo",
        "algorithm.kl_coef=0.05",
        "algorithm.critic=shared",
        "algorithm.advantage=gae",
        "algorithm.advantage_params={gamma: 1.0, lam: 1.0}",
        "algorithm.empg={k: 1.0, k_f: 1.0, zeta: 0.1}",
        "rollout.cross_policy={snapshots: 2, probs: [0.5, 0.5]}",
        "health.mi_every=1",
        "logging.tensorboard=false",
    ]
    train(load_config("configs/calculator_tiny.yaml", sets), log=lambda _: None)
    (learner,) = made
    assert calls["update"] == 2 and calls["compute:values"] == 2 and calls["compute:entropies"] == 2, calls
    assert calls["compute:logprobs"] >= 2, calls  # the ratios by lag (and the MI probe's)
    assert sum(converted) == sum(len(rows) for rows in learner.row_sets), (len(converted), learner.row_sets)
    # per step: the views, the rows; the MI probe's own rows when its groups allow
    assert 4 <= len(learner.row_sets) <= 6, [len(r) for r in learner.row_sets]


def test_a_checkpoint_of_the_old_layout_resumes_as_the_new_one(tmp_path) -> None:
    """state.pt format 1 (the learner's keys at the top level, before the protocol) resumes to
    the same step as format 2; a format from a newer steprl is one line."""
    import hashlib
    import shutil

    import torch

    from steprl.errors import UserError
    from steprl.training.loop.trainer import train

    def run(name: str, *extra: str) -> Any:
        sets = [*TINY_SCRATCH, f"run.output_dir={tmp_path}", f"run.name={name}", "logging.tensorboard=false"]
        sets.append("trainer.checkpoint_every=1")
        return train(load_config("configs/calculator_tiny.yaml", [*sets, *extra]), log=lambda _: None)

    run("new", "trainer.total_steps=1")
    shutil.copytree(tmp_path / "new", tmp_path / "old", symlinks=True)  # `latest` stays a link

    def rewrite(name: str, change: Any) -> None:
        ckpt = tmp_path / name / "checkpoints" / "latest"
        state = torch.load(ckpt / "state.pt", weights_only=False)
        torch.save(change(state), ckpt / "state.pt")
        manifest = json.loads((ckpt / "manifest.json").read_text())
        manifest["files"]["state.pt"] = hashlib.sha256((ckpt / "state.pt").read_bytes()).hexdigest()
        (ckpt / "manifest.json").write_text(json.dumps(manifest))

    rewrite(
        "old", lambda s: {**{k: v for k, v in s.items() if k not in ("learner", "format")}, **s["learner"]}
    )
    new = run("new", "run.resume=must", "trainer.total_steps=2")
    old = run("old", "run.resume=must", "trainer.total_steps=2")
    drop = lambda m: {k: v for k, v in m.items() if not k.startswith("time/") and not k.endswith("_s")}  # noqa: E731
    assert [drop(m) for m in old.history] == [drop(m) for m in new.history] and len(new.history) == 1
    rewrite("old", lambda s: {**s, "format": 99})
    with pytest.raises(UserError, match="written by a newer steprl"):
        run("old", "run.resume=must", "trainer.total_steps=3")
