"""`steprl show RUN [--step N] [--task ID] [--eval]`: a run's saved episodes in the terminal, for
when a browser is not at hand.

Without `--task`: a summary of one step's file (episodes, success, reward, end reasons, per env,
per task). With `--task`: that task's episodes of the step, turn by turn: the model's tokens
coloured by the advantage the learner trained them with (green positive, red negative, brighter
for a larger |A|, scaled to the step's largest; plain where there is none: a held-out episode,
or one not trained on), the prompt and observations dimmed and labelled as masked (never
trained), each turn's reward (and its components) and policy version, and the end reason.
`--eval` reads the held-out evaluations (`eval_trajectories/`) instead of the training steps.
Below a summary, one line lists the run's health-rule firings (health.jsonl), if it has any.

Reads only the run directory: the Parquet files (`sinks.TrajectoryWriter`), health.jsonl and,
to split a turn into its tokens' text, the `tokenizer.json` of one of the run's checkpoints
(without one, each turn is one piece coloured by its mean advantage). Bad input is one line
naming what exists.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.color import Color
from rich.console import Console, Group
from rich.style import Style
from rich.table import Table
from rich.text import Text

from steprl.diagnostics.metrics import is_success
from steprl.diagnostics.sinks import read_metrics_jsonl, read_trajectories, readable_parquet
from steprl.errors import UserError
from steprl.types import NOT_TRAINABLE, EndReason, Trajectory

TRAIN_DIR, EVAL_DIR = "trajectories", "eval_trajectories"
MASKED = Style(dim=True)
TokenText = Callable[[Sequence[int]], list[str]]  # ids -> each token's text, in context


def show_run(
    run: Path, *, step: int | None = None, task: str | None = None, evaluated: bool = False, console: Console
) -> None:
    """Print a step's summary (`task` None) or `task`'s episodes at `step` (default: the last)."""
    directory = episodes_dir(run, evaluated)
    steps = saved_steps(directory)
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise UserError(f"{directory} has no step {step}; saved steps: {compact(steps)}")
    damaged = readable_parquet(directory / f"step_{step:06d}.parquet")
    if (
        damaged is not None
    ):  # a run killed while writing it, or a damaged disk: one line, not Arrow's traceback
        others = [s for s in steps if s != step]
        raise UserError(
            f"{directory / f'step_{step:06d}.parquet'} cannot be read ({damaged}); "
            f"other saved steps: {compact(others) if others else 'none'} (--step N)"
        )
    rows = read_trajectories(directory / f"step_{step:06d}.parquet").to_pylist()
    what = "evaluation" if evaluated else "step"
    if task is None:
        console.print(summary(rows, f"{run.name}: {what} {step}", steps))
        line = health_line(run / "health.jsonl")
        if line:
            console.print(line, highlight=False)
        return
    episodes = [r for r in rows if r["task_id"] == task]
    if not episodes:
        tasks = list(dict.fromkeys(r["task_id"] for r in rows))
        more = f", ... ({len(tasks)} in all)" if len(tasks) > 12 else ""
        raise UserError(
            f"no task {task!r} at {what} {step} of {run}; its tasks: {', '.join(tasks[:12])}{more}"
        )
    token_text = checkpoint_token_text(run)
    scale = max((abs(a) for r in rows for turn in r["advantages"] or () for a in turn), default=0.0)
    console.print(legend(scale, token_text is not None), highlight=False)
    for k, row in enumerate(episodes, start=1):
        console.print(render_episode(row, f"{what} {step}, sample {k}/{len(episodes)}", scale, token_text))


# -- finding what was saved --------------------------------------------------------------------


def episodes_dir(run: Path, evaluated: bool) -> Path:
    """The run's training (or held-out) episode directory; a missing run or directory is one line."""
    if not run.is_dir():
        parent = run.parent if str(run.parent) else Path(".")
        runs = (
            sorted(p.name for p in parent.iterdir() if (p / "metrics.jsonl").is_file())
            if parent.is_dir()
            else []
        )
        where = f"runs in {parent}: {', '.join(runs)}" if runs else f"no run directories in {parent}"
        raise UserError(f"no run directory {run}; {where}")
    directory = run / (EVAL_DIR if evaluated else TRAIN_DIR)
    if not directory.is_dir():
        saved = [d for d in (TRAIN_DIR, EVAL_DIR) if (run / d).is_dir()]
        why = (
            "it was trained before held-out episodes were saved, or "
            if evaluated and (run / TRAIN_DIR).is_dir()
            else ""
        )
        has = f"it has {', '.join(f'{d}/' for d in saved)}" if saved else "it has no saved episodes"
        raise UserError(f"{run} has no {directory.name}/ ({why}logging.save_trajectories was false); {has}")
    return directory


