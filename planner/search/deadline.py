"""The one clock every solver checks, and the one place that splits it: planner.time_limit_s bounds the whole
plan (every search, not CBC alone), and the shares below say which search may spend how much of it.

The planner spends the limit L in this order (planner.plan):

1. **Kept back**: min(MAX_RESERVE_S, RESERVE_SHARE x L) for what follows the searches (programs, the
   baselines' simulations).
2. **The placement** (planner/search/solve.py solve_simulated): PLACE_SHARE of the rest when replicas are searched
   after it, else all of it. Inside it:
   - the closed-form optimum (solve) gets at most CLOSED_SHARE x L (all of the window where host RAM may
     bind: its optimum is then the plan); of its own limit the exact DP may take DP_SHARE, the ILP (where the
     DP cannot answer) the rest;
   - the schedule's bound over every placement (planner/search/step_bound.py) BOUND_SHARE of what is then left;
   - the search by simulated step the remainder (SEARCH_SHARE x L when called without a deadline).
3. **The chunked form** (planner/search/interleave.py): its chunking search, at most INTERLEAVE_SHARE of what is left
   when replicas are searched after it (it is weighed against them), else until the deadline.
4. **The replicas** (planner/replica/replica_choice.py): the last search, so all that is left but what was kept back
   (REPLICA_SHARE x L, at least MIN_REPLICA_S, when called without the plan's deadline); when solve_replicas
   must find the single pipeline itself, that takes SINGLE_SHARE of its time.

A search that is cut off says so in the plan, with its best lower bound (docs/reading-a-plan.md).
"""

from __future__ import annotations

import time

# The shares of the module docstring, in the order the planner spends them.
RESERVE_SHARE, MAX_RESERVE_S = 0.1, 1.0
PLACE_SHARE = 0.55
CLOSED_SHARE = 0.4
DP_SHARE = 0.6
BOUND_SHARE = 0.3
SEARCH_SHARE = 0.7
INTERLEAVE_SHARE = 0.5
REPLICA_SHARE, MIN_REPLICA_S = 0.3, 2.0
SINGLE_SHARE = 0.5


class OutOfTime(Exception):
    """The solve's deadline passed inside a solver; planner.search.solve catches it and reports honestly."""


def check(deadline: float | None) -> None:
    """Raise OutOfTime once ``time.perf_counter()`` is past ``deadline`` (None: no limit)."""
    if deadline is not None and time.perf_counter() > deadline:
        raise OutOfTime


def left(deadline: float | None) -> float:
    """Seconds until ``deadline`` (inf without one)."""
    return float("inf") if deadline is None else deadline - time.perf_counter()


def reserve_s(time_limit_s: float) -> float:
    """The seconds kept back from a plan's limit for what follows the searches."""
    return min(MAX_RESERVE_S, RESERVE_SHARE * time_limit_s)


def share_of(deadline: float, fraction: float, reserve: float = 0.0) -> float:
    """The time ``fraction`` of the way from now to ``reserve`` seconds before ``deadline`` (never before now)."""
    now = time.perf_counter()
    return now + max(0.0, fraction * (deadline - reserve - now))
