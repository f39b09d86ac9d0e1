"""Third-party warnings go to a log file, not the terminal.

torch, transformers, peft and bitsandbytes warn about their own deprecations and optional packages; on a
user's terminal that noise buries hetero's own lines and breaks the progress display. The `hetero`
command routes every warning raised outside hetero into a log (the run's ``logs/warnings.log``, the
plan's ``warnings.log``), kept in memory until the command says where that is. hetero's own warnings
still print.

The routing state lives in the router that replaces ``warnings.showwarning`` (the one process-wide hook
Python has for this), not in this module.
"""

from __future__ import annotations

import atexit
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

_OURS = ("hetero", "hetero.compiler", "hetero.planner", "hetero.runtime")  # the source folders installed as hetero.*
_roots: tuple[str, ...] | None = None


def _our_roots() -> tuple[str, ...]:
    """The folders hetero's packages load from, found by the import system (an editable install maps the top-level
    folders compiler/, planner/, runtime/; an installed one has them under site-packages/hetero/). find_spec reads
    where a package is without running it."""
    global _roots
    if _roots is None:
        import importlib.util

        found = []
        for name in _OURS:
            spec = importlib.util.find_spec(name)
            found += [str(Path(p).resolve()) + os.sep for p in (spec.submodule_search_locations or [])] if spec else []
        _roots = tuple(found)
    return _roots


def _is_ours(filename: str) -> bool:
    try:
        path = Path(filename).resolve()
    except (OSError, ValueError):
        return False
    return str(path).startswith(_our_roots())


def _append(path: Path, texts: list[str]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as log:
            log.writelines(texts)
    except OSError:
        pass  # a log that cannot be written never stops the command


class WarningRouter:
    """Installed as ``warnings.showwarning``: hetero's own warnings go to ``original``, the rest to the log."""

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original
        self.path: Path | None = None
        self.pending: list[str] = []  # formatted warnings until the command names its log

    def __call__(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: TextIO | None = None, line: str | None = None) -> None:
        if _is_ours(filename):
            self.original(message, category, filename, lineno, file, line)
            return
        text = warnings.formatwarning(message, category, filename, lineno, line)
        if self.path is None:
            self.pending.append(text)
        else:
            _append(self.path, [text])

    def log_to(self, path: Path) -> None:
        """Write the warnings kept so far, and every later one, to ``path``."""
        self.path = Path(path)
        pending, self.pending = self.pending, []
        if pending:
            _append(self.path, pending)

    def flush_at_exit(self) -> None:
        """Warnings still kept when the process ends go to ``default_log()``."""
        if self.pending:
            _append(default_log(), self.pending)
            self.pending = []


def default_log() -> Path:
    """Where a command without a run or output directory keeps them: ~/.cache/hetero/warnings.log."""
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "hetero" / "warnings.log"


def route_to_log() -> WarningRouter:
    """From now on, warnings raised outside hetero are kept for the log (see ``log_to``); any still kept
    when the process ends go to ``default_log()``. Installing it twice keeps the first router."""
    current = warnings.showwarning
    if isinstance(current, WarningRouter):
        return current
    router = WarningRouter(current)
    warnings.showwarning = router
    atexit.register(router.flush_at_exit)
    return router


def log_to(path: Path) -> None:
    """Write the warnings kept so far, and every later one, to ``path`` (created when the first comes);
    without a router installed (library use, not the `hetero` command) warnings are left alone."""
    current = warnings.showwarning
    if isinstance(current, WarningRouter):
        current.log_to(path)
