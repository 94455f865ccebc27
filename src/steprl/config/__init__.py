"""A run's configuration: what a config file and `--set` may say, checked as it is read.

* `values.py`: what a single value may be (strict types, ranges, `*_params` against the picked
  function's signature), `ConfigError`, the bounded YAML loader, paths anchored to their file;
* `sections.py`: the sections' shared base and the small sections;
* `health.py`: the `health:` section (rules, signals, actions);
* `schema.py`: the `Config` root and its large sections, `load_config`, `dump_config`;
* `checks.py`: what depends on this machine (device, host, output folder) and warnings about
  valid settings that mean nothing.

What the rest of steprl reads is re-exported here: `from steprl.config import Config, load_config`.
"""

from steprl.config import schema as _schema
from steprl.config.schema import *  # noqa: F403 - the names below, one list: schema's __all__

__all__ = list(_schema.__all__)
