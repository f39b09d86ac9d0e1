"""The run directory's files: each written whole or not at all; a full or read-only disk is one line.

A file is written to a hidden sibling, flushed to disk and renamed over its name; a directory (a
checkpoint, the adapter) is filled under a hidden sibling name and renamed into place the same way,
so a crash or a full disk never leaves a half-written ``step-N/`` that looks complete, and the
previous checkpoint is never touched. Write failures become a ``RunDirError`` naming what could not
be written and the ``--resume`` command that continues from the last complete checkpoint.

Torch-free: only paths and bytes (checkpoint.py turns tensors into bytes).
"""

from __future__ import annotations

import errno
import os
import re
import shlex
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from hetero.errors import HeteroError

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
PARTIAL = ".partial"  # suffix of the hidden sibling a file or directory is written under
_STEP_DIR = re.compile(r"step-(\d+)")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


class RunDirError(HeteroError):
    """The run directory cannot be written (disk full, read-only, no permission)."""


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """``RUN_DIR/checkpoints/step-NNNNNN``: the checkpoint after ``step`` optimizer steps."""
    return Path(run_dir) / CHECKPOINTS / f"step-{step:06d}"


def checkpoint_step(directory: Path) -> int | None:
    """The step of a ``step-N`` directory name, else None (hidden partial siblings are not checkpoints)."""
    match = _STEP_DIR.fullmatch(Path(directory).name)
    return int(match.group(1)) if match else None


