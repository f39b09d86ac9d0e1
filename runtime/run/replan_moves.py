"""Rebalancing a plan whose layers cannot move in place: a re-plan at the speeds the run measured, taken at a step
boundary the way a device that came back is (runtime/run/elastic.py).

An interleaved plan's devices hold several chunks each, a plan of data x pipeline replicas shares each step's
micro-batches among pipelines, and a plan that streams weights from host RAM planned which layers stream and each
stage's resident cap for its own span: moving the edges of spans (runtime/run/moves.py) applies to none. For those
plans the watcher (planner/replan/rebalance.py DeviceWatch) compares each stage's measured compute with the plan's
prediction of it; when one device's speed changed for good, the run plans its layers again over the same devices at
the measured speeds (planner/replan/recovery.py ``plan_without`` with nothing lost: one pipeline in the same order
by the split search recovery uses, a streaming plan's streamed layers and resident caps planned again for the new
spans by the same planner; replicas by the solver, each device's compute scaled by its speed, ``AtSpeeds``,
so a slowed replica may get fewer micro-batches or fewer layers), simulates both plans at those speeds (``Pricing``:
both priced by the datasheet table the re-plan uses, and the speeds measured against it), and moves only when the
new plan is ``MIN_GAIN`` faster and the seconds it saves over the steps left exceed twice what a restart of the
stages cost at the start of this run. The move: every stage's state after the step is copied, the new plan is saved
as RUN_DIR/plan-rebalance-N.json, and the run goes on under it from the next step (remote hosts' workers start their
stages of it), so no step is trained twice and the math is that of one process. Where no move pays, the run says so
once.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

from hetero.errors import HeteroError
from hetero.plan import Plan
from hetero.runtime.run.metrics_file import MoveCause, RebalanceEvent

log = logging.getLogger("hetero.run")

MIN_GAIN = 1.15  # a re-plan is taken when it simulates this much faster at the measured speeds, or more


@dataclass
class Replan:
    """A re-plan due after ``after_step`` steps: the plan the run goes on under and its metrics line."""

    after_step: int
    plan: Plan
    event: RebalanceEvent


class PlanMover:
    """The re-plan side of the Mover for one run's plan; ``made``: re-plan moves earlier in the run."""

    def __init__(self, plan: Plan, made: int, max_moves: int) -> None:
        from hetero.planner.replan.rebalance import DeviceWatch
        from hetero.planner.replan.recovery import Pricing

        self.plan, self.made, self.max_moves = plan, made, max_moves
        self.restart_s = 10.0  # until measured: what restarting every stage costs (started())
        self.said: set[str] = set()
        self.watch: DeviceWatch | None = None
        self.pricing: Pricing | None = None
        try:  # priced by the datasheet table the re-plan uses, whatever the plan's own predictions came from
            self.pricing = Pricing(plan)
            self.watch = DeviceWatch(self.pricing.compute_s(plan))
        except Exception as exc:  # a plan the cost model cannot price again: train on, without moves
            log.warning("runtime.rebalance: off for this run, its plan's costs cannot be rebuilt (%s)", exc)
            return
        if made >= max_moves:
            self.say(f"runtime.rebalance made {made} moves, the most one run makes: the stages keep this plan to the "
                     "end (a device whose speed keeps changing is better left out of the fleet)")
            self.watch = None

    def say(self, line: str) -> None:
        if line not in self.said:
            self.said.add(line)
            log.warning("runtime.rebalance: %s", line)
            print(f"hetero run: runtime.rebalance: {line}", file=sys.stderr, flush=True)

    def observe(self, step: int, measured_s: list[float]) -> Replan | None:
        """Step ``step``'s per-stage F + B seconds: a Replan due after the next boundary, or None."""
        if self.watch is None:
            return None
        seen = self.watch.observe(measured_s)
        if seen is None:
            return None
        cause, factors = seen
        assert self.watch.reference is not None
        change = factors[cause] / self.watch.reference[cause]
        replan = self.decide(step + 1, factors, cause, change)
        if replan is None:
            self.watch.settle(factors)
        return replan

    def decide(self, done: int, factors: list[float], cause: int | None, change: float | None,
               forced: bool = False) -> Replan | None:
        """The re-plan after ``done`` steps at the per-stage speed ``factors`` if it pays (``forced``: whatever
        it gains); else None, said once."""
        from hetero.planner.replan.recovery import plan_without

        plan = self.plan
        if self.pricing is None:  # its costs could not be rebuilt (logged when the run began)
            return None
        speeds = {s.device: f for s, f in zip(plan.stages, factors, strict=True)}
        what = (f"stage {cause} ({plan.stages[cause].device}) runs {max(change, 1 / change):.2f}x "
                f"{'slower' if change > 1 else 'faster'} than when this plan was made" if cause is not None
                and change else "forced by the caller")
        note = (f"Re-planned during the run at the speeds it measured (compute over priced: "
                f"{', '.join(f'{d} {f:.2f}x' for d, f in speeds.items())}): {what}.")
        try:
            new = plan_without(plan, set(), speeds, note=note)
            before, after = self.pricing.step_at_speeds(plan, speeds), self.pricing.step_at_speeds(new.plan, speeds)
        except HeteroError as exc:
            self.say(f"{what}, but its layers cannot be planned again: {exc}")
            return None
        steps_left = plan.train.steps - done
        saved = (before - after) * steps_left
        if not forced and (before < after * MIN_GAIN or saved < 2 * self.restart_s):
            because = (f"the best plan at the measured speeds simulates {after:.3g} s a step against {before:.3g} s now"
                       if before < after * MIN_GAIN else
                       f"a re-plan would save {saved:.3g} s over the {steps_left} steps left, less than twice the "
                       f"{self.restart_s:.3g} s a restart of the stages costs")
            self.say(f"{what}; no move can help: {because}")
            return None
        split = [len([i for i in s.nodes() if plan.graph.nodes[i].kind == "decoder"]) for s in plan.stages]
        shares = ("" if len(plan.pipelines) == len(new.plan.pipelines) == 1 else
                  f", micro-batches per replica {_shares(plan)} -> {_shares(new.plan)}")
        event = RebalanceEvent(
            after_step=done,
            cause=MoveCause(reason=f"{what}; re-planned: {split} -> {new.split} decoder layers{shares}, simulated "
                                   f"{before:.3g} -> {after:.3g} s/step at the measured speeds",
                            stage=cause, device=plan.stages[cause].device if cause is not None else None,
                            slowdown=round(change, 3) if change else None),
            speed_factors=[round(f, 4) for f in factors], old_split=split, new_split=list(new.split),
            old_spans=[[a, b] for s in plan.stages for a, b in s.spans()],
            new_spans=[[a, b] for s in new.plan.stages for a, b in s.spans()],
            predicted_step_s_before=round(before, 6), predicted_step_s_after=round(after, 6),
            predicted_gain=round(before / after, 4) if after > 0 else None,
            predicted_stage_s_after=[round(c * speeds.get(s.device, 1.0), 6)
                                     for s, c in zip(new.plan.stages, self.pricing.compute_s(new.plan), strict=True)])
        return Replan(done, new.plan, event)


