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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetero.errors import HeteroError

STRAGGLER_S = 30.0  # `hetero worker`: how long its other stages may outlive one that exited
STOPPED_KILL_S = 30.0  # `hetero worker`: a stage stopped (SIGSTOP) this long is killed
log = logging.getLogger("hetero.processes")
# `python -m MODULE` puts the working directory first on sys.path: started where that directory holds a folder named
# `hetero` (the clone of an editable install, in the user's home), a child imports the folder as a namespace package
# instead of hetero. -P (Python 3.11+) leaves the directory out; older interpreters drop it themselves.
_SAFE_RUN = ("import runpy, sys; sys.path[:1] = [] if sys.path[:1] == [''] else sys.path[:1]; "
             "runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")


def module_argv(module: str, python: str | None = None, flags: tuple[str, ...] = ()) -> list[str]:
    """``python -m MODULE`` that imports the installed hetero whatever the working directory holds; ``python``:
    another interpreter (a remote host's, of unknown version), else this one."""
    if python is None and sys.version_info >= (3, 11):
        return [sys.executable, *flags, "-P", "-m", module]
    return [python or sys.executable, *flags, "-c", _SAFE_RUN.format(module=module)]


@dataclass(frozen=True)
class LostStage:
    """A stage whose device the run lost, as opposed to one that reported an error of its own: its process was
    killed by a signal, went silent (hung, stopped, its host unreachable) or its connection dropped for good. A run
    with runtime.elastic=auto goes on without that device (runtime/run/elastic.py)."""

    stage: int
    what: str  # "exited", "stopped responding"
    cause: str  # "killed by SIGKILL", "no heartbeat for 10 s (...)"
    at: float = field(default_factory=time.monotonic)  # when the coordinator saw it
    others: tuple[int, ...] = ()  # stages lost with it (its host's worker, started over ssh, ended)


class StageFailedError(HeteroError):
    """A stage process reported an error, exited, or went silent; ``lost`` when its device is gone."""

    def __init__(self, message: str, lost: LostStage | None = None) -> None:
        super().__init__(message)
        self.lost = lost


def exit_cause(code: int) -> str:
    """``killed by SIGKILL`` for a negative Popen return code, ``exit code N`` otherwise."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def raise_open_file_limit() -> None:
    """Raise this process's soft limit on open files to its hard limit (every run process, once, at start).

    Each TCP connection to a listening socket holds a descriptor until ZeroMQ drops it (an unauthenticated
    one after inbox.INBOX_HANDSHAKE_S): at the common soft limit of 1024, anyone who can reach a port
    could hold them all open and end the run with EMFILE. Never fails: where the OS refuses, the old limit stays.
    """
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError) as exc:  # no `resource` (Windows); macOS refuses RLIM_INFINITY
        log.debug("open-file limit left as it is: %s", exc)


def is_stopped(pid: int) -> bool:
    """Whether a local process is stopped by a signal (Linux /proc; False where unknown)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[:1] in (["T"], ["t"])


def spawn_stages(plan_path: Path, stages: list[int], run_dir: Path, coordinator: str,
                 replan_dir: Path | None = None) -> dict[int, Any]:
    """One ``python -m hetero.runtime.stage.process`` per stage, logging to run_dir/logs/stage<k>.log
    (`hetero run` forks its stages from a launcher instead where it can: runtime/run/launcher.py); ``replan_dir``:
    where a stage leaves the run's next plan (`hetero worker`)."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    procs: dict[int, Any] = {}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for k in stages:
        with open(run_dir / "logs" / f"stage{k}.log", "ab") as logf:
            # start_new_session: a terminal Ctrl-C reaches only the parent, which stops stages in order.
            procs[k] = subprocess.Popen(
                [*module_argv("hetero.runtime.stage.process"), str(plan_path), "--stage", str(k),
                 "--coordinator", coordinator, "--parent-pid", str(os.getpid()),
                 *(["--replan-dir", str(replan_dir)] if replan_dir is not None else [])],
                stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    return procs


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