def complete_checkpoints(checkpoints: Path) -> list[Path]:
    """The complete ``step-N`` directories (COMPLETE marker present) under ``checkpoints``, oldest first."""
    if not checkpoints.is_dir():
        return []
    found = [(step, d) for d in checkpoints.iterdir()
             if (step := checkpoint_step(d)) is not None and (d / COMPLETE).is_file()]
    return [d for _, d in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run directory, or None."""
    found = complete_checkpoints(Path(run_dir) / CHECKPOINTS)
    return found[-1] if found else None


def rerun_options(host: str | None, port: int | None) -> tuple[str, ...]:
    """`hetero run`'s own ``--host H --port P``: every command a run suggests repeats them, so it works as printed."""
    return (*(("--host", host) if host else ()), *(("--port", str(port)) if port is not None else ()))


def run_command(plan_path: Path, options: Sequence[str] = ()) -> list[str]:
    """``hetero run PLAN [--host H] [--port P]``: this run's command, for the hints that continue it."""
    return ["hetero", "run", str(plan_path), *options]


def resume_command(run_dir: Path, checkpoint: Path, options: Sequence[str] = ()) -> str:
    """The `hetero run ... --resume CHECKPOINT` command that continues this run where it stopped."""
    return shlex.join([*run_command(Path(run_dir) / "plan.json", options), "--resume", str(checkpoint)])


class RunDirWriteError(RunDirError):
    """A write to the run directory failed; the message ends with how to continue the run."""

    def __init__(self, failed: str, run_dir: Path, last: Path | None, options: Sequence[str] = ()) -> None:
        then = ("run again (no checkpoint was complete yet)" if last is None
                else f"resume with `{resume_command(run_dir, last, options)}`")
        super().__init__(f"{failed} and {then}")
        self.failed, self.run_dir, self.last = failed, run_dir, last

    def for_run(self, options: Sequence[str]) -> RunDirWriteError:
        """The same failure, its resume command with the run's own ``--host/--port`` (``rerun_options``)."""
        return RunDirWriteError(self.failed, self.run_dir, self.last, options)


def write_failure(exc: OSError, what: str, where: Path, run_dir: Path) -> RunDirError:
    """The one-line error for a failed write, with how to continue from the last complete checkpoint."""
    reason = exc.strerror or type(exc).__name__
    if exc.errno in _NO_SPACE:
        fix = "free space"
    elif exc.errno in _READ_ONLY:
        fix = f"make {where} writable"
    else:
        fix = "fix that"
    return RunDirWriteError(f"cannot write {what} to {where} ({reason}): {fix}", run_dir, latest_checkpoint(run_dir))


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (created, renamed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes) -> None:
    """Write ``path`` and flush it to disk (no rename: for files inside a staging directory)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_file(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all: a hidden sibling, fsync, rename over ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}{PARTIAL}")
    try:
        write_bytes(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_run_file(run_dir: Path, name: str, text: str) -> Path:
    """Write ``RUN_DIR/name`` atomically; a failure is a RunDirError (one line, with the resume command)."""
    path = Path(run_dir) / name
    try:
        replace_file(path, text.encode())
    except OSError as exc:
        raise write_failure(exc, name, Path(run_dir), Path(run_dir)) from None
    return path


def append_run_line(run_dir: Path, name: str, line: str) -> None:
    """Append one line to ``RUN_DIR/name``; on failure the file is cut back to whole lines."""
    path = Path(run_dir) / name
    data = (line.rstrip("\n") + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            try:
                if os.write(fd, data) != len(data):  # a short write: the disk filled up mid-line
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            except OSError:
                os.ftruncate(fd, size)  # never leave half a JSON line behind (works on a full disk)
                raise
        finally:
            os.close(fd)
    except OSError as exc:
        raise write_failure(exc, name, Path(run_dir), Path(run_dir)) from None


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True):  # files before the directories holding them
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        elif path.is_dir():
            fsync_dir(path)
    fsync_dir(root)


@contextmanager
def staging_dir(final: Path) -> Iterator[Path]:
    """A hidden sibling of ``final`` to fill; renamed onto ``final`` when the block succeeds.

    On any exception the sibling is removed and ``final`` is as it was. An existing ``final`` (a
    resumed run writing the same step again) is replaced only once the new one is on disk.
    """
    final = Path(final)
    tmp = final.with_name(f".{final.name}{PARTIAL}")
    old = final.with_name(f".{final.name}.old")
    try:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run that was killed while writing
        tmp.mkdir(parents=True)
        yield tmp
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not final.exists():
            os.rename(old, final)
        raise
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (where creating ``path`` would start)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_creatable(run_dir: Path) -> None:
    """Fail now if ``run_dir`` cannot be created or written (read-only disk, no permission, a file)."""
    run_dir = Path(run_dir)
    base = nearest_existing(run_dir)
    if base == run_dir.absolute() and not base.is_dir():
        raise RunDirError(f"run directory {run_dir} is a file: pass --run-dir DIR naming a directory")
    if not base.is_dir():
        raise RunDirError(f"cannot create run directory {run_dir}: {base} is a file; pass another --run-dir")
    # access() answers for this process's user and sees read-only mounts (EROFS), like a real write.
    if not os.access(base, os.W_OK | os.X_OK):
        what = "write to" if base == run_dir.absolute() else f"create {run_dir} in"
        reason = "read-only file system" if _read_only_mount(base) else "permission denied"
        raise RunDirError(f"cannot {what} {base} ({reason}): pass --run-dir on a writable disk")


def _read_only_mount(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def create_run_dir(run_dir: Path) -> None:
    """Create RUN_DIR, RUN_DIR/logs and RUN_DIR/checkpoints, and prove a file can be written there."""
    run_dir = Path(run_dir)
    probe = run_dir / f".write-test{PARTIAL}"
    try:
        for d in (run_dir, run_dir / "logs", run_dir / CHECKPOINTS):
            d.mkdir(parents=True, exist_ok=True)
        write_bytes(probe, b"hetero")
        probe.unlink()
    except OSError as exc:
        probe.unlink(missing_ok=True)
        reason = exc.strerror or type(exc).__name__
        raise RunDirError(f"cannot write to run directory {run_dir} ({reason}): pass --run-dir on a writable disk "
                          "with free space") from None


def check_free_space(run_dir: Path, need_bytes: int, what: str) -> None:
    """Fail now when the run directory's disk cannot hold ``need_bytes`` (``what`` says what they are)."""
    free = shutil.disk_usage(run_dir).free
    if free < need_bytes:
        raise RunDirError(f"run directory {run_dir} has {_mb(free)} free, {what} needs {_mb(need_bytes)}: "
                          "free space or pass --run-dir on a bigger disk")


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
