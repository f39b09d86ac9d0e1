"""metrics.jsonl, declared: the run's record of its steps, evaluations and events as typed, versioned lines.

This module is the file's one writer (``MetricsFile``, which RunRecords and the torch engine's rank 0 append through)
and its one reader (``read_metrics`` / ``parse_lines``): the report, the comparison with the plan, the pictures,
the run profile, TensorBoard, W&B, recovery and bench take the lines as the records below and read their fields
by name, never a line by a string key.

One JSON object per line, four kinds, each line carrying ``"format": FORMAT``:

- ``StepLine``: a training step (``step`` numbered from 1: records.STEP_NUMBERS), its loss, rates and per-stage
  measurements (one entry per stage of the plan the step ran on);
- ``EvalLine``: a held-out evaluation after step ``step`` (``eval_loss``);
- ``RebalanceEvent`` (``"event": "rebalance"``): a move of layers between stages after ``after_step`` steps;
- ``RecoveryEvent`` (``"event": "recovery"``; ``"kind": "rejoin"`` for a device back): the run going on with
  other devices after ``after_step`` steps.

Fields are added with a default, so lines written before them (``format`` absent: format 0, the same fields)
read as they were; a field this hetero does not know (a later one's) is skipped, and a line of a later format
is refused in one line. A last line without its newline that does not parse is one a live run is still writing:
it is left for the next read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TypeVar

from hetero.errors import ConfigError
from hetero.runtime.base.rundir import append_run_line, write_run_file
from hetero.serde import from_dict, to_dict

FORMAT = 1
NAME = "metrics.jsonl"


@dataclass(kw_only=True)
class StepLine:
    """One training step. ``tokens_per_s`` counts trained (label) tokens, the tokens the loss is over;
    ``computed_tokens`` every row's seq_len tokens, padding included; ``record_tokens`` the step's tokens that are
    not padding (where the writer knew them). Per stage: busy and wall seconds, seconds per op (F, B, ...), a CPU
    stage's process CPU seconds per op, the median seconds a received kind took to arrive, the device's telemetry
    (None where there is none), and on plans that stream weights from host RAM the bytes streamed and the most
    frozen bytes resident at once."""

    step: int
    loss: float
    step_time_s: float
    lr: float | None = None
    grad_norm: float | None = None
    clip_coef: float | None = None
    label_tokens: int | None = None
    computed_tokens: int | None = None
    record_tokens: int | None = None
    tokens_per_s: float | None = None
    computed_tokens_per_s: float | None = None
    stage_busy: list[float] = field(default_factory=list)
    stage_wall: list[float] = field(default_factory=list)
    stage_ops: list[dict[str, float]] = field(default_factory=list)
    stage_cpu_ops: list[dict[str, float] | None] | None = None
    stage_links: list[dict[str, float] | None] | None = None
    stage_telemetry: list[dict[str, Any] | None] | None = None
    stage_streamed_bytes: list[int | None] | None = None
    stage_frozen_resident_peak_bytes: list[int | None] | None = None
    split: list[int] | None = None  # decoder layers per stage on this step
    engine: str | None = None  # "torch": written by `hetero run --engine torch`


@dataclass(kw_only=True)
class EvalLine:
    """The held-out loss of the adapter after ``step`` steps, over ``eval_tokens`` label tokens, computed in
    ``eval_s`` seconds (``eval_on``: "training stages", or None for the evaluator on its own device)."""

    step: int
    eval_loss: float
    eval_tokens: int | None = None
    eval_s: float | None = None
    eval_on: str | None = None


@dataclass(kw_only=True)
class MoveCause:
    """Why a rebalancing move was made: the slowed stage, its device, its measured slowdown, the throttle the
    device reported (if any) and the reason in words; all None but ``reason`` for a move the caller forced."""

    reason: str
    stage: int | None = None
    device: str | None = None
    slowdown: float | None = None
    throttle: str | None = None


@dataclass(kw_only=True)
class RebalanceEvent:
    """A move of layers after ``after_step`` steps: the split and node spans before and after (a re-plan's: every
    chunk's span, stage by stage), what the watcher predicted of it, how long the move took (a re-plan's: from the
    stages' stop to the first step after it) and the split it left."""

    event: Literal["rebalance"] = "rebalance"
    after_step: int
    cause: MoveCause
    old_split: list[int]
    new_split: list[int]
    old_spans: list[list[int]]
    new_spans: list[list[int]]
    speed_factors: list[float] | None = None
    predicted_step_s_before: float | None = None
    predicted_step_s_after: float | None = None
    predicted_gain: float | None = None
    predicted_stage_s_after: list[float] | None = None
    move_s: float | None = None
    split: list[int] | None = None
    plan: str | None = None  # a re-plan's plan file in the run dir (runtime/run/replan_moves.py); None: in place
    started_at: float | None = None  # time.monotonic() when a re-plan stopped the stages (not written)


@dataclass(kw_only=True)
class RecoveryEvent:
    """The run going on after ``after_step`` steps without a lost device (or, ``kind`` "rejoin", with one that came
    back): from ``resumed_from_step`` (``replayed_steps`` trained again), on ``devices`` with ``new_split``, under
    the plan file ``plan`` in the run dir; ``recovery_s`` the seconds from the loss to the first step after it."""

    event: Literal["recovery"] = "recovery"
    after_step: int
    recovery: int
    device: str
    host: str
    cause: str
    resumed_from_step: int
    replayed_steps: int
    old_split: list[int]
    new_split: list[int]
    devices: list[str]
    plan: str
    predicted_step_s_after: float | None = None
    kind: str | None = None
    stage: int | None = None
    lost_devices: list[str] | None = None
    step_s_before: float | None = None
    step_s_after: float | None = None
    lost_at: float | None = None  # the coordinator's clock at the loss (in memory only: not written)
    recovery_s: float | None = None


Event = RebalanceEvent | RecoveryEvent
Line = StepLine | EvalLine | RebalanceEvent | RecoveryEvent
T = TypeVar("T")


@dataclass
class RunLines:
    """A metrics.jsonl read: its lines in file order, and each kind apart."""

    lines: list[Line]

    @property
    def steps(self) -> list[StepLine]:
        return [x for x in self.lines if isinstance(x, StepLine)]

    @property
    def evals(self) -> list[EvalLine]:
        return [x for x in self.lines if isinstance(x, EvalLine)]

    @property
    def moves(self) -> list[RebalanceEvent]:
        return [x for x in self.lines if isinstance(x, RebalanceEvent)]

    @property
    def recoveries(self) -> list[RecoveryEvent]:
        return [x for x in self.lines if isinstance(x, RecoveryEvent)]


# The scalars TensorBoard and W&B chart, by the tag they chart them under (trained tokens are label tokens: docs/data.md).
STEP_TAGS = {"train/loss": "loss", "train/learning_rate": "lr", "train/grad_norm": "grad_norm",
             "train/clip_coef": "clip_coef", "train/trained_tokens_per_s": "tokens_per_s",
             "train/computed_tokens_per_s": "computed_tokens_per_s", "train/step_time_s": "step_time_s"}
EVAL_TAGS = {"eval/loss": "eval_loss"}


def charted(line: StepLine | EvalLine) -> dict[str, float]:
    """The line's scalars by their TensorBoard / W&B tag (the ones it has)."""
    tags = STEP_TAGS if isinstance(line, StepLine) else EVAL_TAGS
    values = {tag: getattr(line, name) for tag, name in tags.items()}
    return {tag: float(v) for tag, v in values.items() if v is not None}


def to_json(line: Line) -> str:
    """The line as metrics.jsonl holds it: its fields that are set, and its format."""
    data = {k: v for k, v in to_dict(line).items() if v is not None and k not in ("lost_at", "started_at")}
    return json.dumps({**data, "format": FORMAT})


def _known(cls: type[T], data: dict[str, Any], where: str) -> T:
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]  # cls is a dataclass
    return from_dict(cls, {k: v for k, v in data.items() if k in names}, where, error=ConfigError)


