"""Third-party warnings go to a log file, not the terminal.

torch, transformers, peft and bitsandbytes warn about their own deprecations and optional packages; on a
user's terminal that noise buries hetero's own lines and breaks the progress display. The `hetero`
command routes every warning raised outside hetero into a log (the run's ``logs/warnings.log``, the
plan's ``warnings.log``), kept in memory until the command says where that is. hetero's own warnings
still print.
"""

from __future__ import annotations

import atexit
import os
import warnings
from pathlib import Path
from typing import Any, TextIO

_HETERO_ROOT = str(Path(__file__).resolve().parents[1])  # the source tree (editable) or site-packages/hetero
_OURS = ("hetero", "compiler", "planner", "runtime")  # top-level folders installed under hetero.*

_state: dict[str, Any] = {"pending": [], "path": None, "original": None}


def _is_ours(filename: str) -> bool:
    try:
        path = Path(filename).resolve()
    except (OSError, ValueError):
        return False
    if "site-packages" in path.parts and "hetero" not in path.parts:
        return False
    return any(str(path).startswith(str(Path(_HETERO_ROOT) / part) + "/") for part in _OURS)


def _show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
          file: TextIO | None = None, line: str | None = None) -> None:
    if _is_ours(filename) and _state["original"] is not None:
        _state["original"](message, category, filename, lineno, file, line)
        return
    text = warnings.formatwarning(message, category, filename, lineno, line)
    if _state["path"] is None:
        _state["pending"].append(text)
    else:
        _append(_state["path"], [text])


def _append(path: Path, texts: list[str]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as log:
            log.writelines(texts)
    except OSError:
        pass  # a log that cannot be written never stops the command


def default_log() -> Path:
    """Where a command without a run or output directory keeps them: ~/.cache/hetero/warnings.log."""
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "hetero" / "warnings.log"


def route_to_log() -> None:
    """From now on, warnings raised outside hetero are kept for the log (see ``log_to``); any still kept
    when the process ends go to ``default_log()``."""
    if _state["original"] is None:
        _state["original"] = warnings.showwarning
        warnings.showwarning = _show
        atexit.register(_flush_at_exit)


def _flush_at_exit() -> None:
    if _state["pending"]:
        _append(default_log(), _state["pending"])


def log_to(path: Path) -> None:
    """Write the warnings kept so far, and every later one, to ``path`` (created when the first comes)."""
    _state["path"] = Path(path)
    pending, _state["pending"] = _state["pending"], []
    if pending:
        _append(Path(path), pending)
