"""The terminal the commands print to (rich, imported when a command prints)."""

from __future__ import annotations

import sys
from typing import Any


def console(stderr: bool = False) -> Any:
    """A rich Console on stdout (or stderr); pipes and CI logs get a wide fixed width so tables do not
    fold into unreadable columns."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(file=stream, width=None if stream.isatty() else 140, stderr=stderr)
