"""`Registry`: the one shape of every dict a config key picks an entry of by name.

A registry is a plain dict (`X[name]`, `name in X`, `X.items()`, `monkeypatch.setitem` work as on
any dict) that also knows the config key naming its entries, what an entry is called, what an
object of your own must be to stand in for one, the params each entry takes, and the checker
every entry must pass. So every registry answers the same three questions the same way:

* `lookup(name)`: the entry, or what the import path ``package.module:attr`` names (the working
  directory is searched too, appended: it never shadows); anything else is one `ConfigError`
  line listing the names, and an imported object the registry does not accept (`os:system` is
  callable) is refused in one line before anything calls it;
* `check_params(name, params)`: unknown or ill-typed params refused in one line naming what the
  entry takes;
* `check(name)`: the registry's checker run over the entry (`tests/test_registries.py` runs it
  over every entry of every registry where it is cheap).

`load_attr` is the one import-path loader: the env registry and the Gymnasium adapter use it too.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from steprl.errors import ConfigError
from steprl.params import check_params

T = TypeVar("T")

#: what an entry declares about its params: a function (its keyword arguments after the first
#: `skip` are the params, checked against their annotations), a mapping of name -> default (the
#: default's type is the type), or None (it takes none)
ParamsOf = Callable[[Any], Callable[..., Any] | Mapping[str, Any] | None]


def load_attr(path: str, where: str, error: Callable[[str], Exception] = ConfigError) -> Any:
    """What the import path ``package.module:attr`` names (`attr` may be dotted, and may step into
    a mapping: ``steprl.algorithms:ADVANTAGES.grpo``). `where` names the input in the one-line
    `error` (`env.source`, `env`): a path that does not resolve says why and what a path is."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise error(f"{where}: {path!r} is not an import path; an import path looks like package.module:attr")
    try:
        obj: Any = import_module(module_name)
    except (Exception, SystemExit) as exc:  # a module may raise anything while it imports
        raise error(
            f"{where} {path!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}; "
            "an import path looks like package.module:attr, its module importable from this environment"
        ) from None
    for part in attr.split("."):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif isinstance(obj, Mapping) and part in obj:
            obj = obj[part]
        else:
            raise error(f"{where} {path!r}: module {module_name!r} has no attribute {attr!r}")
    return obj


def import_module(name: str) -> Any:
    """`importlib.import_module`, also finding modules in the working directory (as `python -m`
    and uvicorn do; the `steprl` script's own sys.path lacks it). Appended: it never shadows."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    return importlib.import_module(name)


def describe(obj: Any) -> str:
    """What `obj` is, in a few words: `the class Foo`, `a builtin_function_or_method`."""
    return f"the class {obj.__name__}" if isinstance(obj, type) else f"a {type(obj).__name__}"


def class_with(*methods: str) -> Callable[[Any], bool]:
    """An `accept`: a class that defines each of `methods` (a protocol's)."""
    return lambda obj: isinstance(obj, type) and all(callable(getattr(obj, m, None)) for m in methods)


def instance_of(*kinds: type) -> Callable[[Any], bool]:
    """An `accept`: an instance of one of `kinds` (an entry record such as `LossSpec`)."""
    return lambda obj: isinstance(obj, kinds)


class Registry(dict[str, T]):
    """Entries by name, plus how a config key names one (see the module docstring).

    `key`: the config key that names an entry (`env.source`); `what`: what an entry is called
    (`task source`); `accept` / `expected`: what an imported object must be, and the words for
    it; `params` / `params_key` / `skip`: what each entry declares about its params (`ParamsOf`)
    and the key that holds them; `checker`: the import path of `check(name)`'s function
    (name) -> anything, raising when the entry breaks the contract: named, not imported, since
    a checker imports the dict it checks; None where the checker needs more than a name (a
    model, rollouts, a Ray cluster, a config that uses the entry): `checked_by` says which test
    runs it over every entry; `cheap`: whether it runs in well under a second (the parametrized
    test runs only those; their own tests run the others)."""

    def __init__(
        self,
        entries: Mapping[str, T],
        *,
        key: str,
        what: str,
        accept: Callable[[Any], bool],
        expected: str,
        params: ParamsOf | None = None,
        params_key: str = "",
        skip: int = 1,
        checker: str | None,
        checked_by: str = "",
        cheap: bool = True,
    ) -> None:
        super().__init__(entries)
        self.key, self.what, self.accept, self.expected = key, what, accept, expected
        self.params, self.params_key, self.skip = params, params_key or f"{key}_params", skip
        self.checker, self.checked_by, self.cheap = checker, checked_by, cheap

    def lookup(self, name: str) -> T:
        """The entry `name`, or the object its import path names (see the module docstring).
        (`dict.get` keeps its own meaning: `X.get(name)` is None for a name not here.)"""
        if name in self:
            return self[name]
        if ":" not in name:
            raise ConfigError(
                f"{self.key}: unknown {self.what} {name!r}; use one of {sorted(self)} "
                "or the import path package.module:attr of your own"
            )
        obj = load_attr(name, self.key)
        if not self.accept(obj):
            raise ConfigError(f"{self.key} {name!r} is {describe(obj)}, not {self.expected}")
        entry: T = obj
        return entry

    def check_params(self, name: str, params: Mapping[str, Any]) -> dict[str, Any]:
        """`params` for the entry `name` with its defaults filled in where it declares them; an
        unknown key, a missing required one or a value of the wrong type is one line."""
        declared = self.params(self.lookup(name)) if self.params is not None else None
        given = dict(params)
        if declared is None:
            if given:
                got = ", ".join(sorted(given))
                raise ConfigError(f"{self.params_key}: {self.what} {name!r} takes no params (got {got})")
            return given
        if isinstance(declared, Mapping):
            return _with_defaults(f"{self.what} {name!r}", declared, given)
        try:
            check_params(self.params_key, declared, given, skip=self.skip)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return given

    def check(self, name: str) -> object:
        """The registry's checker run over the entry `name` (an import path too, where the
        checker resolves one): it raises, naming what broke, unless the entry keeps the contract."""
        if self.checker is None:
            raise NotImplementedError(f"{self.key}: its checker needs more than a name; {self.checked_by}")
        checker = load_attr(self.checker, f"the checker of {self.key}")
        return checker(name)


def _with_defaults(where: str, defaults: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """`defaults` overridden by `given`: each key one of the defaults', each value of its type
    (an integer where a float is wanted is that float)."""
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ConfigError(f"{where} has no param {unknown[0]!r}; its params: {dict(defaults)}")
    out = dict(defaults)
    for key, value in given.items():
        want = type(defaults[key])
        ok = isinstance(value, want) and not (want is not bool and isinstance(value, bool))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ConfigError(f"{where}: {key} must be {want.__name__} (got {value!r})")
        out[key] = value
    return out


__all__ = ["ParamsOf", "Registry", "class_with", "describe", "import_module", "instance_of", "load_attr"]
