"""Starting `hetero` as a subprocess in tests, and cleaning up whatever a failing test left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

HETERO = [sys.executable, "-m", "hetero.cli"]
STARTED: list[subprocess.Popen] = []
PIDS: list[int] = []  # stage processes a test learned of (killed too: a SIGSTOPped one ignores its parent)


def start(args: list[str], cwd: Path, **env: str) -> subprocess.Popen:
    proc = subprocess.Popen(HETERO + args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
    STARTED.append(proc)
    return proc


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{proc.args} did not finish in {timeout} s\nstdout:{out}\nstderr:{err}") from None
    return proc.returncode, out, err


def clean_up() -> None:
    for pid in PIDS:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    PIDS.clear()
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