def saved_steps(directory: Path) -> list[int]:
    found = (re.fullmatch(r"step_(\d+)\.parquet", f.name) for f in directory.iterdir())
    steps = sorted(int(m.group(1)) for m in found if m is not None)
    if not steps:
        raise UserError(f"{directory} holds no step files (step_NNNNNN.parquet) yet")
    return steps


def compact(steps: Sequence[int]) -> str:
    """`0-3, 5, 8-9`: runs of consecutive steps."""
    spans: list[list[int]] = []
    for s in steps:
        if spans and s == spans[-1][-1] + 1:
            spans[-1][-1:] = [s] if len(spans[-1]) == 2 else [spans[-1][0], s]
        else:
            spans.append([s])
    return ", ".join("-".join(map(str, span)) for span in spans)


def checkpoint_token_text(run: Path) -> TokenText | None:
    """Each token's text, from the `tokenizer.json` of the run's latest checkpoint (any checkpoint:
    the tokenizer does not change in a run); None if no checkpoint holds one."""
    root = run / "checkpoints"
    candidates = [root / "latest", *sorted(root.glob("step_*"), reverse=True)] if root.is_dir() else []
    found = next((c / "tokenizer.json" for c in candidates if (c / "tokenizer.json").is_file()), None)
    if found is None:
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(found))
    return lambda ids: token_texts(ids, lambda part: str(tok.decode(list(part), skip_special_tokens=False)))


def token_texts(ids: Sequence[int], decode: Callable[[Sequence[int]], str], window: int = 6) -> list[str]:
    """Each token's text as it reads in context: what it adds to the few tokens before it (a lone
    token loses its leading space in some tokenizers, and half a UTF-8 character is no text)."""
    out = []
    for k in range(len(ids)):
        before = decode(ids[max(0, k - window) : k])
        with_it = decode(ids[max(0, k - window) : k + 1])
        out.append(with_it[len(before) :] if with_it.startswith(before) else decode(ids[k : k + 1]))
    return out


# -- a step's summary --------------------------------------------------------------------------


def _trajectory(row: dict[str, Any]) -> Trajectory:
    """The row as far as the metrics' success rule reads it (no steps)."""
    info = json.loads(row["info_json"] or "{}")
    return Trajectory(
        row["task_id"], row["group_id"], row["env"], (), row["outcome_reward"], EndReason(row["end"]), info
    )


def _scored(rows: Sequence[dict[str, Any]]) -> list[Trajectory]:
    """The episodes that count for success and reward: infra failures are counted, never scored."""
    return [t for t in map(_trajectory, rows) if t.end not in NOT_TRAINABLE]


def _rate(trajs: Sequence[Trajectory]) -> str:
    return f"{sum(map(is_success, trajs)) / len(trajs):.3f}" if trajs else "-"


def _mean_reward(trajs: Sequence[Trajectory]) -> str:
    return f"{sum(t.outcome_reward for t in trajs) / len(trajs):+.3f}" if trajs else "-"


def summary(rows: Sequence[dict[str, Any]], title: str, steps: Sequence[int]) -> Group:
    """One table (the step's totals, then per env with several, and per task) and a line."""
    scored = _scored(rows)
    ends = Counter(r["end"] for r in rows)
    trained = sum(r["advantages"] is not None for r in rows)
    turns = sum(r["num_steps"] for r in rows) / max(1, len(rows))
    table = Table(title=title, title_justify="left", show_header=True, header_style="bold")
    for col in ("", "episodes", "success", "reward", "end reasons"):
        table.add_column(col)
    table.add_row(
        "all",
        str(len(rows)),
        _rate(scored),
        _mean_reward(scored),
        ", ".join(f"{e} {n}" for e, n in ends.most_common()),
    )
    envs = sorted({r["env"] for r in rows})
    groups: list[tuple[str, list[dict[str, Any]]]] = []
    if len(envs) > 1:
        groups += [(f"env {e}", [r for r in rows if r["env"] == e]) for e in envs]
    for task in dict.fromkeys(r["task_id"] for r in rows):
        groups.append((f"task {task}", [r for r in rows if r["task_id"] == task]))
    for label, part in groups:
        s = _scored(part)
        table.add_row(
            label,
            str(len(part)),
            _rate(s),
            _mean_reward(s),
            ", ".join(f"{e} {n}" for e, n in Counter(r["end"] for r in part).most_common()),
        )
    line = (
        f"{trained}/{len(rows)} episodes trained on (with advantages); {turns:.2f} turns per episode; "
        f"saved steps: {compact(steps)}; one task's episodes: --task ID"
    )
    return Group(table, Text(line))


