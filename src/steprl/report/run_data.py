"""What a report reads from a run directory, loaded once: the config, the metrics rows, the health
rules' firings (health.jsonl), the saved train and held-out episodes, and the run's tokenizer
(for the text of each token).

`RunData` is what every section's function receives; `vs` holds the runs it is compared with
(`steprl report RUN --vs RUN2`), each a `RunData` of its own with no `vs`. Nothing here renders.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from steprl.bounded_yaml import load_yaml_bounded
from steprl.diagnostics.sinks import TRAJECTORY_SCHEMA, read_metrics_jsonl, read_trajectories
from steprl.report.budget import clip, size

HEALTH_FILE = "health.jsonl"  # the trainer's record of each health rule's firing, one JSON line each


@dataclass(frozen=True)
class Caps:
    """How much of a run a report embeds, so that the page stays under 10 MB whatever the run
    holds, and quick to build and to draw. Which episodes: whole groups of train episodes per
    step (a group's advantages are relative to each other, so a group is shown whole), held-out
    episodes per evaluation, at most `episodes` in all, spread over the run. How much of each:
    the byte shares below, measured as the page stores them (`report.budget.size`), each
    episode cut to fit its share (`report.embed`). The shares add up to 9 MB; the page's own
    script, styles and header are the rest."""

    train_groups_per_step: int = 2
    eval_per_evaluation: int = 200
    diff_pairs: int = 12  # held-out tasks offered in the learning diff
    episodes: int = 3000  # the trajectory browser's episodes, at most
    episode_bytes: int = 4_500_000  # the browser's episodes and the token texts they add
    diff_bytes: int = 1_500_000  # the learning diff's episodes and the token texts they add
    other_bytes: int = 3_000_000  # every other section together
    section_bytes: int = 1_000_000  # any one other section
    turn_tokens: int = 2048  # the most ids of one prompt, action or observation
    episode_tokens: int = 40_000  # the most ids of one episode (the page draws one at a time)
    max_turns: int = 100  # the most turns of one episode: the first ones and the last
    text_chars: int = 200  # a task id, group id, env name
    info_chars: int = 2000  # a turn's info (JSON text)
    curve_points: int = 500  # one curve's points (each bucket's low and high kept)
    notes: int = 20  # the notes in the page's header (what could not be read)


TOKEN_CHARS = 64  # one token's text in the table: a real token is shorter


class TokenText:
    """The text of each token id, decoded once per id (`decode([id])`) and kept in one table, so
    the page stores each distinct token's text once and episodes as lists of ids. `bytes` is
    what the table adds to the page; `cost` what some ids would add before they are `use`d."""

    def __init__(self, decode: Callable[[list[int]], str] | None, note: str = "") -> None:
        self._decode = decode
        self.note = note  # why tokens show as ids (no tokenizer), else ""
        self._texts: dict[int, str] = {}
        self._decoded: dict[int, str] = {}  # decoded, used or not
        self.bytes = 2  # "{}"

    def _entry_bytes(self, token_id: int) -> int:
        return size(str(token_id)) + size(self._text(token_id)) + 2  # "id":"text",

    def cost(self, ids: Sequence[int]) -> int:
        """The bytes the table grows by when `ids` are used."""
        return sum(self._entry_bytes(i) for i in {int(i) for i in ids} if i not in self._texts)

    def use(self, ids: Sequence[int]) -> list[int]:
        """Record `ids` for the page's token table; returns them as a plain list."""
        out = [int(i) for i in ids]
        for i in out:
            if i not in self._texts:
                self.bytes += self._entry_bytes(i)
                self._texts[i] = self._text(i)
        return out

    def mark(self) -> int:
        """A point `rollback` returns the table to (the ids used so far)."""
        return len(self._texts)

    def rollback(self, mark: int) -> None:
        """Forget the ids used since `mark` (a section whose data the page dropped)."""
        for i in list(self._texts)[mark:]:
            self.bytes -= self._entry_bytes(i)
            del self._texts[i]

    def _text(self, token_id: int) -> str:
        if token_id not in self._decoded:
            self._decoded[token_id] = clip(self._decode_one(token_id), TOKEN_CHARS)
        return self._decoded[token_id]

    def _decode_one(self, token_id: int) -> str:
        if self._decode is None:
            return f"\u27e8{token_id}\u27e9"
        try:
            return self._decode([token_id])
        except Exception:  # an id the tokenizer does not know (a corrupt row): show the id
            return f"\u27e8{token_id}\u27e9"

    def table(self) -> dict[str, str]:
        """{id: text} of every id used so far (JSON object keys are strings)."""
        return {str(i): t for i, t in sorted(self._texts.items())}


@dataclass(frozen=True)
class RunData:
    """One run as a report sees it. Tables have `TRAJECTORY_SCHEMA`'s columns (empty when the run
    saved none); `metrics` holds the rows of metrics.jsonl in order, `health` the firings of
    health.jsonl in order (each {step, rule, signals, actions, outcome, acted}, as the trainer
    writes them; empty when no rule fired or health was off)."""

    path: Path
    label: str
    config: Mapping[str, Any]
    metrics: tuple[Mapping[str, Any], ...]
    train: pa.Table
    evals: pa.Table
    tokens: TokenText
    caps: Caps = Caps()
    vs: tuple[RunData, ...] = ()
    notes: tuple[str, ...] = field(default=())  # what could not be read, shown on the page
    health: tuple[Mapping[str, Any], ...] = ()


def empty_run(label: str = "empty", config: Mapping[str, Any] | None = None) -> RunData:
    """A run with nothing recorded: what every section must render without raising."""
    none = TRAJECTORY_SCHEMA.empty_table()
    return RunData(Path("."), label, dict(config or {}), (), none, none, TokenText(None), health=())


def load_run(
    run_dir: str | Path,
    *,
    decode: Callable[[list[int]], str] | None = None,
    caps: Caps = Caps(),
    vs: Sequence[RunData] = (),
    episodes: bool = True,
) -> RunData:
    """Read `run_dir`. `decode` (ids -> text): the run's tokenizer's, when the caller holds it (the
    trainer); else it is loaded from the config (`load_decoder`). Without `episodes` (a run that
    is only compared with: its config and curves) neither the episodes nor the tokenizer."""
    path = Path(run_dir)
    if not (path / "metrics.jsonl").exists() and not (path / "config.yaml").exists():
        raise FileNotFoundError(
            f"{path} is not a run directory (no metrics.jsonl or config.yaml); "
            "give the directory a run wrote, e.g. runs/calculator_tiny"
        )
    notes: list[str] = []
    config: dict[str, Any] = {}
    if (path / "config.yaml").exists():
        config_file = path / "config.yaml"
        loaded = load_yaml_bounded(config_file.read_text(encoding="utf-8"), str(config_file))
        config = loaded if isinstance(loaded, dict) else {}
    metrics: list[dict[str, Any]] = []
    if (path / "metrics.jsonl").exists():
        metrics = read_metrics_jsonl(path / "metrics.jsonl", skip_bad=notes.append)
    health = read_health(path / HEALTH_FILE, notes.append)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train = _episodes(path / "trajectories") if episodes else TRAJECTORY_SCHEMA.empty_table()
        evals = _episodes(path / "eval_trajectories") if episodes else TRAJECTORY_SCHEMA.empty_table()
    notes.extend(str(w.message) for w in caught)
    if decode is None and episodes:
        decode, note = load_decoder(path, config)
        if note:
            notes.append(note)
    tokens = TokenText(decode, note="" if decode or not episodes else "no tokenizer: tokens shown as ids")
    label = run_label(path, config)
    return RunData(
        path, label, config, tuple(metrics), train, evals, tokens, caps, tuple(vs), tuple(notes), health
    )


def read_health(path: Path, skip_bad: Callable[[str], None]) -> tuple[dict[str, Any], ...]:
    """The firings `path` (<run_dir>/health.jsonl) records, in order; none without the file. A line
    that is not a firing (not JSON, no integer step, no rule name) is skipped and told to
    `skip_bad`, as a damaged metrics line is: one bad line must not cost the report."""
    if not path.exists():
        return ()
    firings = []
    for row in read_metrics_jsonl(path, skip_bad=skip_bad):
        if not isinstance(row.get("step"), int) or not isinstance(row.get("rule"), str):
            skip_bad(f"{path}: a line with no integer step or no rule name (keys {sorted(row)}); dropped")
            continue
        firings.append(row)
    return tuple(firings)


def run_label(run_dir: Path, config: Mapping[str, Any] | None = None) -> str:
    """A run's name on the page: run.name from its config, else its directory's name."""
    if config is None:
        path = run_dir / "config.yaml"
        loaded = load_yaml_bounded(path.read_text(encoding="utf-8"), str(path)) if path.exists() else None
        config = loaded if isinstance(loaded, dict) else {}
    return str((config.get("run") or {}).get("name") or run_dir.name)


def _episodes(directory: Path) -> pa.Table:
    if not directory.is_dir():
        return TRAJECTORY_SCHEMA.empty_table()
    return read_trajectories(directory)


def load_decoder(run_dir: Path, config: Mapping[str, Any]) -> tuple[Callable[[list[int]], str] | None, str]:
    """The run's tokenizer's `decode`, and a note when there is none. First the tokenizer.json the
    last checkpoint holds, read with `tokenizers` alone (importing transformers costs seconds,
    longer than building the whole report); else the embedded tiny tokenizer (model.name=tiny);
    else transformers' loader over the checkpoint (a tokenizer without tokenizer.json)."""
    latest = run_dir / "checkpoints" / "latest"
    if (latest / "tokenizer.json").exists():
        try:
            from tokenizers import Tokenizer

            fast = Tokenizer.from_file(str(latest / "tokenizer.json"))
            return (lambda ids: fast.decode(ids, skip_special_tokens=False)), ""
        except Exception:  # an unreadable file: the loaders below
            pass
    if str((config.get("model") or {}).get("name") or "tiny") == "tiny":
        from steprl.models.tiny import build_tokenizer

        tiny = build_tokenizer(((config.get("model") or {}).get("tiny") or {}).get("words") or ())
        return (lambda ids: str(tiny.decode(ids))), ""
    try:
        from transformers import AutoTokenizer

        auto = AutoTokenizer.from_pretrained(str(latest), local_files_only=True)
        return (lambda ids: str(auto.decode(ids))), ""
    except Exception as exc:  # a run without a checkpoint: the page shows token ids
        return None, f"no tokenizer in {latest} ({type(exc).__name__}); tokens are shown as ids"


def is_success(row: Mapping[str, Any]) -> bool:
    """An episode row's success, as `diagnostics.metrics.is_success` decides it for a Trajectory:
    the env's verdict (info["success"]) when given, else the full reward (>= 1)."""
    try:
        info = json.loads(row.get("info_json") or "{}")
    except json.JSONDecodeError:
        info = {}
    if isinstance(info, dict) and "success" in info:
        return bool(info["success"])
    return float(row.get("outcome_reward") or 0.0) >= 1.0


def json_object(text: str) -> dict[str, Any]:
    """`text` parsed as a JSON object; anything else kept as a value or as the raw text."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return {"raw": str(text)}
    return value if isinstance(value, dict) else {"value": value}
