"""Where environments run: in the trainer, behind an HTTP server, or in Ray actors.

`backend.EnvBackend` is the one interface the agent loop sees (`make_env(task) -> Env`);
`backend.BACKENDS` picks an implementation by the config's `runtime.backend`.
"""
