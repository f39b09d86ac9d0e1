"""The one clock every solver checks: planner.time_limit_s bounds the whole solve, not CBC alone."""

from __future__ import annotations

import time


class OutOfTime(Exception):
    """The solve's deadline passed inside a solver; planner.solve catches it and reports honestly."""


def check(deadline: float | None) -> None:
    """Raise OutOfTime once ``time.perf_counter()`` is past ``deadline`` (None: no limit)."""
    if deadline is not None and time.perf_counter() > deadline:
        raise OutOfTime


def left(deadline: float | None) -> float:
    """Seconds until ``deadline`` (inf without one)."""
    return float("inf") if deadline is None else deadline - time.perf_counter()


def share_of(deadline: float, fraction: float, reserve: float = 0.0) -> float:
    """The time ``fraction`` of the way from now to ``reserve`` seconds before ``deadline`` (never before now)."""
    now = time.perf_counter()
    return now + max(0.0, fraction * (deadline - reserve - now))
