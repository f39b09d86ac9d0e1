"""Rebalancing a running pipeline (`hetero run ... runtime.rebalance=auto`, the default): the coordinator's side.

Every step, the stages' measured compute (F + B seconds from ``stepdone``) goes to the watcher
(planner/replan/rebalance.py), which proposes a new split when a device's speed changed for good and the
simulator says the move pays. The move happens at a step boundary, without stopping the run:

1. with the clip of the next step the coordinator sends every stage ``rebalance`` (the new node spans);
2. after that step each stage sends its state (LoRA, AdamW moments, step count: the checkpoint payload,
   whole-model keys), drops its layers, builds the new span from the model files and says ``start``
   with its new keys;
3. the coordinator hands each stage the state of its new layers from the union (``state``) and training
   goes on with the next step's data, which is already waiting.

The math does not change: a layer's LoRA weights and optimizer moments move with it, the LR schedule is
a function of the step, and the loss and the global gradient norm do not depend on the split. Each move
is a line in metrics.jsonl (``"event": "rebalance"``). The stage processes stay: a slow device is not
escaped by restarting it, its share of the layers shrinks.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from hetero.plan import Plan
from hetero.protocol import Rebalance, Start, StepDone
from hetero.runtime.run.metrics_file import MoveCause, RebalanceEvent
from hetero.runtime.run.replan_moves import Replan
from hetero.runtime.wire.frames import record_of

log = logging.getLogger("hetero.run")

# Bounds on the watcher's moves, whatever it proposes (a device whose speed keeps changing, or noise the watcher
# takes for a change, must not keep the run rebuilding its stages): after the n-th move its proposals wait
# MOVE_BACKOFF_STEPS x 2^(n-1) steps, and after MAX_MOVES moves the run keeps its split to the end (one line).
MAX_MOVES = 8
MOVE_BACKOFF_STEPS = 5


def split_of(plan: Plan) -> list[int]:
    """Decoder layers per stage."""
    nodes = plan.graph.nodes
    return [sum(1 for i in s.nodes() if nodes[i].kind == "decoder") for s in plan.stages]


def stage_compute_s(done: dict[int, Any]) -> list[float]:
    """Per stage: the step's measured forward + backward seconds (its ``stepdone`` op times)."""
    from hetero.runtime.run.run_segments import compute_s

    return [compute_s(record_of(done[k], StepDone).op_time_s) for k in sorted(done)]


@dataclass
class Move:
    """A move sent with a step's clip: the new spans and what the watcher said about them."""

    after_step: int
    spans: list[list[int]]
    recompute: list[list[str]]
    event: RebalanceEvent
    proposal: Any = None  # planner.replan.rebalance.Proposal (None for a forced move)