def parse_line(data: Any, where: str = "metrics.jsonl") -> Line | None:
    """The record of one parsed JSON line; None for a line that is none of the four kinds. A line of a later format
    or with a field of the wrong type is a ConfigError naming ``where`` and the field."""
    if not isinstance(data, dict):
        return None
    found = data.get("format", 0)
    if not isinstance(found, int) or isinstance(found, bool) or found > FORMAT:
        raise ConfigError(f"{where}: a metrics line of format {str(found)[:20]}, this hetero reads format {FORMAT} and "
                          "earlier: read it with the hetero that wrote it")
    kind = data.get("event")
    if kind == "rebalance":
        return _known(RebalanceEvent, data, where)
    if kind == "recovery":
        return _known(RecoveryEvent, data, where)
    if kind is not None:
        return None
    if "eval_loss" in data:
        return _known(EvalLine, data, where)
    if "step_time_s" in data:
        return _known(StepLine, _upgraded(data), where)
    return None


def _upgraded(data: dict[str, Any]) -> dict[str, Any]:
    """A step line of format 0 from before trained tokens were counted: its "tokens" was the computed count and
    its tokens_per_s that count's rate."""
    if "tokens" not in data or "computed_tokens" in data:
        return data
    out = {**data, "computed_tokens": data["tokens"], "computed_tokens_per_s": data.get("tokens_per_s")}
    labels, seconds = data.get("label_tokens"), data.get("step_time_s")
    out["tokens_per_s"] = labels / seconds if isinstance(labels, int) and isinstance(seconds, (int, float)) \
        and seconds > 0 else None
    return out


