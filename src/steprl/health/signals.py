"""Health signals: each a pure function of the last steps' metrics rows (oldest first, the
current step last), logged every step as `health/<name>`. A rule (`health/rules.py`) compares
them with thresholds.

Why these, and why this shape (docs/health.md, ../shared/reference/steering.md):
- RAGEN's echo trap shows as in-group reward variance falling, entropy falling, gradient norms
  spiking, reward stalling: `zero_var_share`, `group_std`, `entropy_drop`, `grad_norm_z`,
  `reward_slope`.
- Entropy in agent RL erupts and subsides in cycles (arXiv 2605.27954), so `entropy_drop`
  counts only a *sustained* fall below the entropy's own band (mean - k std of the steps before
  the run of low ones); an eruption above the band is not an alarm.
- A policy that stops calling its tool does so gradually and in silence: `tool_call_fall` is
  the fall of the smoothed tool-call rate from its peak in the window, as a share of the peak.
- One update can move a policy far without any token mismatch (the Gemma run: `approx_kl` 10.78
  at step 1 with engine/learner log-probs equal within 2e-5): `approx_kl` and
  `logprob_mismatch` tell the two apart.
- A reward that pays for something other than the task (a fixed phrase, a format bonus) shows
  first in its make-up: the total rises while the task's own component falls (`outcome_slope`,
  `proxy_gap`), several steps before held-out success does (docs/health_results.md).
- Template collapse (RAGEN-2) is invisible to entropy; its signals are `mi` and
  `mi_retrieval_gap`, which the teacher-forced probe writes (`health/mutual_info.py`).

To add one: a function (window, params) -> float | None here and one entry in `SIGNALS`;
`check_signal` (run by the tests over every entry) checks it. None: not enough history yet, or
the metric was not logged (a step that trained nothing); a rule never fires on None.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from steprl.registry import Registry, instance_of

Row = Mapping[str, float]
Window = Sequence[Row]  # oldest first; the current step is the last row


@dataclass(frozen=True)
class SignalSpec:
    fn: Callable[[Window], float | None]
    reads: tuple[str, ...]  # the metrics it reads (the checker feeds exactly these)
    doc: str
    min_steps: int = 1  # rows it needs before it says anything
    probe: bool = field(default=False)  # written by the MI probe, not computed from the window


def _series(window: Window, key: str) -> list[float]:
    """The finite values of `key` in the window, oldest first (steps without it are skipped)."""
    out = []
    for row in window:
        v = row.get(key)
        if v is not None and math.isfinite(v):
            out.append(float(v))
    return out


def _latest(key: str) -> Callable[[Window], float | None]:
    def fn(window: Window) -> float | None:
        v = window[-1].get(key) if window else None
        return float(v) if v is not None and math.isfinite(v) else None

    return fn


def _mean_last(key: str, n: int) -> Callable[[Window], float | None]:
    def fn(window: Window) -> float | None:
        xs = _series(window[-n:], key)
        return sum(xs) / len(xs) if xs else None

    return fn


def _slope(ys: Sequence[float]) -> float:
    """Least-squares slope of `ys` against 0, 1, 2, ... (two values or more)."""
    n = len(ys)
    x_mean, y_mean = (n - 1) / 2, sum(ys) / n
    sxx = sum((i - x_mean) ** 2 for i in range(n))
    return sum((i - x_mean) * (y - y_mean) for i, y in enumerate(ys)) / sxx


def reward_slope(window: Window) -> float | None:
    """Least-squares slope of `reward/mean` per step over the window (reward units per step)."""
    ys = _series(window, "reward/mean")
    return _slope(ys) if len(ys) >= 5 else None


PROXY_WINDOW = 8  # steps: long enough that a group-sampling wobble is not a trend
OUTCOME = "reward_component/outcome"
#: the shaping components whose recovery is learning, not a shortcut: penalties and costs, <= 0
#: by contract (envs/rewards.py: a format penalty fading is the ordinary early-training pattern)
PENALTIES = ("reward_component/format", "reward_component/cost")


def _paid(window: Window) -> list[float]:
    """Per step over the last PROXY_WINDOW steps: the mean reward paid for something other than
    the outcome, its penalties and its costs (`reward/mean` minus those components: a phrase
    bonus, a partial credit; 0 for an env whose reward is outcome + penalties)."""
    out = []
    for r in window[-PROXY_WINDOW:]:
        total, outcome = r.get("reward/mean"), r.get(OUTCOME)
        if total is None or outcome is None or not (math.isfinite(total) and math.isfinite(outcome)):
            continue
        penalties = [r.get(k) for k in PENALTIES]
        if any(p is not None and not math.isfinite(p) for p in penalties):
            continue
        out.append(float(total) - float(outcome) - sum(float(p) for p in penalties if p is not None))
    return out


def outcome_slope(window: Window) -> float | None:
    """Slope per step of the task's own reward component (`reward_component/outcome`) over the
    last PROXY_WINDOW steps. An env without components has its reward as the outcome."""
    outcome = _series(window[-PROXY_WINDOW:], OUTCOME)
    return _slope(outcome) if len(outcome) >= PROXY_WINDOW else None


def proxy_gap(window: Window) -> float | None:
    """Slope per step, over the last PROXY_WINDOW steps, of the reward paid for something other
    than the outcome (`_paid`): 0 for an env whose reward is its outcome plus penalties and
    costs (a fading format penalty does not count: that is learning); positive while a bonus
    the task does not need grows (a fixed phrase: the reward is being hacked)."""
    paid = _paid(window)
    return _slope(paid) if len(paid) >= PROXY_WINDOW else None


def _band(xs: Sequence[float]) -> tuple[float, float]:
    """(mean, std) of a reference stretch, the std floored at 5% of |mean| (a flat stretch is
    not a band of width 0)."""
    mean = sum(xs) / len(xs)
    std = statistics.pstdev(xs) if len(xs) > 1 else 0.0
    return mean, max(std, 0.05 * abs(mean), 1e-6)


ENTROPY_BAND_K = 2.0  # the band is mean +- 2 std of the reference steps
ENTROPY_REFERENCE = 6  # steps the band needs before the run of low ones


def entropy_drop(window: Window) -> float | None:
    """Steps in a row, ending now, with `actor/entropy` below its band: mean - 2 std of the
    steps before that run. 0 when the current step is inside or above the band (an eruption)."""
    xs = _series(window, "actor/entropy")
    if len(xs) < ENTROPY_REFERENCE + 1:
        return None
    run = 0
    while run < len(xs) - ENTROPY_REFERENCE:
        mean, std = _band(xs[: len(xs) - run - 1])
        if xs[len(xs) - run - 1] >= mean - ENTROPY_BAND_K * std:
            break
        run += 1
    return float(run)


def entropy_z(window: Window) -> float | None:
    """(current entropy - mean of the earlier steps) / their std: where it sits in its band."""
    xs = _series(window, "actor/entropy")
    if len(xs) < ENTROPY_REFERENCE + 1:
        return None
    mean, std = _band(xs[:-1])
    return (xs[-1] - mean) / std


def grad_norm_z(window: Window) -> float | None:
    """z-score of the current step's pre-clip `actor/grad_norm_max` against the earlier steps'."""
    xs = _series(window, "actor/grad_norm_max")
    if len(xs) < 6:  # a band of 5 steps: fewer spike on ordinary noise
        return None
    mean, std = _band(xs[:-1])
    return (xs[-1] - mean) / std


def tool_call_fall(window: Window) -> float | None:
    """How far the 3-step mean of `tools/call_rate` fell from its peak in the window, as a share
    of the peak (0: at its peak; 1: no calls left). None while the peak is under 0.05: an env
    whose policy never called a tool has nothing to abandon."""
    xs = _series(window, "tools/call_rate")
    if len(xs) < 3:
        return None
    smooth = [sum(xs[i - 2 : i + 1]) / 3 for i in range(2, len(xs))]
    peak = max(smooth)
    if peak < 0.05:
        return None
    return max(0.0, (peak - smooth[-1]) / peak)


SIGNALS: Registry[SignalSpec] = Registry(
    {
        "reward_slope": SignalSpec(reward_slope, ("reward/mean",), "slope of the mean reward per step", 5),
        "outcome_slope": SignalSpec(
            outcome_slope, (OUTCOME,), "slope of the outcome reward component per step", PROXY_WINDOW
        ),
        "proxy_gap": SignalSpec(
            proxy_gap,
            ("reward/mean", OUTCOME, *PENALTIES),
            "slope of the reward paid for other than the outcome, penalties and costs",
            PROXY_WINDOW,
        ),
        "zero_var_share": SignalSpec(
            _mean_last("reward/zero_variance_group_frac", 3),
            ("reward/zero_variance_group_frac",),
            "share of groups whose rewards are all equal (no GRPO gradient), last 3 steps",
        ),
        "tiny_std_share": SignalSpec(
            _latest("reward/tiny_std_group_frac"),
            ("reward/tiny_std_group_frac",),
            "share of groups whose rewards differ by a std under 0.05 (GRPO's std division amplifies it)",
        ),
        "group_std": SignalSpec(
            _mean_last("reward/group_std_mean", 3),
            ("reward/group_std_mean",),
            "mean in-group reward std, last 3 steps",
        ),
        "entropy_drop": SignalSpec(
            entropy_drop,
            ("actor/entropy",),
            "steps in a row below the entropy's own band",
            ENTROPY_REFERENCE + 1,
        ),
        "entropy_z": SignalSpec(
            entropy_z, ("actor/entropy",), "entropy against its band, in stds", ENTROPY_REFERENCE + 1
        ),
        "grad_norm_z": SignalSpec(grad_norm_z, ("actor/grad_norm_max",), "z-score of the gradient norm", 6),
        "clip_frac": SignalSpec(_latest("actor/clip_frac"), ("actor/clip_frac",), "share of tokens clipped"),
        "approx_kl": SignalSpec(
            _latest("actor/approx_kl"), ("actor/approx_kl",), "how far one step moved the policy (nats)"
        ),
        "tool_call_rate": SignalSpec(
            _mean_last("tools/call_rate", 3), ("tools/call_rate",), "episodes calling a tool, last 3 steps"
        ),
        "tool_call_fall": SignalSpec(
            tool_call_fall, ("tools/call_rate",), "fall of the tool-call rate from its peak (share)", 3
        ),
        "tool_valid": SignalSpec(
            _latest("tools/valid_frac"), ("tools/valid_frac",), "share of tool calls that parsed"
        ),
        "turns_mean": SignalSpec(
            _latest("episode/turns_mean"), ("episode/turns_mean",), "mean turns per episode"
        ),
        "logprob_mismatch": SignalSpec(
            _latest("actor/engine_logprob_diff_max"),
            ("actor/engine_logprob_diff_max",),
            "largest engine-learner log-prob difference",
        ),
        # written by the teacher-forced probe every health.mi_every steps (health/mutual_info.py)
        "mi": SignalSpec(
            _latest("health/mi"), ("health/mi",), "RAGEN-2 mutual-information estimate (nats)", probe=True
        ),
        "mi_retrieval_gap": SignalSpec(
            _latest("health/mi_retrieval_gap"),
            ("health/mi_retrieval_gap",),
            "retrieval accuracy minus chance (1/N)",
            probe=True,
        ),
    },
    key="health.rules.when.signal",
    what="signal",
    accept=instance_of(SignalSpec),
    expected="a SignalSpec (health/signals.py)",
    checker="steprl.health.signals:check_signal",
)


def compute_signals(window: Window) -> dict[str, float]:
    """Every signal with a value for this window, as `health/<name>` metrics (the probe's own
    are passed through by the probe, not here)."""
    out = {}
    for name, spec in SIGNALS.items():
        if spec.probe or len(window) < spec.min_steps:
            continue
        value = spec.fn(window)
        if value is not None and math.isfinite(value):
            out[f"health/{name}"] = value
    return out


def signal_value(name: str, window: Window) -> float | None:
    """One signal's value now (a probe's: the current row's, if the probe ran this step)."""
    spec = SIGNALS[name]
    if len(window) < spec.min_steps:
        return None
    value = spec.fn(window)
    return value if value is not None and math.isfinite(value) else None


