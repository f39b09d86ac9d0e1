"""Rebalancing during a run: when a device's measured speed changes, re-plan the split of the running stages.

The run's stages are processes bound to devices, and they stay (a slow device is not escaped by restarting
it); what can move is which layers each one holds. So the re-plan keeps the plan's device order and stage
count and chooses new node spans, with the same cost table and simulator as the compile, every device's
compute scaled by its measured speed:

    factor(stage k) = measured F + B seconds per step / the table's m x (forward + backward) of its span

A factor of 1 means the device runs as the cost model priced it; 3 means three times slower. What triggers
a re-plan is a *change* of factor against the one the current split was planned for (calibrated on the
first steps after the start and after every move), sustained over ``Watch.sustain`` steps, so neither noise
nor a device that was slow from the start and already priced moves anything. A move is proposed only when
the simulator, with the measured factors, predicts the new split faster by more than ``Watch.min_gain``.

Splits for the fixed device order are enumerated when there are few (every split of the decoder layers,
each stage keeping at least one; the embedding stays on the first stage, norm and head on the last) and
scored by the simulator; with many, the split DP's candidates (planner/search/splits.py) and their one-layer
neighbours are. Compute only is scaled: message and optimizer costs stay as planned.

Torch-free and PuLP-free (the coordinator imports it).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from itertools import combinations
from math import comb

from hetero.plan import Plan
from hetero.planner.model.cost import CostTable, build_cost_table, training_fleet
from hetero.planner.model.cost_model import CostModel, plan_roofline
from hetero.planner.model.objective import Evaluation, Placement, evaluate, split_spans
from hetero.planner.model.predict import predict
from hetero.specs import ClusterSpec

ENUMERATE_LIMIT = 3000  # splits of one device order scored one by one; above, the split DP's and neighbours
Spans = tuple[tuple[int, int], ...]


def scaled_table(table: CostTable, factors: dict[int, float]) -> CostTable:
    """``table`` with device d's compute (forward, backward, recomputation, optimizer) times ``factors[d]``, and a
    CPU device's copies of streamed weights too: there the copy is a memcpy on the cores that slowed, where a GPU's
    is a DMA over its host link, which a throttled card does not slow."""
    def scale(rows: list[list[float]], only: set[int] | None = None) -> list[list[float]]:
        return [[v * factors.get(d, 1.0) if only is None or d in only else v for d, v in enumerate(row)]
                for row in rows]

    cpus = {d for d, dev in enumerate(table.devices) if dev.backend == "cpu"}
    return replace(table, fwd_s=scale(table.fwd_s), bwd_s=scale(table.bwd_s), recompute_s=scale(table.recompute_s),
                   opt_s=scale(table.opt_s),
                   opt_fixed_s=[v * factors.get(d, 1.0) for d, v in enumerate(table.opt_fixed_s)],
                   stream_fetch_s=scale(table.stream_fetch_s, cpus),
                   stream_start_s=scale([table.stream_start_s], cpus)[0], _stream_prefix={})


@dataclass(frozen=True)
class Option:
    """One split of the running stages, simulated with given speed factors."""

    spans: Spans
    recompute: tuple[int, ...]  # per stage: recomputing decoder layers (its first ones)
    step_s: float  # simulated step time
    stage_compute_s: tuple[float, ...]  # per stage: F + B seconds per step
    evaluation: Evaluation = field(compare=False, repr=False)


class Replanner:
    """The plan's cost table and device order; simulates and re-splits them under measured speed factors.

    A plan that streams weights from host RAM is re-split here too, but its layers move by a re-plan
    (runtime/run/replan_moves.py): which layers stream and the resident cap are planned again for each new span
    (runtime/wire/rules.py's can_rebalance keeps in-place moves off)."""

    def __init__(self, plan: Plan, cost_model: CostModel | None = None, cluster: ClusterSpec | None = None,
                 order: list[str] | None = None) -> None:
        """``cluster`` and ``order`` (device names in pipeline order): another fleet and stage order than the plan's
        (a run that lost a device: planner/replan/recovery.py)."""
        self.plan = plan
        cost_model = cost_model or plan_roofline(plan)
        self.table = build_cost_table(plan.graph, plan.model,
                                      training_fleet(cluster or plan.cluster, plan.eval.device, *plan.planner.exclude),
                                      plan.train, plan.planner, cost_model)
        names = [d.name for d in self.table.devices]
        self.devices = tuple(names.index(name) for name in (order or [s.device for s in plan.stages]))
        self.decoders = plan.graph.decoder_indices()
        self.num_nodes = len(plan.graph.nodes)

    def compute_s(self, spans: Spans, recompute: tuple[int, ...] | None = None) -> list[float]:
        """Per stage: the table's F + B seconds per step for these spans (unscaled)."""
        ev = evaluate(self.table, Placement(self.devices, spans, self._recompute(spans, recompute)))
        m = self.table.num_micro_batches
        return [m * (f + b) for f, b in zip(ev.fwd_s, ev.bwd_s, strict=True)]

    def factors(self, spans: Spans, recompute: tuple[int, ...] | None, measured_s: list[float]) -> list[float]:
        """Per stage: measured / priced compute (1.0 where nothing was priced)."""
        priced = self.compute_s(spans, recompute)
        return [m / p if p > 0 else 1.0 for m, p in zip(measured_s, priced, strict=True)]

    def option(self, spans: Spans, recompute: tuple[int, ...] | None, factors: list[float]) -> Option | None:
        """``spans`` simulated with the stages' devices at ``factors``; None if they do not fit in memory."""
        table = scaled_table(self.table, dict(zip(self.devices, factors, strict=True)))
        ev = evaluate(table, Placement(self.devices, spans, self._recompute(spans, recompute)))
        if not ev.feasible:
            return None
        return self._option(table, ev)

    def _recompute(self, spans: Spans, recompute: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """The stages' recomputing layers, at most as many as the table can recompute in each span."""
        if recompute is None:
            return None
        can = [sum(self.table.recomputable[i] for i in range(a, b + 1)) for a, b in spans]
        return tuple(min(r, c) for r, c in zip(recompute, can, strict=True))

    def _option(self, table: CostTable, ev: Evaluation) -> Option:
        m = table.num_micro_batches
        step = predict(table, ev)[0].step_time_s
        return Option(ev.placement.spans, tuple(ev.recompute), step,
                      tuple(m * (f + b) for f, b in zip(ev.fwd_s, ev.bwd_s, strict=True)), ev)

    def best(self, factors: list[float]) -> Option | None:
        """The fastest split of the running stages (same devices, same order) at ``factors``, by simulation."""
        table = scaled_table(self.table, dict(zip(self.devices, factors, strict=True)))
        best: Option | None = None
        for spans in self._candidates(table):
            ev = evaluate(table, Placement(self.devices, spans))
            if ev.feasible:
                opt = self._option(table, ev)
                if best is None or opt.step_s < best.step_s * (1 - 1e-9) or (
                        opt.step_s <= best.step_s * (1 + 1e-9) and self._evener(opt.spans, best.spans)):
                    best = opt
        return best

    def _evener(self, a: Spans, b: Spans) -> bool:
        """Whether split ``a`` spreads the decoder layers more evenly than ``b`` (the tie-break of equal times)."""
        return max(self.counts(a)) < max(self.counts(b))

    def _candidates(self, table: CostTable) -> list[Spans]:
        """Every split of the decoder layers over the stages when few, else the split DP's and their neighbours."""
        stages, layers = len(self.devices), len(self.decoders)
        if comb(layers - 1, stages - 1) <= ENUMERATE_LIMIT:
            return [self._spans(_counts(cuts, layers)) for cuts in combinations(range(1, layers), stages - 1)]
        from hetero.planner.search.splits import split_for_order

        found = {p.spans for p in split_for_order(table, self.devices)}
        return sorted(found | {n for s in found for n in self._neighbours(s)})

    def _spans(self, counts: list[int]) -> Spans:
        return tuple(split_spans(self.num_nodes, counts, self.decoders))

    def counts(self, spans: Spans) -> list[int]:
        """Decoder layers per stage of ``spans``."""
        dec = set(self.decoders)
        return [sum(1 for i in range(a, b + 1) if i in dec) for a, b in spans]

    def _neighbours(self, spans: Spans) -> list[Spans]:
        """Splits one decoder layer away from ``spans`` (one cut moved by one layer)."""
        counts = self.counts(spans)
        out = []
        for k in range(len(counts) - 1):
            for delta in (-1, 1):
                moved = list(counts)
                moved[k] += delta
                moved[k + 1] -= delta
                if min(moved) >= 1:
                    out.append(self._spans(moved))
        return out

    def recompute_names(self, option: Option) -> list[list[str]]:
        """Per stage: the node names of its recomputing layers (its first recomputable ones)."""
        from hetero.planner.compose import recompute_layers

        return [recompute_layers(self.table, self.plan.graph, option.evaluation, k) for k in range(len(option.spans))]


def _counts(cuts: tuple[int, ...], layers: int) -> list[int]:
    edges = [0, *cuts, layers]
    return [b - a for a, b in zip(edges, edges[1:], strict=False)]


@dataclass(frozen=True)
class Proposal:
    """A move the watcher asks for: the new split, why, and what the simulator predicts it gains."""

    old: Option
    new: Option
    factors: tuple[float, ...]  # per stage: the measured speed factors it was planned with
    change: tuple[float, ...]  # per stage: factor / the factor the old split was planned for
    cause: int  # the stage whose device changed most
    reason: str

    @property
    def gain(self) -> float:
        """Predicted old step / new step."""
        return self.old.step_s / self.new.step_s if self.new.step_s > 0 else 1.0


@dataclass
class Watch:
    """Per step, the stages' measured compute; proposes a move when a device's speed changed for good.

    ``skip`` steps after the start and after each move are left out (they build and warm up), the next
    ``calibrate`` give each stage's reference factor (after a move, once calibrated, the split is re-planned
    on those speeds: a move decided on a few noisy steps gets one correction); a change beyond ``drift``
    (either way) in each of the
    last ``sustain`` steps, on the same stage, asks the replanner; a split predicted ``min_gain`` faster is
    proposed, else the measured factors become the reference (re-validated: nothing to move). A move must
    also pay for itself: the predicted seconds saved per step times the steps left exceed twice
    ``move_cost_s`` (the stages' build time: what a move costs), so a short run or a tiny model never moves.
    """

    replanner: Replanner
    spans: Spans
    recompute: tuple[int, ...] | None = None
    skip: int = 1
    calibrate: int = 3
    sustain: int = 4
    drift: float = 1.3
    min_gain: float = 1.15
    move_cost_s: float = 1.0
    history: list[list[float]] = field(default_factory=list)  # factors of the steps since the last (re)start
    reference: list[float] | None = None
    last_move: Proposal | None = None  # the move just made, checked once on the speeds measured after it
    declined: str | None = None  # a lasting change no move can help, in words (the run says it once)
    _why: str = ""  # why the last proposal was not made

    def observe(self, measured_s: list[float], steps_left: int) -> Proposal | None:
        """One step's per-stage F + B seconds, and the steps the run has left after the next one (when a
        move would happen); a Proposal when the current split should change."""
        self.history.append(self.replanner.factors(self.spans, self.recompute, measured_s))
        seen = self.history[self.skip:]
        if self.reference is None:
            if len(seen) >= self.calibrate:
                self.reference = _medians(seen[-self.calibrate:])
                return self._verify(steps_left)
            return None
        if len(seen) < self.sustain:
            return None
        recent = seen[-self.sustain:]
        cause = self._drifted(recent)
        if cause is None:
            return None
        factors = _medians(recent)
        self._why = ""
        proposal = self._paying(self._propose(factors, cause), steps_left)
        if proposal is None and self._why:
            change = factors[cause] / self.reference[cause]
            how = f"{change:.2f}x slower" if change > 1 else f"{1 / change:.2f}x faster"
            self.declined = (f"stage {cause} ({self.replanner.plan.stages[cause].device}) runs {how} than when its "
                             f"split was planned; no move can help: {self._why}")
        if proposal is None:
            self.reference = factors  # the split is still the best at these speeds
            self.history = self.history[:self.skip]  # and the next verdict needs `sustain` new steps
        return proposal

    def _verify(self, steps_left: int) -> Proposal | None:
        """Just calibrated after a move: the move was planned on a few noisy steps, so re-plan once on the
        speeds measured on the new split; a clearly better split (min_gain, paying) corrects it."""
        last, self.last_move = self.last_move, None
        if last is None or self.reference is None:
            return None
        return self._paying(self._propose(self.reference, last.cause, base=list(last.factors),
                                          why="measured on its new split, the last move's re-plan was off"),
                            steps_left)

    def _paying(self, proposal: Proposal | None, steps_left: int) -> Proposal | None:
        """``proposal`` if the seconds it saves before the run ends exceed twice a move's cost, else None."""
        if proposal is None:
            return None
        saved = (proposal.old.step_s - proposal.new.step_s) * steps_left
        if saved < 2 * self.move_cost_s:
            self._why = (f"a move would save {saved:.3g} s over the {steps_left} steps left, less than twice the "
                         f"{self.move_cost_s:.3g} s a move costs")
            return None
        return proposal

    def _drifted(self, recent: list[list[float]]) -> int | None:
        assert self.reference is not None
        return drifted(self.reference, recent, self.drift)

    def _propose(self, factors: list[float], cause: int, base: list[float] | None = None,
                 why: str | None = None) -> Proposal | None:
        """The best split at ``factors`` if it beats the current one by ``min_gain`` (``base``: the factors the
        current split was planned for, default the reference; ``why``: the reason's first words)."""
        old = self.replanner.option(self.spans, self.recompute, factors)
        new = self.replanner.best(factors)
        if old is None or new is None:
            self._why = "no split of its layers over the running stages fits their memory"
            return None
        if new.spans == self.spans or old.step_s < new.step_s * self.min_gain:
            self._why = ("the running split is still the best at the measured speeds" if new.spans == self.spans else
                         f"the best split, {self.counts_of(new)}, simulates {new.step_s:.3g} s a step against "
                         f"{old.step_s:.3g} s now (a move needs {self.min_gain:g}x)")
            return None
        base = base or self.reference
        assert base is not None
        change = tuple(f / r for f, r in zip(factors, base, strict=True))
        device = self.replanner.plan.stages[cause].device
        how = "slower" if change[cause] > 1 else "faster"
        ratio = change[cause] if change[cause] > 1 else 1 / change[cause]
        why = why or f"stage {cause} ({device}) runs {ratio:.2f}x {how} than when its split was planned"
        reason = (f"{why}; split {self.replanner.counts(self.spans)} -> {self.replanner.counts(new.spans)} decoder "
                  f"layers, predicted {old.step_s:.3g} -> {new.step_s:.3g} s/step")
        return Proposal(old, new, tuple(factors), change, cause, reason)

    def counts_of(self, option: Option) -> list[int]:
        return self.replanner.counts(option.spans)

    def moved(self, proposal: Proposal) -> None:
        """The stages now hold ``proposal.new``: watch that split, calibrating afresh."""
        self.spans, self.recompute = proposal.new.spans, proposal.new.recompute
        self.history, self.reference, self.last_move = [], None, proposal

    def restart(self, spans: Spans, recompute: tuple[int, ...] | None) -> None:
        """The stages hold ``spans`` now (a move the watcher did not propose): watch them, calibrating afresh."""
        self.spans, self.recompute = spans, recompute
        self.history, self.reference = [], None


def drifted(reference: list[float], recent: list[list[float]], drift: float) -> int | None:
    """The stage whose factor moved beyond ``drift`` against ``reference`` the same way in every recent step (the
    largest such change), or None."""
    worst, cause = 0.0, None
    for k, ref in enumerate(reference):
        ratios = [row[k] / ref for row in recent]
        slower, faster = min(ratios) > drift, max(ratios) < 1 / drift
        size = statistics.median(ratios) if slower else 1 / statistics.median(ratios) if faster else 0.0
        if size > worst:
            worst, cause = size, k
    return cause


@dataclass
class DeviceWatch:
    """Per step, each stage's measured compute over its price (``priced_s``): the speed factors of a plan
    whose layers cannot move in place (interleaved chunks, streamed weights), which a move re-plans whole
    (runtime/run/moves.py). The same rules as Watch: ``skip`` warm-up steps, a reference over ``calibrate``, a
    change beyond ``drift`` on one stage in each of the last ``sustain`` steps."""

    priced_s: list[float]  # per stage: F + B seconds per step at the re-plan's prices (recovery.Pricing.compute_s)
    skip: int = 1
    calibrate: int = 3
    sustain: int = 4
    drift: float = 1.3
    history: list[list[float]] = field(default_factory=list)
    reference: list[float] | None = None

    def factors(self, measured_s: list[float]) -> list[float]:
        return [m / p if p > 0 else 1.0 for m, p in zip(measured_s, self.priced_s, strict=True)]

    def observe(self, measured_s: list[float]) -> tuple[int, list[float]] | None:
        """One step's per-stage F + B seconds; (the stage that changed most, the recent factors) once a change
        is sustained."""
        self.history.append(self.factors(measured_s))
        seen = self.history[self.skip:]
        if self.reference is None:
            if len(seen) >= self.calibrate:
                self.reference = _medians(seen[-self.calibrate:])
            return None
        if len(seen) < self.sustain:
            return None
        recent = seen[-self.sustain:]
        cause = drifted(self.reference, recent, self.drift)
        return None if cause is None else (cause, _medians(recent))

    def settle(self, factors: list[float]) -> None:
        """Nothing to move at ``factors``: they become the reference, and the next verdict needs ``sustain`` new
        steps."""
        self.reference, self.history = list(factors), self.history[:self.skip]


def _medians(rows: list[list[float]]) -> list[float]:
    return [statistics.median(col) for col in zip(*rows, strict=True)]
