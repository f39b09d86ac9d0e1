"""The planner: the graph placed on the fleet, with its programs, predictions, baselines and verdict. Never
imports torch.

Its wings import only the wings below them (tests/unit/test_import_rules.py), bottom up:

- ``schedule``: the schedules' programs, their closed step forms and the event simulator;
- ``model``: what a placement costs: the cost table, the cost models (datasheets, profiles), links, streaming,
  the objective, and a placement's prediction;
- ``search``: the placement searches: the exact DP, the ILP, the simulated search and its bounds, interleaving;
- ``replica``: data-parallel pipeline replicas: their packing, bounds and choice;
- ``explain``: what a person reads beside the plan: baselines, bottlenecks, feasibility, caveats, the verdict;
- ``compose.py``: ``plan()``, which composes them;
- ``replan``: plans made again from a run: what-ifs, rebalancing, recovery from a lost device.

``from hetero.planner import plan`` loads compose.py (and with it the wings) only when ``plan`` is asked for:
importing one wing's module loads that wing and those below it, not the whole planner.
"""

from __future__ import annotations

from typing import Any

__all__ = ["plan"]


def __getattr__(name: str) -> Any:
    if name == "plan":
        from hetero.planner.compose import plan

        return plan
    raise AttributeError(f"module 'hetero.planner' has no attribute {name!r}")