def replanning(coordinator: Any, replan: Replan) -> Any:
    """The coordinator's turn onto a re-plan after ``replan.after_step`` steps (an elastic.Rejoining to raise): the
    plan saved in the run dir, the stages' state copied, the line said; None (said) when the plan is too large to
    send to other hosts."""
    from dataclasses import replace

    from hetero.runtime.run.elastic import MAX_PLAN_BYTES, Rejoining

    done = replan.after_step
    path = coordinator.run_dir / f"plan-rebalance-{len(coordinator.options.earlier_plans) + 1}.json"
    replan.plan.save(path)
    if len(path.read_bytes()) > MAX_PLAN_BYTES:
        coordinator.mover.replanner.say(f"the re-plan {path} is larger than a message may carry to the other hosts: "
                                        "going on with this plan")
        return None
    coordinator.signals.training = False
    coordinator.keeper.state_after(done)
    event = replace(replan.event, plan=path.name, started_at=time.monotonic())
    print(f"hetero run: rebalancing after step {done}: {event.cause.reason}; plan {path}", file=sys.stderr, flush=True)
    return Rejoining(replan.plan, path, event, [])


def _shares(plan: Plan) -> str:
    return "/".join(str(r.num_micro_batches) for r in plan.pipelines)


def forced_factors(plan: Plan, by_device: dict[str, float]) -> list[float]:
    """Per stage: the factor ``by_device`` names for its device (1.0 where absent)."""
    return [float(by_device.get(s.device, 1.0)) for s in plan.stages]


def replan_kind(plan: Any) -> str | None:
    """Why this plan's layers move by a re-plan instead of in place (None: they move in place, or not at all)."""
    if len(plan.pipelines) > 1:
        return "replicas"
    if len(plan.stages) < 2:
        return None
    if any(s.stream_layers for s in plan.stages):
        return "streamed"
    if any(s.chunks for s in plan.stages):
        return "interleaved"
    return None
