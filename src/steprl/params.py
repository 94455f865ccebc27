"""The `*_params` mappings a registry entry takes, checked against what the entry declares.

`check_params`: every key a named argument of the entry's function (after its inputs), each value
of the argument's annotated type (strict: `'8'` is not an integer) and in its name's domain
(`PARAM_RANGES`). `allowed_values` says what a type takes, in words, for that one line and for
the config's own fields. It sits below the registries (`steprl.registry`) so each dict's module
can check its params without importing the config.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

__all__ = ["PARAM_RANGES", "allowed_values", "check_params"]


#: The domain of a keyword param of the algorithms' functions, by name: a name means the same
#: thing in every function that takes it (docs/algorithms.md).
PARAM_RANGES: dict[str, tuple[Any, ...]] = {
    "clip_low": (Ge(0), Lt(1)),  # the ratio's lower bound is 1 - clip_low
    "clip_high": (Ge(0),),
    "dual_clip_c": (Gt(1),),
    "behav_cap": (Gt(0),),
    "eps": (Ge(0),),
    "gamma": (Ge(0), Le(1)),
    "lam": (Ge(0), Le(1)),
    "high_level_gamma": (Ge(0), Le(1)),
    "omega": (Ge(0),),
    "similarity_thresh": (Ge(0), Le(1)),
    "ratio": (Gt(0), Le(1)),
    "p": (Gt(0), Le(1)),
    "k": (Ge(0),),
    "k_f": (Ge(0),),
    "zeta": (Ge(0),),
    "max_len": (Gt(0),),
    "cache_len": (Ge(0),),
    "penalty": (Ge(0),),
}
_STRICT = ConfigDict(strict=True, allow_inf_nan=False)


def check_params(key: str, fn: Any, params: dict[str, Any], *, skip: int = 1, required: bool = False) -> None:
    """Every param must be a named argument of `fn` after its first `skip` (the inputs), of the
    argument's annotated type and in its name's range; `required`: its arguments without a
    default must be given too. Raises ValueError naming `key.param` and the allowed values."""
    named = [
        p
        for p in list(inspect.signature(fn).parameters.values())[skip:]
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    allowed = ", ".join(p.name for p in named)
    unknown = sorted(set(params) - {p.name for p in named})
    takes_any = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    if unknown and not takes_any:  # a function taking **kwargs checks its own keys
        raise ValueError(f"{key}: unknown key(s) {', '.join(unknown)}; allowed keys: {allowed}")
    missing = [p.name for p in named if required and p.default is p.empty and p.name not in params]
    if missing:
        raise ValueError(f"{key}: missing key(s) {', '.join(missing)}; allowed keys: {allowed}")
    for p in named:
        if p.name in params:
            _check_value(f"{key}.{p.name}", _annotation(fn, p), PARAM_RANGES.get(p.name, ()), params[p.name])


def _annotation(fn: Any, p: inspect.Parameter) -> Any:
    """The parameter's type (annotations are strings under `from __future__ import annotations`);
    Any when it names something only a type checker imports."""
    if not isinstance(p.annotation, str):
        return Any if p.annotation is p.empty else p.annotation
    try:
        return eval(p.annotation, vars(sys.modules[fn.__module__]))  # noqa: S307 (our own source)
    except (NameError, SyntaxError, TypeError):
        return Any


def _check_value(key: str, annotation: Any, bounds: tuple[Any, ...], value: Any) -> None:
    kinds = get_args(annotation) if _is_union(annotation) else (annotation,)
    if value is None and type(None) in kinds:
        return
    target: Any = Union[tuple(k for k in kinds if k is not type(None))]  # noqa: UP007 (built at run time)
    try:
        TypeAdapter(Annotated[target, *bounds] if bounds else target, config=_STRICT).validate_python(value)
    except ValidationError:
        raise ValueError(
            f"{key}: {value!r} is not allowed; allowed values: {allowed_values(annotation, bounds)}"
        ) from None


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType)


_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def _number(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"  # a bound of 2**32 - 1 in full, not 4.29497e+09


def allowed_values(annotation: Any, metadata: Sequence[Any] = ()) -> str:
    """What a field of this type and these constraints takes, in words: `an integer > 0`."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:  # a pydantic Field inside holds its constraints in .metadata
        inner = [c for m in annotation.__metadata__ for c in getattr(m, "metadata", [m])]
        return allowed_values(args[0], [*inner, *metadata])
    if _is_union(annotation):
        kinds = [allowed_values(a, metadata) for a in args if a is not type(None)]
        return " or ".join(kinds + (["null"] if type(None) in args else []))
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin is tuple:
        each = [allowed_values(a) for a in args]
        return (
            f"a list of {len(args)}, each {each[0]}" if len(set(each)) == 1 else f"a list: {', '.join(each)}"
        )
    if origin is list:
        return "a list"
    if origin is dict:
        return f"a mapping to {allowed_values(args[1], metadata)}" if args else "a mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "a mapping of " + ", ".join(annotation.model_fields)
    kind = _KINDS.get(annotation, "any value" if annotation is Any else str(annotation))
    bounds = [
        f"{op} {_number(getattr(m, name))}" for m in metadata for name, op in _BOUNDS if hasattr(m, name)
    ]
    return " ".join([kind, " and ".join(bounds)]).strip()
