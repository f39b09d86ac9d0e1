"""The launcher side of `--engine torch`: one process per plan stage, started by torch's elastic launcher.

`torch.distributed.launcher.api.elastic_launch` is what `torchrun` runs: a rendezvous (the static one, on a
free port of this host), one worker per rank, their exit watched. Ranks other than 0 write their output to
RUN_DIR/logs/torch; rank 0 draws the progress bar. The run's records are rank 0's files (metrics.jsonl,
checkpoints, adapter), read back here into the RunResult the end-of-run report is made from.
"""

from __future__ import annotations

import logging
import re
import socket
from pathlib import Path
from typing import Any

from hetero.plan import Plan
from hetero.runtime.run.processes import StageFailedError
from hetero.runtime.run.records import RunResult


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(plan: Plan, run_dir: Path) -> Any:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    world = len(plan.stages)
    logs = DefaultLogsSpecs(log_dir=str(run_dir / "logs" / "torch"), redirects={r: Std.ALL for r in range(1, world)})
    # The static rendezvous (torchrun --rdzv-backend=static): its TCP store holds plain keys and numbers. The
    # dynamic ones (c10d, etcd) keep their state as serialized Python objects in the store, and nothing here
    # deserializes objects a socket holds.
    return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=f"hetero-{plan.input_hash}",
                        rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{_free_port()}", rdzv_configs={"rank": 0},
                        max_restarts=0, monitor_interval=0.1, start_method="spawn", logs_specs=logs,
                        local_addr="127.0.0.1")


_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b:?")


def _error_line(text: str) -> str:
    """A traceback's exception line (with the next line when its message starts on a new line), on one line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    found = [i for i, ln in enumerate(lines) if _EXCEPTION.match(ln)]
    if not found:
        return lines[-1] if lines else ""
    i = found[-1]
    words = lines[i] if not lines[i].endswith(":") or i + 1 >= len(lines) else f"{lines[i]} {lines[i + 1]}"
    return re.sub(r"\s+", " ", words)


def _failure(exc: BaseException, run_dir: Path) -> str:
    """A failed rank's error, in one line: its exception's last line, or how it ended."""
    failures = getattr(exc, "failures", {}) or {}
    for rank, failure in sorted(failures.items()):
        message = str(getattr(failure, "message", "") or "")
        if isinstance(getattr(failure, "error_file_data", None), dict):
            message = str(failure.error_file_data.get("message", {}).get("message", message))
        line = _error_line(message) or f"exit code {getattr(failure, 'exitcode', '?')}"
        return f"rank {rank} failed: {line[:400]} (logs: {run_dir / 'logs'})"
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''} (logs: {run_dir / 'logs'})"


def run_torch(plan: Plan, plan_path: Path, run_dir: Path, backend: str, resume: Path | None,
              progress: bool, timeout_s: float) -> RunResult:
    """Train ``plan`` on torch.distributed.pipelining; raises StageFailedError (one line) if a rank fails."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from hetero.runtime.run.rundir import latest_checkpoint
    from hetero.runtime.tools.run_compare import read_metrics, step_lines
    from hetero.runtime.torch_engine.rank import rank_main

    # A failed rank is one line below (with where its log is), not the launcher's own tracebacks.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        elastic_launch(_config(plan, run_dir), rank_main)(str(plan_path), str(run_dir), backend,
                                                          str(resume) if resume is not None else None, progress,
                                                          timeout_s)
    except ChildFailedError as exc:
        raise StageFailedError(f"--engine torch: {_failure(exc, run_dir)}") from None
    result = RunResult()
    result.steps = step_lines(read_metrics(run_dir / "metrics.jsonl"))
    result.checkpoint = latest_checkpoint(run_dir)
    return result
