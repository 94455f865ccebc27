"""Env hosting: where environment instances live. Not model serving (inference engines are in
`steprl.engines`).

Three places, one interface: `backend.EnvBackend` (`make_env(task) -> Env`) is all the agent
loop sees, and `backend.BACKENDS` picks the implementation by `runtime.backend`:

* ``inprocess``: the registered factory, in the trainer (core install);
* ``http``: a `steprl serve-env` server (`server.py`, this or another machine) and its client
  (`client.py`, `http_backend.py`); the ``serve`` extra;
* ``ray``: env worker actors (`ray_backend.py`); the ``ray`` extra.

What each transport mechanism buys is measured in docs/scaling.md.
"""
