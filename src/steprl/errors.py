"""`UserError`: a problem with what the user gave us, reported by the CLI as one line (exit 2).

A bad config key, a plugin that does not import, an import path to something that is not an
`EnvSpec`, a task file with a bad row, an unknown Gymnasium id, an MCP server that dies at
start-up: each raises a subclass of `UserError` whose message names the input (the key, the
path, the row) and what to do. `steprl.cli.main` prints it without a traceback. Any other
exception is a bug, and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """The user's input is wrong; the message (one line) says which input and how to fix it."""


class ConfigError(UserError, ValueError):
    """A config problem, with the dotted key and what is allowed (one line from the CLI).
    Here, below every registry, so a registry's lookup can raise it; `steprl.config` re-exports it."""


class RunAborted(Exception):
    """A run stopped on purpose, keeping what it finished: a checkpoint save the disk refused,
    too many non-finite steps in a row, failing infrastructure, an interrupt. The CLI prints the
    message (one line: what happened, what was kept, how to go on) and exits `exit_code`."""

    exit_code = 1


class RunInterrupted(RunAborted):
    """SIGINT or SIGTERM: the current step finished, a checkpoint was saved, writers closed."""

    exit_code = 130
