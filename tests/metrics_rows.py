"""Support for the tests (helpers, not tests): a run's metrics.jsonl read as a user reads it, each line's JSON
object, not through hetero's reader (runtime/run/metrics_file.py), so that the end-to-end tests check the file
itself; and rows made by hand turned into hetero's records for the functions that take them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hetero.runtime.run.metrics_file import Line, StepLine, parse_lines


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every line's JSON object (blank lines and a last line still being written skipped)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a live run's line cut short
    return rows


def step_lines(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The training steps' rows: not an event, not an evaluation."""
    return [r for r in rows if "step_time_s" in r and "event" not in r]


def event_lines(rows: list[dict[str, Any]], kind: str = "rebalance") -> list[dict[str, Any]]:
    return [r for r in rows if r.get("event") == kind]


def records(rows: list[dict[str, Any]]) -> list[Line]:
    """Rows as hetero's records of them, in order (rows of no kind left out)."""
    return parse_lines(rows, "test rows").lines


def step_line(**fields: Any) -> StepLine:
    """A step's record made by hand: the fields given, a loss of 2.0 and a step of 1 s unless given."""
    return StepLine(**{"loss": 2.0, "step_time_s": 1.0, **fields})