def eval_line(answer: Any) -> EvalLine | str:
    """An evaluator's answer (a JSON object from its process: runtime/tools/evaluator.py) as its line, or the error
    it names (or that makes it no evaluation) in words."""
    if isinstance(answer, EvalLine):
        return answer
    if isinstance(answer, dict) and "eval_loss" in answer:
        try:
            return _known(EvalLine, answer, "the evaluator's answer")
        except ConfigError as exc:
            return str(exc)
    return str(answer.get("error", answer) if isinstance(answer, dict) else answer)


def parse_lines(rows: list[Any], where: str = "metrics.jsonl") -> RunLines:
    """The records of parsed JSON lines (lines of no known kind skipped)."""
    out = [parse_line(row, f"{where} line {i + 1}") for i, row in enumerate(rows)]
    return RunLines([x for x in out if x is not None])


def read_rows(path: str | Path, strict: bool = False) -> list[Any]:
    """The JSON values of a metrics.jsonl's lines (blank lines skipped). A last line without its newline that does
    not parse is left for the next read; any other line that does not parse is skipped (a crash cut it short)
    or, ``strict``, a ConfigError naming its line."""
    p = Path(path)
    try:
        text = p.read_text(errors="replace")
    except FileNotFoundError:
        raise ConfigError(f"{p} does not exist: pass the --run-dir of a finished `hetero run`") from None
    lines = text.splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as exc:
            if number == len(lines) and not text.endswith("\n"):
                break  # a live run is still writing it
            if strict:
                raise ConfigError(f"{p} line {number}: not JSON ({exc}); is it a hetero run's metrics?") from None
    return rows


def read_metrics(path: str | Path, strict: bool = False) -> RunLines:
    """A run's metrics.jsonl as its records (steps, evaluations and events, in file order)."""
    return parse_lines(read_rows(path, strict), str(path))


class MetricsFile:
    """The run directory's metrics.jsonl, written: started (empty, or a resumed run's kept lines) and appended to."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    @property
    def path(self) -> Path:
        return self.run_dir / NAME

    def start(self, start_step: int, recovering: bool = False) -> None:
        """Empty for a new run; a resumed one keeps the lines of its first ``start_step`` steps. A run that goes
        on after a lost device (``recovering``) keeps every recovery line too: a device lost is history even where
        the steps around the loss are trained again (a second loss may resume from a copy older than the first,
        or before the first step)."""
        kept: list[str] = []
        if (start_step > 0 or recovering) and self.path.is_file():
            kept = kept_lines(self.path.read_text(errors="replace"), start_step, recovering)
        write_run_file(self.run_dir, NAME, "".join(f"{line}\n" for line in kept))

    def append(self, line: Line) -> None:
        append_run_line(self.run_dir, NAME, to_json(line))


def kept_lines(text: str, start_step: int, recovering: bool) -> list[str]:
    """The lines (as they were written) that a run going on after ``start_step`` steps keeps (MetricsFile.start). A
    file written before steps were numbered from 1 (its first step is 0) is renumbered as it is kept, so that the
    run does not repeat its last kept step and the file has one numbering."""
    rows: list[tuple[str, dict[str, Any]]] = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if isinstance(row, dict):
            rows.append((line, row))
    old = any(row.get("step") == 0 and "event" not in row for _, row in rows)
    kept = []
    for line, row in rows:
        if old:
            for key in ("step", "after_step", "resumed_from_step"):
                if isinstance(row.get(key), int):
                    row[key] += 1
            line = json.dumps(row)
        step = row.get("step") if "event" not in row else row.get("after_step")
        if (isinstance(step, int) and step <= start_step) or (recovering and row.get("event") == "recovery"):
            kept.append(line)
    return kept
