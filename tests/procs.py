"""Starting `hetero` as a subprocess in tests, and cleaning up whatever a failing test left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

# The `hetero` console script, as a user types it: `python -m hetero.cli` would itself import a folder named hetero
# in its working directory, which tests make on purpose (clone_beside).
_SCRIPT = Path(sys.executable).with_name("hetero")
HETERO = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-P", "-m", "hetero.cli"]
STARTED: list[subprocess.Popen] = []
PIDS: list[int] = []  # stage processes a test learned of (killed too: a SIGSTOPped one ignores its parent)


def clone_beside(folder: Path) -> Path:
    """``folder`` holding a folder named ``hetero``, as a user's home holds the clone of an editable install (issue 53:
    a child started there with ``python -m`` imported that folder instead of hetero)."""
    (folder / "hetero").mkdir(parents=True, exist_ok=True)
    (folder / "hetero" / "README.md").write_text("a clone of hetero, not the package\n")
    return folder


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
