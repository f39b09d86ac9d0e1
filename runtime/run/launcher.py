"""`hetero run`'s stage launcher: stages that start with torch and the model's code already imported.

A stage spends seconds of CPU importing torch and the model's transformers code before it can build,
and `hetero run` spends as long on its own checks (plan, data, checkpoint) before any stage may
start. The launcher overlaps the two: `hetero run` forks it first thing, while it is still a small
process with no thread and no socket; the launcher imports what a stage needs on another core while
the coordinator checks, then forks one stage per device of this host on request and exits. The
coordinator is a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``), so the stages become its own
children when the launcher exits: it waits for them, signals them and reads their exit codes like
any child, and each stage starts only once it is the coordinator's. Where any of this is not
available, ``StageLauncher.start`` returns None and the stages start as fresh interpreters.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
ADOPTION_TIMEOUT_S = 30.0  # a stage whose coordinator never adopts it (the coordinator died) gives up


class ForkedStage:
    """A stage process forked by the launcher and adopted by this one, with the part of Popen's
    interface the run uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not (or no longer) ours to wait for: it is gone all the same
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


class StageLauncher:
    """The forked launcher, seen from the coordinator: ``spawn`` once, or ``close`` to end it unused."""

    def __init__(self, pid: int, requests: int, answers: int) -> None:
        self.pid, self._requests, self._answers = pid, requests, answers
        self.used = False

    @classmethod
    def start(cls, architecture: dict[str, Any]) -> StageLauncher | None:
        """Fork the launcher, which starts importing what a stage of this model needs; None where it cannot."""
        if sys.platform != "linux" or threading.active_count() != 1 or not _become_subreaper():
            return None
        requests_r, requests_w = os.pipe()
        answers_r, answers_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # or the child would write this process's buffered output again
        pid = os.fork()
        if pid == 0:
            try:
                os.close(requests_w)
                os.close(answers_r)
                _serve(architecture, requests_r, answers_w, os.getppid())
            finally:
                os._exit(0)
        os.close(requests_r)
        os.close(answers_w)
        return cls(pid, requests_w, answers_r)

    def spawn(self, plan_path: Path, stages: list[int], run_dir: Path, coordinator: str) -> dict[int, ForkedStage]:
        """One stage process per stage, logging to run_dir/logs/stage<k>.log (see the module docstring)."""
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.used = True
        wanted = [[k, [str(plan_path), "--stage", str(k), "--coordinator", coordinator, "--parent-pid",
                       str(os.getpid())], str(run_dir / "logs" / f"stage{k}.log")] for k in stages]
        with os.fdopen(self._requests, "w") as out:
            out.write(json.dumps(wanted))
        with os.fdopen(self._answers) as answers:
            answer = answers.readline()  # one line: the stages hold no copy of the pipe, but do not rely on it
        os.waitpid(self.pid, 0)  # the launcher has exited: its stages are this process's children now
        try:
            pids = json.loads(answer)
        except ValueError:
            raise RuntimeError(f"the stage launcher (pid {self.pid}) ended without starting the stages") from None
        return {int(k): ForkedStage(int(pid)) for k, pid in pids.items()}

    def close(self) -> None:
        """End an unused launcher (the run stopped before its stages started)."""
        if self.used:
            return
        self.used = True
        for fd in (self._requests, self._answers):
            os.close(fd)
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(self.pid, 0)


def _become_subreaper() -> bool:
    """Orphaned descendants (the launcher's stages) become this process's children."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _serve(architecture: dict[str, Any], requests: int, answers: int, coordinator_pid: int) -> None:
    """The launcher: import, wait for the coordinator's request, fork the stages, answer their pids."""
    os.setsid()  # a terminal Ctrl-C reaches only the coordinator, which ends this process
    _redirect(os.open(os.devnull, os.O_WRONLY))  # nothing to say: a failed import fails the stage's build
    gc.disable()  # the imports allocate millions of objects that live for good: collecting them is wasted time
    try:
        from hetero.runtime.stage.model import preload
        from hetero.runtime.stage.process import exit_stage  # noqa: F401 (imported once, for every stage)

        preload(architecture)
    except Exception:
        pass
    gc.freeze()  # what the stages inherit stays out of their collections (and their pages shared)
    gc.enable()
    with os.fdopen(requests) as inbox:
        wanted = inbox.read()
    if not wanted:
        return  # the coordinator stopped before starting stages
    pids = {k: _fork_stage(argv, Path(log), coordinator_pid, answers) for k, argv, log in json.loads(wanted)}
    with os.fdopen(answers, "w") as out:
        out.write(json.dumps(pids) + "\n")


def _fork_stage(argv: list[str], log_path: Path, coordinator_pid: int, answers: int) -> int:
    """Fork one stage; in the child, run it once the coordinator has adopted it (never returns there)."""
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    pid = os.fork()
    if pid:
        os.close(log_fd)
        return pid
    try:
        os.close(answers)  # the coordinator reads the launcher's answer until the launcher closes it
        os.setsid()
        _redirect(log_fd)
        _reset_process_state()
        deadline = time.monotonic() + ADOPTION_TIMEOUT_S
        while os.getppid() != coordinator_pid:  # the launcher is about to exit
            if time.monotonic() > deadline:
                print(f"hetero: error: the coordinator (pid {coordinator_pid}) is gone", file=sys.stderr)
                os._exit(3)
            time.sleep(0.005)
        from hetero.runtime.stage.process import exit_stage

        exit_stage(argv)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(1)


def _redirect(out_fd: int) -> None:
    """stdin from /dev/null, stdout and stderr to ``out_fd`` (line-buffered)."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(null)
    os.close(out_fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]


def _reset_process_state() -> None:
    """What a fresh interpreter has and `hetero run` changed: signal handlers, logging, warning routing."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    logging.root.handlers.clear()
    original = getattr(warnings.showwarning, "original", None)  # hetero.cli's router: warnings go to the log
    if original is not None:
        warnings.showwarning = original
