"""Diagnostics: pure rollout metrics, metric/trajectory sinks, learning-curve plots, progress."""

from steprl.diagnostics.metrics import (
    env_metrics,
    gateway_metrics,
    is_success,
    mean_of,
    reward_component_means,
    rollout_metrics,
    template_metrics,
)
from steprl.diagnostics.plots import plot_learning_curve
from steprl.diagnostics.progress import TrainingProgress, print_summary_table
from steprl.diagnostics.sinks import (
    JsonlSink,
    MetricsSink,
    MultiSink,
    TensorBoardSink,
    TrajectoryWriter,
    read_metrics_jsonl,
    read_trajectories,
)

__all__ = [
    "JsonlSink",
    "MetricsSink",
    "MultiSink",
    "TensorBoardSink",
    "TrainingProgress",
    "TrajectoryWriter",
    "env_metrics",
    "is_success",
    "mean_of",
    "plot_learning_curve",
    "print_summary_table",
    "read_metrics_jsonl",
    "read_trajectories",
    "reward_component_means",
    "rollout_metrics",
    "template_metrics",
    "gateway_metrics",
]
