"""Text renderers for Gymnasium envs: (env, raw observation) -> the text the policy sees.

A renderer gets the env as well as the observation because many envs keep what matters outside
the observation: FrozenLake's observation is a cell number, the map is ``env.unwrapped.desc``.

* `strip_ansi` cleans ``render_mode="ansi"`` output. Escape codes would reach the tiny
  tokenizer as ``<unk>`` tokens, but a highlight carries information (FrozenLake and Taxi
  highlight the agent's cell), so a span with a background colour is kept as ``[span]``.
  Foreground colours are dropped (Taxi's passenger and destination letters differ only by
  colour: that is why Taxi's default renderer is the built-in one).
* `BUILTIN` holds clean renderers for the toy-text envs (``frozenlake``, ``taxi``,
  ``cliffwalking``, ``blackjack``), short enough for a small model's context.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

#: (the Gymnasium env, its raw observation) -> the text the policy sees.
Renderer = Callable[[Any, Any], str]

_SGR = re.compile(r"\x1b\[([0-9;]*)m")  # select graphic rendition: colours, bold, reset
_OTHER_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[@-Z\\-_]")
_BACKGROUNDS = frozenset(range(40, 48)) | frozenset(range(100, 108))


def strip_ansi(text: str) -> str:
    """`text` without ANSI escape codes; a span drawn on a background colour becomes ``[span]``."""
    out: list[str] = []
    pos, highlighted = 0, False
    for match in _SGR.finditer(text):
        out.append(text[pos : match.start()])
        pos = match.end()
        codes = {int(c) for c in match.group(1).split(";") if c}
        if codes & _BACKGROUNDS and not highlighted:
            out.append("[")
            highlighted = True
        elif highlighted and (not codes or 0 in codes or 49 in codes):  # reset, or default background
            out.append("]")
            highlighted = False
    out.append(text[pos:])
    if highlighted:
        out.append("]")
    return _OTHER_ESCAPES.sub("", "".join(out))


def render_ansi(env: Any, obs: Any) -> str:
    """``env.render()`` of an env made with ``render_mode="ansi"``, cleaned by `strip_ansi`."""
    text = env.render()
    if not isinstance(text, str):
        raise TypeError(
            f"env.render() returned {type(text).__name__}, not text; render: ansi needs an env made "
            "with render_mode='ansi' that supports it (see env.metadata['render_modes'])."
        )
    return strip_ansi(text).strip("\n")


def render_repr(env: Any, obs: Any) -> str:
    """The observation's ``str`` (numpy arrays in full, on one line)."""
    if hasattr(obs, "tolist"):
        obs = obs.tolist()
    return str(obs)


def render_text(env: Any, obs: Any) -> str:
    """The observation itself, which must be a string (a ``spaces.Text`` observation space)."""
    if not isinstance(obs, str):
        raise TypeError(f"the observation is {type(obs).__name__}, not text; pick another render.")
    return obs


def _grid(rows: list[str], agent: int, mark: str) -> str:
    cells = [list(row) for row in rows]
    row, col = divmod(int(agent), len(cells[0]))
    cells[row][col] = mark
    return "\n".join("".join(row) for row in cells)


def render_frozenlake(env: Any, obs: Any) -> str:
    """The map, one row a line (S start, F frozen, H hole, G goal), the agent's cell as ``A``."""
    rows = [b"".join(row).decode() for row in env.unwrapped.desc]
    return _grid(rows, int(obs), "A")


TAXI_STOPS = "RGYB"  # Taxi's four stops, in the order of its passenger/destination indices


def render_taxi(env: Any, obs: Any) -> str:
    """Taxi's state as a short sentence; the map (the walls) is in the description."""
    row, col, passenger, dest = env.unwrapped.decode(int(obs))
    where = "in the taxi" if passenger == 4 else f"at {TAXI_STOPS[passenger]}"
    return f"taxi at row {row}, column {col}; passenger {where}; destination {TAXI_STOPS[dest]}"


def render_cliffwalking(env: Any, obs: Any) -> str:
    """The 4x12 grid (o safe, C cliff, T goal), the agent's cell as ``x``, like Gymnasium's own."""
    rows_n, cols_n = env.unwrapped.shape
    rows = ["o" * cols_n for _ in range(rows_n - 1)] + ["o" + "C" * (cols_n - 2) + "T"]
    return _grid(rows, int(obs), "x")


def render_blackjack(env: Any, obs: Any) -> str:
    """``your sum 15; dealer shows 10`` (``, usable ace`` after the sum; A for the dealer's ace)."""
    total, dealer, ace = (int(v) for v in obs)
    shows = "A" if dealer == 1 else str(dealer)
    return f"your sum {total}{', usable ace' if ace else ''}; dealer shows {shows}"


_BLACKJACK = re.compile(r"your sum (\d+)(, usable ace)?; dealer shows (A|\d+)")


def blackjack_obs(text: str) -> tuple[int, int, int]:
    """The observation `render_blackjack` drew (or a ``repr`` rendering, ``(15, 10, 0)``)."""
    match = _BLACKJACK.search(text)
    if match:
        dealer = 1 if match.group(3) == "A" else int(match.group(3))
        return int(match.group(1)), dealer, int(bool(match.group(2)))
    numbers = [int(n) for n in re.findall(r"\d+", text)]
    if len(numbers) != 3:
        raise ValueError(f"cannot read a Blackjack state from {text[:60]!r}")
    return numbers[0], numbers[1], numbers[2]


#: Built-in renderers by name (the `render` param of `gym_spec`).
BUILTIN: dict[str, Renderer] = {
    "frozenlake": render_frozenlake,
    "taxi": render_taxi,
    "cliffwalking": render_cliffwalking,
    "blackjack": render_blackjack,
}
