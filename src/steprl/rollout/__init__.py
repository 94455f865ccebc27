"""Rollout: the one agent loop, context rules, prompt formats and inference engines."""
