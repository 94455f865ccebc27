"""Inference engines: the `Engine` protocol and its implementations."""

from steprl.engines.base import Engine, Generation, SamplingParams

__all__ = ["Engine", "Generation", "SamplingParams"]
