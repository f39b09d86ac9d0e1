"""Weights & Biases, when installed and asked for (`hetero run ... runtime.wandb=PROJECT`): the same scalars as the
TensorBoard files (runtime/run/tensorboard.py), at the same steps, in a W&B run named after the run directory.

The W&B run's id is derived from the run directory, so `--resume RUN_DIR` continues the same W&B run. W&B keeps
only increasing steps in a run, so the steps a resumed or recovered run trains again keep their first values
there (metrics.jsonl and TensorBoard have the new ones). W&B's own settings (WANDB_MODE=offline, WANDB_ENTITY,
an API key from `wandb login`) apply as usual.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from pathlib import Path
from typing import Any

from hetero.errors import ConfigError
from hetero.runtime.run.metrics_file import EvalLine, StepLine, charted

PROJECT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def check_project(key: str, raw: str) -> str:
    """``runtime.wandb=PROJECT``'s value, checked before anything starts: a project name, and wandb installed."""
    if not PROJECT.fullmatch(raw):
        raise ConfigError(f"{key} takes a W&B project name (letters, digits, '_', '.', '-'), got {raw[:80]!r}")
    try:
        found = importlib.util.find_spec("wandb") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(f"{key}={raw} logs to Weights & Biases, which is not installed here: `pip install wandb` "
                          "(or leave runtime.wandb out; TensorBoard files are written in RUN_DIR/tensorboard anyway)")
    return raw


def run_id(run_dir: Path) -> str:
    """A W&B run id that is the same for every start of one run directory (so --resume continues the W&B run)."""
    name = re.sub(r"[^A-Za-z0-9_-]", "-", run_dir.name)[:40]
    return f"{name}-{hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]}"


class WandbRun:
    """One W&B run for a hetero run directory."""

    def __init__(self, project: str, run_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(project=project, name=run_dir.name, id=run_id(run_dir), resume="allow",
                              dir=str(run_dir), config=config)

    def step(self, line: StepLine) -> None:
        if scalars := charted(line):
            self.run.log(scalars, step=line.step)

    def evaluation(self, answer: EvalLine) -> None:
        if scalars := charted(answer):
            self.run.log(scalars, step=answer.step)

    def close(self) -> None:
        self.run.finish()