class Mover:
    """Watches the run's stage times and carries out the moves; see the module docstring.

    ``forced`` maps a step to a split (decoder layers per stage) to move to after it, whatever the times say:
    tests of the move's math use it."""

    def __init__(self, plan: Plan, mode: str, forced: dict[int, list[int]] | None = None,
                 replans: dict[int, dict[str, float]] | None = None, made: int = 0) -> None:
        """``replans``: step -> device speed factors to re-plan at after it, whatever the times say (tests of a
        re-plan move's math); ``made``: re-plan moves earlier in the run (runtime/run/replan_moves.py)."""
        from hetero.runtime.run.replan_moves import PlanMover, replan_kind
        from hetero.runtime.wire.rules import can_rebalance

        self.plan, self.forced = plan, dict(forced or {})
        self.replans = dict(replans or {})
        self.replanner: PlanMover | None = None  # plans whose layers move by a re-plan (replan_moves.py)
        self.replan: Replan | None = None  # the re-plan due at a step boundary
        self.watch: Any = None
        self.pending: Move | None = None
        self.telemetry: list[Any] = []  # per stage: its device's clocks, temperature, throttling (last step)
        self.sent: Move | None = None
        self.moves = 0  # the watcher's moves so far (MAX_MOVES)
        self.quiet_until = 0  # no proposal is taken for a move after a step before this one (MOVE_BACKOFF_STEPS)
        self.said = False  # whether the run said that no move can help (once)
        if not can_rebalance(plan):
            self.forced = {}
            if replan_kind(plan) is not None and (mode == "auto" or self.replans):
                self.replanner = PlanMover(plan, made, MAX_MOVES)
                if mode != "auto":
                    self.replanner.watch = None
        elif mode == "auto":
            self.watch = _watch(plan)

    @property
    def enabled(self) -> bool:
        return self.watch is not None or bool(self.forced)

    def measured_factors(self, last: int = 5) -> dict[str, float]:
        """Device name -> its compute measured over priced, the median of the last ``last`` steps the watcher saw
        (empty when it watched none: runtime.rebalance=off, or no step yet)."""
        if self.watch is None or len(self.watch.history) <= self.watch.skip:
            return {}
        rows = self.watch.history[self.watch.skip:][-last:]
        return {s.device: statistics.median(row[k] for row in rows) for k, s in enumerate(self.plan.stages)}

    def started(self, build_s: dict[int, float], startup_s: float | None = None) -> None:
        """The stages are built: a move costs about their slowest build (it rebuilds every stage), a re-plan about
        ``startup_s`` (the seconds from this coordinator's start to its stages' start: it restarts them)."""
        if self.watch is not None and build_s:
            self.watch.move_cost_s = max(build_s.values())
        if self.replanner is not None and startup_s is not None:
            self.replanner.restart_s = startup_s

    def _observe_replan(self, step: int, done: dict[int, Any]) -> None:
        """A plan whose layers move by a re-plan: is one due after the next step?"""
        from hetero.runtime.run.replan_moves import forced_factors

        assert self.replanner is not None
        if self.replan is not None:
            return
        if step + 1 in self.replans:
            factors = forced_factors(self.plan, self.replans.pop(step + 1))
            self.replan = self.replanner.decide(step + 1, factors, None, None, forced=True)
        elif step + 1 < self.plan.train.steps - 1:
            try:
                self.replan = self.replanner.observe(step, stage_compute_s(done))
            except Exception as exc:  # never let the watcher stop a run: train on with the plan as it is
                log.warning("runtime.rebalance: off from step %d on, the watcher failed (%s: %s)", step,
                            type(exc).__name__, exc)
                self.replanner.watch = None

    def replan_due(self, done: int) -> Replan | None:
        """The re-plan to go on under after ``done`` steps, if one is due then (taken: asked once)."""
        if self.replan is None or self.replan.after_step != done:
            return None
        replan, self.replan = self.replan, None
        return replan

    def observe(self, step: int, done: dict[int, Any]) -> None:
        """Step ``step``'s reports are in: decide whether the stages move after the next step."""
        self.telemetry = [record_of(done[k], StepDone).telemetry for k in sorted(done)]
        if self.replanner is not None:
            self._observe_replan(step, done)
            return
        if not self.enabled or self.pending is not None or self.sent is not None:
            return
        if step + 1 in self.forced:
            self.pending = self._forced(step + 1, self.forced.pop(step + 1))
            return
        if self.watch is None or step + 1 >= self.plan.train.steps - 1:
            return
        try:
            proposal = self.watch.observe(stage_compute_s(done), self.plan.train.steps - step - 2)
        except Exception as exc:  # never let the watcher stop a run: train on with the plan's split
            log.warning("runtime.rebalance: off from step %d on, the watcher failed (%s: %s)", step,
                        type(exc).__name__, exc)
            self.watch = None
            return
        if self.watch.declined is not None:
            self._say_once(self.watch.declined)
            self.watch.declined = None
        if proposal is not None and step + 1 >= self.quiet_until:
            self.pending = self._proposed(step + 1, proposal)

    def _say_once(self, line: str) -> None:
        """A lasting change no move can help, said on stderr the first time only (the run goes on as it is)."""
        if self.said:
            return
        self.said = True
        log.warning("runtime.rebalance: %s", line)
        print(f"hetero run: runtime.rebalance: {line}", file=sys.stderr, flush=True)

    def announce(self, step: int, send: Callable[[Rebalance], None]) -> None:
        """Before step ``step``'s clip: tell every stage to move after it (when a move is due)."""
        if self.pending is not None and self.pending.after_step == step:
            send(Rebalance(spans=self.pending.spans, recompute=self.pending.recompute,
                           reason=self.pending.event.cause.reason))
            self.sent, self.pending = self.pending, None

    def due(self, step: int) -> bool:
        """Whether the stages move after step ``step`` (it was announced with its clip)."""
        return self.sent is not None and self.sent.after_step == step

    def carry_out(self, step: int, payloads: dict[int, Any] | None, gather: Callable[[str, int], dict[int, Any]],
                  send_state: Callable[[int, dict[str, Any], dict[str, Any]], None],
                  save: Callable[[dict[int, Any]], Any]) -> tuple[Plan, RebalanceEvent]:
        """Steps 2-3 of the module docstring: the stages' states (``payloads`` if a checkpoint just brought them;
        else gathered and ``save``d as one, so a move that fails half-way loses nothing), their ``start`` from the
        new spans, each its new layers' state; the plan and event line after the move."""
        from hetero.runtime.run.checkpoint import merge_payloads, select_payload

        clock = timed()
        if payloads is None:
            payloads = gather("checkpoint", step)
            save(payloads)
        state = merge_payloads([(m.tensors, m.meta) for _, m in sorted(payloads.items())],
                               f"the stages' states after step {step} disagree on the step")
        for k, msg in sorted(gather("start", 0).items()):
            send_state(k, *select_payload(*state, list(record_of(msg, Start).keys), k))
        return self.moved(clock())

    def moved(self, move_s: float) -> tuple[Plan, RebalanceEvent]:
        """The move is done: the plan with its new spans and the metrics.jsonl event line."""
        assert self.sent is not None
        move, self.sent = self.sent, None
        self.plan = self.plan.with_spans(move.spans, move.recompute)
        if self.watch is not None and move.proposal is not None:
            self.watch.moved(move.proposal)
            self._bound(move.after_step)
        elif self.watch is not None:
            self.watch.restart(tuple((a, b) for a, b in move.spans), tuple(len(r) for r in move.recompute))
        return self.plan, replace(move.event, move_s=round(move_s, 4), split=split_of(self.plan))

    def _bound(self, after_step: int) -> None:
        """After the watcher's move: the wait before its next one doubles; after MAX_MOVES it stops watching."""
        self.moves += 1
        self.quiet_until = after_step + 1 + MOVE_BACKOFF_STEPS * 2 ** (self.moves - 1)
        if self.moves >= MAX_MOVES:
            line = (f"hetero run: runtime.rebalance made {self.moves} moves, the most one run makes: the stages keep "
                    "this split to the end (a device whose speed keeps changing is better left out of the fleet)")
            log.warning("%s", line)
            print(line, file=sys.stderr, flush=True)
            self.watch = None

    def _proposed(self, after_step: int, proposal: Any) -> Move:
        """A Move from the watcher's Proposal, with the event line a person reads."""
        from hetero.runtime.stage.telemetry import throttle_cause

        cause = proposal.cause
        throttle = throttle_cause(self.telemetry[cause]) if cause < len(self.telemetry) else None
        event = RebalanceEvent(
            after_step=after_step + 1,  # the steps done before it (records.STEP_NUMBERS)
            cause=MoveCause(stage=cause, device=self.plan.stages[cause].device,
                            slowdown=round(proposal.change[cause], 3), throttle=throttle,
                            reason=proposal.reason + (f" ({throttle})" if throttle else "")),
            speed_factors=[round(f, 4) for f in proposal.factors],
            old_split=self.watch.replanner.counts(proposal.old.spans),
            new_split=self.watch.replanner.counts(proposal.new.spans),
            old_spans=[list(s) for s in proposal.old.spans], new_spans=[list(s) for s in proposal.new.spans],
            predicted_step_s_before=proposal.old.step_s, predicted_step_s_after=proposal.new.step_s,
            predicted_gain=round(proposal.gain, 4), predicted_stage_s_after=list(proposal.new.stage_compute_s))
        return Move(after_step, [list(s) for s in proposal.new.spans], self.watch.replanner.recompute_names(proposal.new),
                    event, proposal)

    def _forced(self, after_step: int, split: list[int]) -> Move:
        """A Move to ``split`` (decoder layers per stage) asked for by the caller."""
        from hetero.planner.model.objective import split_spans

        spans = split_spans(len(self.plan.graph.nodes), split, self.plan.graph.decoder_indices())
        event = RebalanceEvent(after_step=after_step + 1, old_split=split_of(self.plan), new_split=list(split),
                               old_spans=[[s.first_node, s.last_node] for s in self.plan.stages],
                               new_spans=[list(s) for s in spans], cause=MoveCause(reason="forced by the caller"))
        return Move(after_step, [list(s) for s in spans], [[] for _ in spans], event)


def _watch(plan: Plan) -> Any:
    """The watcher of ``plan``'s stages (planner/replan/rebalance.py), or None (logged) if its costs cannot be rebuilt."""
    from hetero.planner.replan.rebalance import Replanner, Watch

    try:
        replanner = Replanner(plan)
    except Exception as exc:  # a plan the cost model cannot price again: train on, without moves
        log.warning("runtime.rebalance: off for this run, its plan's costs cannot be rebuilt (%s)", exc)
        return None
    spans = tuple((s.first_node, s.last_node) for s in plan.stages)
    return Watch(replanner, spans, tuple(len(s.recompute_layers) for s in plan.stages))


def timed() -> Callable[[], float]:
    """A stopwatch: call the result for the seconds since."""
    t0 = time.perf_counter()
    return lambda: time.perf_counter() - t0
