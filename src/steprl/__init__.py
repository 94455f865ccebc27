"""steprl: agentic reinforcement learning for tool-using language-model agents."""

from steprl.types import EndReason, Group, Step, Task, Trajectory

__all__ = ["EndReason", "Group", "Step", "Task", "Trajectory"]
__version__ = "0.1.0"
