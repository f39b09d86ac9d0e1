"""`hetero run`'s stage launcher: stages that start with torch and the model's code already imported.

A stage spends seconds of CPU importing torch and the model's transformers code before it can build,
and `hetero run` spends as long on its own checks (plan, data, checkpoint) before any stage may
start. The launcher overlaps the two: `hetero run` forks it first thing, while it is still a small
process with no thread and no socket; the launcher imports what a stage needs on another core while
the coordinator checks, then forks one stage per device of this host on request and exits. The
coordinator is a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``), so the stages become its own
children when the launcher exits: it waits for them, signals them and reads their exit codes like
any child, and each stage starts only once the coordinator holds it (the "go" pipe). Where any of this is not
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

from hetero.runtime.base.processes import StageFailedError

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


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
    """The forked launcher, seen from the coordinator: ``spawn`` once, or ``close`` to end it unused.

    Three pipes: the request (which stages, where they log), the answer (their pids, or why not), and
    "go": every stage waits for one byte of it, which the coordinator writes only once it holds the
    stages' pids as its children. Whatever fails before that, closing "go" ends every forked stage.
    """

    def __init__(self, pid: int, requests: int, answers: int, go: int) -> None:
        self.pid, self._requests, self._answers, self._go = pid, requests, answers, go
        self._open = [requests, answers, go]

    @classmethod
    def start(cls, architecture: dict[str, Any]) -> StageLauncher | None:
        """Fork the launcher, which starts importing what a stage of this model needs; None where it cannot."""
        if (sys.platform != "linux" or threading.active_count() != 1
                or signal.getsignal(signal.SIGCHLD) != signal.SIG_DFL or not _set_subreaper(True)):
            return None
        fds = [*os.pipe(), *os.pipe(), *os.pipe()]
        requests_r, requests_w, answers_r, answers_w, go_r, go_w = fds
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # or the child would write this process's buffered output again
        try:
            pid = os.fork()
        except OSError:
            for fd in fds:
                os.close(fd)
            _set_subreaper(False)
            return None
        if pid == 0:
            try:
                for fd in (requests_w, answers_r, go_w):
                    os.close(fd)
                _serve(architecture, requests_r, answers_w, go_r)
            finally:
                os._exit(0)
        for fd in (requests_r, answers_w, go_r):
            os.close(fd)
        return cls(pid, requests_w, answers_r, go_w)

    def spawn(self, plan_path: Path, stages: list[int], run_dir: Path, coordinator: str) -> dict[int, ForkedStage]:
        """One stage process per stage, logging to run_dir/logs/stage<k>.log (see the class docstring)."""
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        wanted = [[k, [str(plan_path), "--stage", str(k), "--coordinator", coordinator, "--parent-pid",
                       str(os.getpid())], str(run_dir / "logs" / f"stage{k}.log")] for k in stages]
        try:
            requests = self._take(self._requests)
            os.write(requests, json.dumps(wanted).encode())  # < 64 KiB: one write
            os.close(requests)  # the launcher reads the request to its end
            answer = _read_all(self._take(self._answers))
            os.waitpid(self.pid, 0)  # the launcher has exited: its stages are this process's children now
            self.pid = 0
            pids = json.loads(answer) if answer else {"error": "the stage launcher ended without answering"}
            if "error" in pids:
                raise StageFailedError(f"could not start this host's stages: {pids['error']}")
            procs = {int(k): ForkedStage(int(pid)) for k, pid in pids.items()}
            os.write(self._go, b"g" * len(procs))
            return procs
        except OSError as exc:  # the launcher died (out of memory?) before it answered
            raise StageFailedError(f"could not start this host's stages: the stage launcher failed ({exc})") from None
        finally:
            self.close()  # "go" closed: a stage that got no byte exits

    def close(self) -> None:
        """Close what is left of the pipes and end the launcher if it still runs (idempotent)."""
        while self._open:
            os.close(self._open.pop())
        if self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(self.pid, 0)
            self.pid = 0
        _set_subreaper(False)  # only the launcher's stages were to be adopted

    def _take(self, fd: int) -> int:
        self._open.remove(fd)
        return fd


def _read_all(fd: int) -> str:
    """Read a pipe to its end and close it."""
    with os.fdopen(fd, "rb") as pipe:
        return pipe.read().decode()


def _set_subreaper(on: bool) -> bool:
    """Whether orphaned descendants (the launcher's stages) become this process's children."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _serve(architecture: dict[str, Any], requests: int, answers: int, go: int) -> None:
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
    wanted = _read_all(requests)
    if not wanted:
        return  # the coordinator stopped before starting stages
    answer: dict[str, Any] = {}
    try:
        for k, argv, log in json.loads(wanted):
            answer[str(k)] = _fork_stage(argv, Path(log), answers, go)
    except OSError as exc:  # the forked ones get no "go" byte: they exit
        answer = {"error": f"forking a stage failed ({exc})"}
    with os.fdopen(answers, "w") as out:
        out.write(json.dumps(answer))


def _fork_stage(argv: list[str], log_path: Path, answers: int, go: int) -> int:
    """Fork one stage; in the child, run it once the coordinator says go (never returns there)."""
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    pid = os.fork()
    if pid:
        os.close(log_fd)
        return pid
    code = 1
    try:
        os.close(answers)  # the coordinator reads the launcher's answer until the launcher closes it
        os.setsid()
        _redirect(log_fd)
        _reset_process_state()
        if os.read(go, 1) != b"g":  # end of file: the coordinator gave up on its stages, or died
            os._exit(3)
        os.close(go)
        from hetero.runtime.stage.process import exit_stage

        exit_stage(argv)
    except SystemExit as exc:  # what a fresh interpreter would exit with (argparse: 2), and say (a message: 1)
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _redirect(out_fd: int) -> None:
    """stdin from /dev/null, stdout and stderr to ``out_fd`` (line-buffered)."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(null)
    os.close(out_fd)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = getattr(sys, name)
        try:
            on_fd = stream.fileno() == fd
        except (AttributeError, OSError, ValueError):  # a notebook's or pytest's stream object: no descriptor
            on_fd = False
        if on_fd:
            stream.reconfigure(line_buffering=True)
        else:  # the log is the stage's only output: faulthandler and tracebacks need the descriptor itself
            setattr(sys, name, open(fd, "w", buffering=1, closefd=False, errors="backslashreplace"))


def _reset_process_state() -> None:
    """What a fresh interpreter has and `hetero run` changed: signal handlers, logging, warning routing."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    logging.root.handlers.clear()
    original = getattr(warnings.showwarning, "original", None)  # hetero.cli's router: warnings go to the log
    if original is not None:
        warnings.showwarning = original
