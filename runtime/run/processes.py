"""Stage processes on this host: starting them, reading how they ended, and making sure they end.

A stopped process (SIGSTOP, Ctrl-Z) ignores SIGTERM until it is continued, and a hung one ignores
``stop``: only SIGKILL ends both, so every path that stops stages ends with it.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

from hetero.errors import HeteroError

STRAGGLER_S = 30.0  # `hetero worker`: how long its other stages may outlive one that exited
STOPPED_KILL_S = 30.0  # `hetero worker`: a stage stopped (SIGSTOP) this long is killed
log = logging.getLogger("hetero.processes")


class StageFailedError(HeteroError):
    """A stage process reported an error, exited, or went silent."""


def exit_cause(code: int) -> str:
    """``killed by SIGKILL`` for a negative Popen return code, ``exit code N`` otherwise."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def is_stopped(pid: int) -> bool:
    """Whether a local process is stopped by a signal (Linux /proc; False where unknown)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[:1] in (["T"], ["t"])


def spawn_stages(plan_path: Path, stages: list[int], run_dir: Path, coordinator: str,
                 preload: dict[str, Any] | None = None) -> dict[int, Any]:
    """One stage process per stage, logging to run_dir/logs/stage<k>.log.

    With ``preload`` (the plan's model architecture) this process imports what a stage needs first and
    forks the stages from itself, so they start with torch and the model's transformers code in memory
    instead of importing them again each (seconds of CPU per stage, the largest part of a run's start).
    Forking is safe only while this process has no other thread and no socket: otherwise, and without
    ``preload``, each stage is a fresh ``python -m hetero.runtime.stage.process``.
    """
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    fork = preload is not None and hasattr(os, "fork") and threading.active_count() == 1
    if fork:
        from hetero.runtime.stage.model import preload as preload_model

        preload_model(preload)  # type: ignore[arg-type]
    procs: dict[int, Any] = {}
    for k in stages:
        argv = [str(plan_path), "--stage", str(k), "--coordinator", coordinator, "--parent-pid", str(os.getpid())]
        log_path = run_dir / "logs" / f"stage{k}.log"
        procs[k] = _fork_stage(argv, log_path) if fork else _exec_stage(argv, log_path)
    return procs


def _exec_stage(argv: list[str], log_path: Path) -> subprocess.Popen:
    """A fresh interpreter running the stage."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "ab") as logf:
        # start_new_session: a terminal Ctrl-C reaches only the parent, which stops stages in order.
        return subprocess.Popen([sys.executable, "-m", "hetero.runtime.stage.process", *argv], stdout=logf,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)


class ForkedStage:
    """A stage process forked from this one, with the part of Popen's interface the run uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its code is lost, it is gone all the same
                self.returncode = 255
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)  # -N when a signal ended it, as Popen
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"stage process {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _fork_stage(argv: list[str], log_path: Path) -> ForkedStage:
    """Fork a stage: its own session, stdin from /dev/null, stdout and stderr to its log."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # or the child would write this process's buffered output again
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    pid = os.fork()
    if pid:
        os.close(log_fd)
        return ForkedStage(pid)
    try:  # the child: never returns into the coordinator's code
        _become_stage(log_fd)
        from hetero.runtime.stage.process import exit_stage

        exit_stage(argv)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(1)


def _become_stage(log_fd: int) -> None:
    """Undo what the coordinator set up for itself: terminal, signal handlers, logging, warning routing."""
    os.setsid()  # a terminal Ctrl-C reaches only the coordinator, which stops stages in order
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(null)
    os.close(log_fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt, as in a fresh interpreter
    logging.root.handlers.clear()
    original = getattr(warnings.showwarning, "original", None)  # hetero.cli's router: warnings go to the log
    if original is not None:
        warnings.showwarning = original


def stop_processes(procs: dict[int, Any], grace_s: float = 10.0, kill_now: set[int] | None = None) -> None:
    """End stage processes: kill ``kill_now`` (hung ones) at once, give the others ``grace_s`` to exit
    on their own, then SIGTERM (with SIGCONT, for a stopped one), then SIGKILL."""
    for k in kill_now or set():
        if k in procs and procs[k].poll() is None:
            procs[k].kill()  # SIGKILL ends a stopped process too
    deadline = time.monotonic() + grace_s
    for p in procs.values():
        while p.poll() is None and time.monotonic() < deadline:
            if is_stopped(p.pid):
                p.kill()  # it cannot see `stop`; waiting for it is pointless
                break
            time.sleep(0.05)
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.send_signal(signal.SIGCONT)  # a stopped process takes SIGTERM only once continued
    for p in procs.values():
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def supervise(procs: dict[int, Any], poll_s: float = 0.5,
              until: threading.Event | None = None) -> dict[int, int]:
    """Wait for every stage of this host and return their exit codes (`hetero worker`); only those that
    exited so far once ``until`` is set.

    A remote host has no coordinator next to it to clean up: once one of its stages has exited, the
    others get STRAGGLER_S to follow (they do, on the coordinator's ``stop`` or its silence) before
    they are killed, and a stage stopped by a signal for STOPPED_KILL_S is killed (it cannot notice
    that its run is over).
    """
    codes: dict[int, int] = {}
    first_exit: float | None = None
    stopped_since: dict[int, float] = {}
    while len(codes) < len(procs) and not (until is not None and until.is_set()):
        now = time.monotonic()
        for k, p in procs.items():
            if k in codes:
                continue
            code = p.poll()
            if code is not None:
                codes[k] = code
                first_exit = first_exit if first_exit is not None else now
                continue
            if is_stopped(p.pid):
                since = stopped_since.setdefault(k, now)
                if now - since > STOPPED_KILL_S:
                    log.error("stage %d (pid %d) has been stopped for %.0f s: killing it", k, p.pid, now - since)
                    p.kill()
            else:
                stopped_since.pop(k, None)
            if first_exit is not None and now - first_exit > STRAGGLER_S:
                log.error("stage %d (pid %d) outlived the others by %.0f s: killing it", k, p.pid, now - first_exit)
                p.kill()
        if len(codes) < len(procs):
            time.sleep(poll_s)
    return codes


def last_line(text: str, limit: int | None = 300) -> str:
    """The last non-blank line of a log or a command's output, stripped and clipped to ``limit`` ("" if none)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:limit] if lines else ""


def last_error_line(log: Path) -> str | None:
    """What a process of the run (a stage, the evaluator) that exited with an error said: its
    'hetero: error' line without the process's name, else an uncaught exception's last line."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return None
    for line in reversed(lines):
        if "hetero: error:" in line:
            return re.sub(r"^(stage \d+|evaluator): ", "", line.split("hetero: error:", 1)[1].strip())[:300]
    if lines and re.match(r"[\w.]+(Error|Exception|Interrupt)\b", lines[-1]):
        return lines[-1][:300]  # an uncaught exception's last traceback line
    return None
