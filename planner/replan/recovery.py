"""Re-planning a run that lost a device (`hetero run ... runtime.elastic=auto`, the default: runtime/run/elastic.py).

The stages that are left keep their pipeline order; what changes is how many there are and which layers each
holds. The split is chosen the way rebalancing chooses one (planner/replan/rebalance.py): every split of the decoder
layers over the remaining devices (or the split DP's candidates and their neighbours, when there are many),
simulated with the same cost table, each device's compute scaled by the speed the run measured on it. The
complete plan (programs for the new stage count, predictions, memory, baselines) is then made by
``planner.plan`` as a manual split of those devices, so it is checked and priced like any compiled plan.

Neither the ILP nor PuLP runs here for one pipeline: the coordinator calls this while its stages wait. A plan of
data x pipeline replicas is planned again whole (``planner.plan`` on the devices it trained on, less the lost ones,
within RECOVERY_TIME_LIMIT_S): how many replicas, how many stages each, which layers where; the math does not
depend on it (the checkpoint is layout-free, and every micro-batch of a step is still trained once).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hetero.errors import InfeasiblePlanError
from hetero.plan import Plan
from hetero.planner.model.cost_model import RooflineCostModel, plan_roofline
from hetero.planner.replan.rebalance import Replanner
from hetero.specs import ClusterSpec

RECOVERY_TIME_LIMIT_S = 10.0  # the solver's limit when a replicated plan is planned again during the run


@dataclass(frozen=True)
class Recovery:
    """The plan on the devices that are left, and what the re-plan saw."""

    plan: Plan
    split: list[int]  # decoder layers per remaining stage
    devices: list[str]  # the remaining devices, in pipeline order
    predicted_step_s: float  # the new plan's step time (datasheet costs, as any plan's)
    simulated_step_s: float  # the same split simulated at the measured speeds


def without_devices(cluster: ClusterSpec, lost: set[str]) -> ClusterSpec:
    """``cluster`` less the devices named in ``lost`` (their hosts stay: the coordinator may run on one)."""
    return replace(cluster, hosts=[replace(h, devices=[d for d in h.devices if d.name not in lost])
                                   for h in cluster.hosts])


def plan_without(plan: Plan, lost: set[str], factors: dict[str, float] | None = None, note: str | None = None
                 ) -> Recovery:
    """``plan`` re-planned on its devices less ``lost``, in the same order; ``factors``: device name -> measured
    compute over priced (1.0 where absent); ``note``: the plan's first verdict line (default: what was lost). A
    one-line InfeasiblePlanError when the devices left cannot hold the model, or none is left."""
    from hetero.planner import plan as make_plan

    if len(plan.pipelines) != 1:
        return _replicas_without(plan, lost, factors if not lost else None, note)
    order = [s.device for s in plan.stages if s.device not in lost]
    if not order:
        raise InfeasiblePlanError("no training device is left")
    fleet = without_devices(plan.cluster, lost)
    cost_model = plan_roofline(plan)
    replanner, best = _best_split(plan, order, fleet, cost_model, factors or {})
    if best is None:
        raise InfeasiblePlanError(f"the {len(order)} device(s) left ({', '.join(order)}) cannot hold the model: "
                                  "no split of its layers fits their memory")
    split = replanner.counts(best.spans)
    # One chunk per device: the split chosen above is of contiguous spans (and interleave=always might refuse).
    options = replace(plan.planner, devices=order, split=split, num_stages=None, replicas=1, interleave="off")
    new = make_plan(plan.model, plan.graph, fleet, plan.train, plan.data, options, cost_model, plan.eval,
                    plan.config, plan.data_stats)
    note = note or (f"Re-planned during the run after losing {', '.join(sorted(lost))}: {len(order)} stage(s) on the "
                    f"devices left, split {'/'.join(map(str, split))} chosen by simulation at the speeds the run measured.")
    new = named_like(replace(new, security=plan.security, verdict=[note, *new.verdict]), plan)
    return Recovery(new, split, order, new.prediction.step_time_s, best.step_s)


class Pricing:
    """A plan's layers priced by its datasheet cost table (the table ``plan_without`` re-plans with), whatever its
    stored predictions came from (a plan compiled with ``profile=`` stores the profile's): a plan and its re-plan,
    and the speeds measured against either, compare on one footing."""

    def __init__(self, plan: Plan) -> None:
        self.replanner = Replanner(plan)
        self.index = {d.name: k for k, d in enumerate(self.replanner.table.devices)}
        self.node = {n.name: i for i, n in enumerate(plan.graph.nodes)}

    def times(self, device: str, first: int, last: int, recompute: list[str]) -> tuple[float, float]:
        """(forward, backward) seconds per micro-batch of nodes ``first..last`` on ``device``, recomputing
        ``recompute``."""
        t, d = self.replanner.table, self.index[device]
        again = sum(t.recompute_s[self.node[name]][d] for name in recompute if name in self.node)
        return (sum(t.fwd_s[i][d] for i in range(first, last + 1)),
                sum(t.bwd_s[i][d] for i in range(first, last + 1)) + again)

    def copy_s(self, device: str, streamed: list[str]) -> float:
        """Seconds per pass (the forward's, and again the backward's) that copying the ``streamed`` layers' frozen
        weights from host RAM adds on ``device`` (planner/model/objective.py stream_terms, layer by layer)."""
        t, d = self.replanner.table, self.index[device]
        nodes = [self.node[name] for name in streamed if name in self.node]
        return sum(t.stream_fetch_s[i][d] for i in nodes) + (t.stream_start_s[d] if nodes else 0.0)

    def repriced(self, plan: Plan) -> Plan:
        """``plan`` (on this plan's devices) with every stage's and chunk's forward and backward from the table, a
        streaming stage's copies included."""
        def stage(s: Any) -> Any:
            chunks = [replace(c, **dict(zip(("fwd_time_s", "bwd_time_s"),
                                            self.times(s.device, c.first_node, c.last_node, c.recompute_layers),
                                            strict=True))) for c in s.chunks]
            fwd, bwd = self.times(s.device, s.first_node, s.last_node, s.recompute_layers)
            copy = self.copy_s(s.device, s.stream_layers)
            return replace(s, fwd_time_s=fwd + copy, bwd_time_s=bwd + copy, stream_time_s=2 * copy, chunks=chunks)

        return replace(plan, stages=[stage(s) for s in plan.stages])

    def compute_s(self, plan: Plan) -> list[float]:
        """Per stage: its F + B seconds per step at the table's prices (every chunk's)."""
        m = {k: r.num_micro_batches for r in plan.pipelines for k in r.stages}
        return [m[k] * (st.fwd_time_s + st.bwd_time_s + sum(c.fwd_time_s + c.bwd_time_s for c in st.chunks))
                for k, st in enumerate(self.repriced(plan).stages)]

    def step_at_speeds(self, plan: Plan, factors: dict[str, float]) -> float:
        """``plan``'s programs simulated at the table's prices, each device's compute times its measured speed
        factor (device -> measured compute over priced, 1.0 where absent)."""
        return step_at_speeds(self.repriced(plan), factors)


def step_at_speeds(plan: Plan, factors: dict[str, float]) -> float:
    """``plan``'s stored programs simulated with each stage's (and chunk's) forward and backward seconds times its
    device's measured speed factor (device -> measured compute over priced, 1.0 where absent): the step the plan
    takes on the fleet as the run measured it. Messages, links and the optimizer stay as planned; so do a GPU's
    copies of streamed weights (a CPU's are scaled with its compute: planner/replan/rebalance.py scaled_table)."""
    from hetero.planner.schedule.simulator import simulate_plan

    backend = {d.name: d.backend for d in plan.cluster.devices}

    def scaled(s: Any) -> Any:
        f = float(factors.get(s.device, 1.0))
        chunks = [replace(c, fwd_time_s=c.fwd_time_s * f, bwd_time_s=c.bwd_time_s * f) for c in s.chunks]
        kept = 0.0 if backend.get(s.device) == "cpu" else s.stream_time_s / 2  # see scaled_table: copies by DMA
        return replace(s, fwd_time_s=(s.fwd_time_s - kept) * f + kept, bwd_time_s=(s.bwd_time_s - kept) * f + kept,
                       chunks=chunks)

    return float(simulate_plan(replace(plan, stages=[scaled(s) for s in plan.stages])).step_time_s)


def simulated_step_s(plan: Plan, lost: set[str], factors: dict[str, float]) -> float | None:
    """The best split of ``plan``'s layers over its devices less ``lost``, simulated at the measured speeds
    ``factors`` (device -> measured compute over priced): what a re-plan would choose, without making the plan (so
    a plan with a device back and the plan without it compare at the same speeds). None for a plan of replicas,
    or when no split fits."""
    order = [s.device for s in plan.stages if s.device not in lost]
    if len(plan.pipelines) != 1 or not order:
        return None
    _, best = _best_split(plan, order, without_devices(plan.cluster, lost),
                          plan_roofline(plan), factors)
    return None if best is None else best.step_s


def _best_split(plan: Plan, order: list[str], fleet: ClusterSpec, cost_model: RooflineCostModel,
                factors: dict[str, float]) -> tuple[Replanner, Any]:
    """The split search of one pipeline over the devices ``order`` of ``fleet``, and its best split at the speeds
    ``factors`` (1.0 where absent; None when no split fits)."""
    replanner = Replanner(plan, cost_model, cluster=fleet, order=order)
    return replanner, replanner.best([float(factors.get(name, 1.0)) for name in order])


class AtSpeeds(RooflineCostModel):
    """The plan's datasheet cost model with each device's compute (layers and optimizer) times its measured speed
    factor (device name -> measured over priced; 1.0 where absent): the solver plans for the fleet as the run
    measured it."""

    def __init__(self, base: RooflineCostModel, factors: dict[str, float]) -> None:
        super().__init__(base.efficiency)
        self.cipher_s_per_byte, self.factors = base.cipher_s_per_byte, dict(factors)

    def node_time_s(self, graph: Any, model: Any, node: int, device: Any, tokens: int) -> tuple[float, float]:
        f = self.factors.get(device.name, 1.0)
        fwd, bwd = super().node_time_s(graph, model, node, device, tokens)
        return fwd * f, bwd * f

    def optimizer_step_s(self, device: Any, model: Any, lora_params: int, lora_tensors: int) -> float:
        return super().optimizer_step_s(device, model, lora_params, lora_tensors) * self.factors.get(device.name, 1.0)


def _replicas_without(plan: Plan, lost: set[str], factors: dict[str, float] | None = None,
                      note: str | None = None) -> Recovery:
    """A data x pipeline plan planned again on the devices it trained on, less ``lost`` (devices it left unused stay
    unused; a held-out evaluation keeps its spare device, so such plans are refused); ``factors``: the measured
    speeds the solver plans at (AtSpeeds; None: the datasheet's, as after a loss)."""
    from hetero.planner import plan as make_plan

    if plan.eval.every > 0:
        raise InfeasiblePlanError("a plan with data x pipeline replicas and eval.every > 0 is not re-planned after a "
                                  "loss (the solver could take the evaluation's spare device)")
    used = [s.device for s in plan.stages]
    left = [name for name in dict.fromkeys(used) if name not in lost]
    if not left:
        raise InfeasiblePlanError("no training device is left")
    fleet = without_devices(plan.cluster, {d.name for d in plan.cluster.devices} - set(left))
    cost_model = AtSpeeds(plan_roofline(plan), factors) if factors else plan_roofline(plan)
    options = replace(plan.planner, devices=None, split=None, num_stages=None, replicas=None, interleave="off",
                      time_limit_s=min(plan.planner.time_limit_s, RECOVERY_TIME_LIMIT_S))
    new = make_plan(plan.model, plan.graph, fleet, plan.train, plan.data, options, cost_model, plan.eval,
                    plan.config, plan.data_stats)
    nodes = new.graph.nodes
    split = [sum(1 for i in s.nodes() if nodes[i].kind == "decoder") for s in new.stages]
    shape = " + ".join(f"{len(r.stages)} stage(s) x {r.num_micro_batches} micro-batch(es)" for r in new.pipelines)
    devices = [s.device for s in new.stages]
    note = note or (f"Re-planned during the run after losing {', '.join(sorted(lost))}: {len(new.pipelines)} "
                    f"replica(s) ({shape}) on {len(set(devices))} of the {len(left)} device(s) left, planned again by "
                    "the solver (datasheet or profile costs, not the speeds the run measured).")
    new = named_like(replace(new, security=plan.security, verdict=[note, *new.verdict]), plan)
    return Recovery(new, split, devices, new.prediction.step_time_s, new.prediction.step_time_s)


def named_like(new: Plan, *before: Plan) -> Plan:
    """``new`` with each stage running under the process name its device had in ``before`` (the plans of the run,
    newest first): a host's key files and its worker's first plan.json stay valid, whatever the stage's index now.
    The input hash covers the names (a stage of the old plan cannot say hello to the new one by mistake)."""
    from hetero.plan import compute_input_hash

    names: dict[str, str] = {}
    for old in reversed(before):  # the newest plan's name wins
        names.update({s.device: old.stage_id(k) for k, s in enumerate(old.stages)})
    stages = []
    for s in new.stages:
        if s.device not in names:
            raise InfeasiblePlanError(f"device {s.device} ran no stage of this run: it has no process name (key)")
        stages.append(replace(s, name=names[s.device]))
    named = replace(new, stages=stages)
    return replace(named, input_hash=compute_input_hash(named))