class SignalCheckError(Exception):
    pass


def check_signal(name: str, spec: SignalSpec | None = None, *, seed: int = 0, trials: int = 40) -> None:
    """A signal is pure and reads only what it declares: on random windows of its `reads` (rows
    missing a value, NaN and infinite values among them; 0 to 25 rows) it gives a finite value or
    None, the same twice, and the same when the rows also hold keys it does not declare. Raises
    `SignalCheckError` naming what failed."""
    import random  # noqa: PLC0415 - only the checker draws

    spec = spec if spec is not None else SIGNALS.lookup(name)  # the entry `name` unless given

    rng = random.Random(seed)
    for _ in range(trials):
        rows: list[dict[str, float]] = []
        for _ in range(rng.randrange(0, 26)):
            row = {}
            for key in spec.reads:
                if rng.random() < 0.9:
                    row[key] = rng.choice(
                        [rng.gauss(0, 1), rng.random(), 0.0, 1.0, float("nan"), float("inf")]
                    )
            rows.append(row)
        try:
            first, second = spec.fn(rows), spec.fn(list(rows))
            noisy = spec.fn([{**r, "zz/undeclared": rng.random()} for r in rows])
        except Exception as exc:  # noqa: BLE001 - named in the error
            raise SignalCheckError(f"signal {name!r} raised {type(exc).__name__}: {exc} on {rows!r}") from exc
        if first is not None and not isinstance(first, float):
            raise SignalCheckError(f"signal {name!r} returned {type(first).__name__}, not float | None")
        if first is not None and not math.isfinite(first):
            raise SignalCheckError(f"signal {name!r} returned {first} on {rows!r}: return None instead")
        if not _same(first, second) or not _same(first, noisy):
            raise SignalCheckError(f"signal {name!r}: not pure, or it reads keys it does not declare")


def _same(a: float | None, b: float | None) -> bool:
    return a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b))


__all__ = [
    "SIGNALS",
    "SignalCheckError",
    "SignalSpec",
    "Window",
    "check_signal",
    "compute_signals",
    "signal_value",
]
