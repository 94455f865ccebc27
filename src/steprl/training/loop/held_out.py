"""The run's held-out evaluations: the same tasks and seeds at step 0 (the warm start, which
also checks that the run can evaluate at all) and every `trainer.eval_every` steps."""

from __future__ import annotations

import time
from collections.abc import Callable

from steprl.config import Config
from steprl.rollout import seeds
from steprl.training.learn.guards import FirstFailures
from steprl.training.loop.evaluate import check_first_evaluation, evaluate
from steprl.training.loop.pipeline import Pipeline
from steprl.training.loop.run_sinks import RunOutputs
from steprl.training.loop.stop_signal import StopOnSignal
from steprl.training.setup.build import Parts, eval_setup
from steprl.training.setup.warm_start_check import warn_if_weak
from steprl.types import Trajectory


class Evaluator:
    """Held-out evaluation: eval/* metrics, how long it took (a hung env call ends at its
    deadline), and the episodes. Every evaluation runs the same tasks with the same seeds."""

    def __init__(
        self, cfg: Config, parts: Parts, pipeline: Pipeline, stop: StopOnSignal, first: FirstFailures
    ) -> None:
        self.cfg, self.parts, self.pipeline, self.stop, self.first_failures = (
            cfg,
            parts,
            pipeline,
            stop,
            first,
        )
        self.held_out = eval_setup(parts)

    def __call__(self, step: int) -> tuple[dict[str, float], dict[str, float], list[Trajectory]]:
        seed = seeds.eval_stream_seed(self.cfg.run.seed)
        started = time.perf_counter()
        with self.stop.interruptible():
            metrics, trajectories = evaluate(
                self.parts.eval_tasks,
                self.held_out,
                seed=seed,
                run=self.pipeline.producer.run,
                per_env=self.parts.envs.several,
            )
        self.first_failures(trajectories, f"evaluation at step {step}")
        return metrics, {"time/eval_s": time.perf_counter() - started}, trajectories


def log_warm_start(
    cfg: Config,
    parts: Parts,
    evaluator: Evaluator,
    out: RunOutputs,
    warm_start: tuple[dict[str, float], dict[str, float], list[Trajectory]],
    log: Callable[[str], None],
) -> None:
    warm, took, warm_episodes = warm_start
    log(
        f"warm start: {describe_eval(warm)} ({len(parts.eval_tasks)} tasks, T={cfg.trainer.eval_temperature})"
    )
    warn_if_weak(cfg, warm_episodes, log)  # before RL: a warm start RL cannot lift
    out.write(0, warm | took, [], evaluated=warm_episodes)
    # a run that cannot evaluate stops now, not after its budget; a harness's system prompt
    check_first_evaluation(cfg, evaluator.held_out, parts.eval_tasks, warm, warm_episodes, log)


def describe_eval(m: dict[str, float]) -> str:
    """One line for an evaluation; one that mostly failed in the infrastructure says so instead
    of reporting a success rate over episodes that never ran."""
    failed, n = int(m.get("eval/infra_failed", 0) + m.get("eval/env_timeout", 0)), int(m.get("eval/tasks", 0))
    if n and failed * 2 > n:
        return f"eval failed: {failed}/{n} episodes infra_failed"
    return f"held-out success {m['eval/success']:.3f}, tool-call rate {m['eval/tool_call_rate']:.3f}"


__all__ = ["Evaluator", "describe_eval", "log_warm_start"]
