"""Starting `hetero` as a subprocess in tests, and cleaning up whatever a failing test left running.

``start`` runs a command in a child of tests/warm_server.py, which has `hetero run`'s imports done (about 6 s less
per command than a fresh interpreter), or as the console script itself where the start is the point: a working
directory holding a folder named hetero (issue 53), a PYTHON* variable of the test's own (read at start-up),
``cold``, or HETERO_TESTS_COLD=1 for the whole session.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The `hetero` console script, as a user types it: `python -m hetero.cli` would itself import a folder named hetero
# in its working directory, which tests make on purpose (clone_beside).
_SCRIPT = Path(sys.executable).with_name("hetero")
HETERO = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-P", "-m", "hetero.cli"]
STARTED: list[Any] = []
PIDS: list[int] = []  # stage processes a test learned of (killed too: a SIGSTOPped one ignores its parent)
_SERVER: dict[str, Any] = {}


@contextlib.contextmanager
def default_ports() -> Iterator[None]:
    """Held while a test runs a plan compiled for hardware=local, whose coordinator and stages listen on the fleet
    file's ports (29499 and up): one such test at a time on this machine, across pytest-xdist's workers (and test
    sessions). Every other runtime test takes free ports of its own (plans.free_ports)."""
    with open(Path(tempfile.gettempdir()) / "hetero-tests-default-ports.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def clone_beside(folder: Path) -> Path:
    """``folder`` holding a folder named ``hetero``, as a user's home holds the clone of an editable install (issue 53:
    a child started there with ``python -m`` imported that folder instead of hetero)."""
    (folder / "hetero").mkdir(parents=True, exist_ok=True)
    (folder / "hetero" / "README.md").write_text("a clone of hetero, not the package\n")
    return folder


def start(args: list[str], cwd: Path, cold: bool = False, nofile: int | None = None, **env: str) -> Any:
    """``hetero ARGS`` started in ``cwd``: a Popen, or a Warm with the part of Popen's interface tests use;
    ``nofile``: the command's soft limit on open files (its stages inherit it)."""
    environ = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    startup = [k for k in env if k.startswith("PYTHON")]  # read as the interpreter starts: a fork has started
    if cold or startup or os.environ.get("HETERO_TESTS_COLD") or (Path(cwd) / "hetero").exists():
        proc: Any = subprocess.Popen(HETERO + args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=environ, preexec_fn=None if nofile is None else lambda: _limit(nofile))
    else:
        proc = Warm(HETERO + args, Path(cwd), environ, nofile)
    STARTED.append(proc)
    return proc


def _limit(nofile: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def _server() -> str:
    """The socket of this test session's warm server, started on first use."""
    if "path" not in _SERVER:
        folder = tempfile.mkdtemp(prefix="hetero-warm-")
        path = os.path.join(folder, "socket")
        padding = "x" * 4096  # room for the commands' own command lines (warm_server.show_command_line)
        server = subprocess.Popen([sys.executable, "-P", str(Path(__file__).with_name("warm_server.py")), path,
                                   padding], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        if server.stdout is None or server.stdout.readline().strip() != "ready":
            server.kill()
            raise RuntimeError("tests/warm_server.py did not start (HETERO_TESTS_COLD=1 starts every command cold)")
        atexit.register(server.kill)
        _SERVER.update(path=path, server=server)
    return str(_SERVER["path"])


class Warm:
    """A command run by the warm server: pid, args, stdout/stderr (text), poll, wait, communicate, signals."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str], nofile: int | None = None) -> None:
        self.args, self.returncode = args, None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(_server())
            body = json.dumps({"argv": args, "cwd": str(cwd), "env": env, "nofile": nofile}).encode()
            socket.send_fds(self._conn, [struct.pack("!I", len(body)) + body], [null, out_w, err_w])
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)
        self._answers = self._conn.makefile("r")
        self.pid = int(self._answers.readline())
        self.stdout, self.stderr = open(out_r), open(err_r)
        self._read: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._readers: list[threading.Thread] = []

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            line = self._answers.readline()
            self.returncode = int(line) if line.strip() else -signal.SIGKILL  # the server itself was killed
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not select.select([self._conn], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        code = self.poll()
        assert code is not None
        return code

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """The rest of stdout and stderr, once the command has exited (as Popen's: a timeout keeps what was read)."""
        if not self._readers:
            for name in ("stdout", "stderr"):
                stream, into = getattr(self, name), self._read[name]
                self._readers.append(threading.Thread(target=_drain, args=(stream, into), daemon=True))
                self._readers[-1].start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return "".join(self._read["stdout"]), "".join(self._read["stderr"])

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def run_hetero(args: list[str], cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    """``hetero ARGS`` in ``cwd`` to its end, as ``subprocess.run(..., capture_output=True, text=True)`` answers."""
    proc = start(args, cwd, **env)
    code, out, err = finish(proc, timeout)
    return subprocess.CompletedProcess(proc.args, code, out, err)


def _drain(stream: Any, into: list[str]) -> None:
    into.append(stream.read())
    stream.close()


def finish(proc: Any, timeout: float = 300) -> tuple[int, str, str]:
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