def health_line(path: Path, most: int = 8) -> str | None:
    """`health: N firings (rule at step, ...)` from the trainer's health.jsonl (the run's, not one
    step's: a rule that fired is worth seeing whichever step is shown); None without the file.
    Damaged lines are left out, as the report leaves them."""
    if not path.is_file():
        return None
    firings = [f for f in read_metrics_jsonl(path, skip_bad=lambda _: None) if isinstance(f.get("rule"), str)]
    if not firings:
        return "health: no rule fired"
    shown = [f"{f['rule']} at {f.get('step', '?')}" for f in firings[:most]]
    more = f", ... {len(firings) - most} more" if len(firings) > most else ""
    observed = "; observed only (health.act: false)" if not any(f.get("acted") for f in firings) else ""
    plural = "" if len(firings) == 1 else "s"
    return f"health: {len(firings)} firing{plural} ({', '.join(shown)}{more}){observed}"


# -- one episode, turn by turn -----------------------------------------------------------------


def advantage_style(advantage: float | None, scale: float) -> Style:
    """Green for a positive advantage, red for a negative one, brighter the larger |A| is against
    `scale` (the step's largest); plain for none."""
    if advantage is None:
        return Style()
    if advantage == 0 or scale <= 0:
        return Style(bgcolor=Color.from_rgb(60, 60, 60))
    level = int(70 + 150 * min(1.0, abs(advantage) / scale))
    rgb = (0, level, 0) if advantage > 0 else (level, 0, 0)
    return Style(color="white", bgcolor=Color.from_rgb(*rgb))


def legend(scale: float, per_token: bool) -> Text:
    text = Text("model tokens coloured by advantage: ")
    text.append(" + ", advantage_style(scale, scale)).append(" positive  ")
    text.append(" - ", advantage_style(-scale, scale)).append(" negative  ")
    text.append(f"(brighter: larger |A|, up to {scale:.3g} this step; plain: no advantage)  ")
    text.append("dim: prompt and observations, masked (not trained)", MASKED)
    if not per_token:
        text.append("\nno tokenizer.json in the run's checkpoints: each turn coloured by its mean advantage")
    return text


def _masked(label: str, text: str) -> Text:
    return Text(f"[{label}: masked] ", MASKED).append(text, MASKED)


def _turn_header(k: int, row: dict[str, Any], info: dict[str, Any], adv: Sequence[float] | None) -> Text:
    parts = [f"turn {k + 1}", f"policy v{row['policy_versions'][k]}", f"reward {row['rewards'][k]:+.3f}"]
    components = info.get("reward_components")
    if isinstance(components, dict) and components:
        parts[-1] += " (" + ", ".join(f"{n} {float(v):+.3f}" for n, v in components.items()) + ")"
    if "action_kind" in info:
        parts.append(str(info["action_kind"]))
    if adv:
        parts.append(f"A mean {sum(adv) / len(adv):+.3f}")
    return Text(" · ".join(parts), style="bold")


def render_episode(row: dict[str, Any], where: str, scale: float, token_text: TokenText | None) -> Text:
    """One episode: a header, the first prompt (masked), then per turn its header, the model's
    tokens coloured by advantage and the observation (masked)."""
    success = "yes" if is_success(_trajectory(row)) else "no"
    out = Text(
        f"\n{where} · task {row['task_id']} · env {row['env']} · group {row['group_id']} · end {row['end']} "
        f"· outcome reward {row['outcome_reward']:+.3f} · success {success}\n",
        style="bold underline",
    )
    prompt = row.get("prompt_text")
    if prompt is None:
        prompt = (
            "".join(token_text(row["prompt_ids"])) if token_text else f"<{len(row['prompt_ids'])} tokens>"
        )
    out.append_text(_masked("prompt", prompt)).append("\n")
    advantages = row["advantages"]
    for k, ids in enumerate(row["action_ids"]):
        adv = advantages[k] if advantages is not None else None
        info = json.loads(row["step_info_json"][k] or "{}")
        out.append_text(_turn_header(k, row, info, adv)).append("\n")
        if token_text is not None:
            for piece, a in zip(token_text(ids), adv if adv is not None else [None] * len(ids), strict=True):
                out.append(piece, advantage_style(a, scale))
        else:  # no tokenizer: the turn's text, coloured by its mean advantage
            text = (row.get("action_texts") or [None] * len(row["action_ids"]))[k] or f"<{len(ids)} tokens>"
            out.append(text, advantage_style(sum(adv) / len(adv) if adv else None, scale))
        obs = row["observation_ids"][k]
        if obs:
            texts = row.get("observation_texts")
            obs_text = (
                texts[k] if texts else ("".join(token_text(obs)) if token_text else f"<{len(obs)} tokens>")
            )
            out.append("\n").append_text(_masked("observation", obs_text))
        out.append("\n")
    return out


__all__ = [
    "advantage_style",
    "compact",
    "episodes_dir",
    "health_line",
    "render_episode",
    "show_run",
    "summary",
    "token_texts",
]
