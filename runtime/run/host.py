"""A host's launcher: ``hetero worker plan.json --host NAME`` starts one stage process per device of that
host (runtime/stage/process.py) and waits for them; ``--check`` answers `hetero run`'s question over ssh.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hetero.errors import PlanError
from hetero.plan import Plan
from hetero.protocol import EXIT_REPLAN
from hetero.runtime.base.processes import (
    last_error_line,
    raise_open_file_limit,
    spawn_stages,
    stop_processes,
    supervise,
)
from hetero.security import install_keys, key_dirs, load_identity


def check_host(plan_path: Path, plan: Plan, host: str) -> list[int]:
    """The stages ``host`` runs, once its keys are found; a one-line PlanError if it cannot run them."""
    stages = [s.index for s in plan.stages if s.host == host]
    if not stages:
        hosts = sorted({s.host for s in plan.stages})
        raise PlanError(f"host '{host}' runs no stage of this plan; its stages run on: {', '.join(hosts)}")
    for k in stages:  # every key this host needs, before any process starts
        load_identity(plan.security, plan.stage_id(k), key_dirs(plan_path, host))
    return stages


def _wait_for_eof(closed: threading.Event) -> None:
    """Set ``closed`` when stdin ends: `hetero run`'s ssh session is gone (or it stopped us on purpose)."""
    try:
        while os.read(0, 65536):
            pass
    except OSError:
        pass
    closed.set()


def serve_host(plan_path: Path, plan: Plan, host: str, run_dir: Path, coordinator: str,
               watch_stdin: bool = False) -> int:
    """Start every stage of ``host`` (one process per device) and wait for them; returns an exit code.

    ``watch_stdin``: also stop them when stdin closes (a worker that `hetero run` started over ssh).

    When the run goes on under a new plan after a lost device (runtime.elastic), this host's stages exit with
    EXIT_REPLAN, having left that plan in ``run_dir``; the worker then starts this host's stages of it."""
    stages = check_host(plan_path, plan, host)
    raise_open_file_limit()  # the stages it starts inherit it (and raise their own)
    # This host's keys go to RUN_DIR/keys, where its stages of a plan the coordinator sends later look.
    install_keys(plan.security, [plan.stage_id(k) for k in stages], key_dirs(plan_path, host), run_dir / "keys")
    closed = threading.Event()
    if watch_stdin:
        threading.Thread(target=_wait_for_eof, args=(closed,), daemon=True, name="stdin").start()

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # SIGTERM: stop the stages in order, like Ctrl-C

    signal.signal(signal.SIGTERM, on_term)
    first = plan
    while True:
        started = time.time()
        procs = spawn_stages(plan_path, stages, run_dir, coordinator, replan_dir=run_dir)
        print(f"hetero worker: host {host} runs stages {stages} of {plan_path.name} (logs in {run_dir / 'logs'}); "
              f"coordinator {coordinator}", flush=True)
        try:
            codes = supervise(procs, until=closed)
        except KeyboardInterrupt:
            stop_processes(procs)
            raise
        if len(codes) < len(procs) or EXIT_REPLAN not in codes.values():
            return _ended(procs, codes, stages, run_dir)
        following = _next_plan(run_dir, first, host, started)
        if following is None:
            return 0
        plan_path, plan, stages = following


def _next_plan(run_dir: Path, plan: Plan, host: str, since: float) -> tuple[Path, Plan, list[int]] | None:
    """The plan this host's stages left in ``run_dir`` after ``since`` (the run goes on under it: the highest number,
    so a run directory used before cannot mislead), and this host's stages of it; None (said) when it has none here.

    It must be a re-plan of ``plan``, the plan this worker was started with: the same keys and model, on devices of
    its fleet, each stage under the process name its device had (with keys, only the coordinator could have sent
    it; without, this keeps a stranger's plan from running here)."""
    numbered = sorted((p for p in run_dir.glob("plan-recovery-*.json")
                       if p.stem.rsplit("-", 1)[-1].isdigit() and p.stat().st_mtime >= since - 1.0),
                      key=lambda p: int(p.stem.rsplit("-", 1)[-1]))
    if not numbered:
        raise PlanError(f"a stage said the run goes on under a new plan, but none is in {run_dir}")
    path = numbered[-1]
    new = Plan.load(path, require_security=plan.security.mode != "none")
    if new.security != plan.security:
        raise PlanError(f"{path}: the coordinator's new plan has other keys than {host}'s plan.json: restart this "
                        "worker with the run's plan.json and keys")
    devices = {d.name for d in plan.cluster.devices}
    names = {s.device: plan.stage_id(k) for k, s in enumerate(plan.stages)}
    if new.model != plan.model or any(s.device not in devices or names.get(s.device, new.stage_id(k)) != new.stage_id(k)
                                      for k, s in enumerate(new.stages)):
        raise PlanError(f"{path} is not a re-plan of {host}'s plan.json (another model, devices or stage names): "
                        "not running it")
    stages = [s.index for s in new.stages if s.host == host]
    if not stages:
        print(f"hetero worker: the run goes on under {path.name} without host {host}: done", flush=True)
        return None
    print(f"hetero worker: the run goes on under {path.name}: host {host} now runs stages {stages}", flush=True)
    return path, new, stages


def _ended(procs: dict[int, Any], codes: dict[int, int], stages: list[int], run_dir: Path) -> int:
    """The worker's exit code once its stages ended (or stdin closed first: then it stops them)."""
    if len(codes) < len(procs):  # stdin closed first: the run is over or its coordinator is gone
        try:  # the ssh session that reads this may be gone
            print(f"hetero worker: stdin closed (`hetero run` ended or its ssh session dropped): stopping stages "
                  f"{[k for k in stages if k not in codes]}", flush=True)
        except OSError:
            pass
        stop_processes(procs, grace_s=3.0)
        return 0
    bad = {k: c for k, c in codes.items() if c != 0}
    if bad:
        k, code = next(iter(bad.items()))
        log = run_dir / "logs" / f"stage{k}.log"
        cause = last_error_line(log)  # the stage's own one-line error, when it wrote one
        print(f"hetero: error: stage {k} exited with code {code}{f': {cause}' if cause else ''}; see {log}",
              file=sys.stderr)
        return 1
    return 0
