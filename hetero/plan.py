"""Plan: the compiler's output and the runtime's input (plan.json), versioned and validated."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetero import __version__
from hetero.errors import PlanError
from hetero.graph import LayerGraph
from hetero.plan_checks import check_plan, has_security
from hetero.program import Action, parse_program
from hetero.security import SecuritySpec, stage_name
from hetero.serde import check_schema_version, from_dict, read_versioned_json, to_dict
from hetero.specs import (
    ClusterSpec,
    DataSpec,
    EvalSpec,
    ModelSpec,
    PlannerOptions,
    TrainSpec,
)

PLAN_SCHEMA_VERSION = 1
_RECOMPILE = "recompile with `hetero compile`"



def plan_path(text: str) -> Path:
    """A command line's plan: ``plan.json``, or the directory `hetero compile` wrote it to (its plan.json)."""
    path = Path(text)
    return path / "plan.json" if path.is_dir() else path

@dataclass(frozen=True)
class MemoryBreakdown:
    """Predicted peak memory of one stage on its device, in GB (1e9 bytes)."""

    weights_gb: float
    lora_gb: float  # LoRA parameters + gradients + AdamW state (fp32)
    activations_gb: float  # saved activations of the micro-batches in flight at this position
    workspace_gb: float
    total_gb: float
    available_gb: float  # device memory minus headroom
    experts_gb: float = 0.0  # of weights_gb, a mixture of experts' weights (every expert is held)
    # Frozen weights of streamed layers kept in host RAM (not in total_gb); weights_gb counts what is resident on
    # the device: the other layers' frozen weights plus the streaming buffer.
    host_gb: float = 0.0
    # An interleaved device (planner/search/interleave.py): per chunk, chunk 0 first, what one micro-batch keeps through
    # it, and what one recomputing layer's re-run needs besides (0: none recomputes). activations_gb is their peak
    # over the device's program. Empty: one chunk per device, or a plan from before they were recorded.
    chunk_gb_per_mb: list[float] = field(default_factory=list)
    working_gb: float = 0.0


@dataclass(frozen=True)
class ChunkPlan:
    """A further chunk of layers a stage's device holds under an interleaved schedule (hetero/program.py): chunk
    c >= 1 of stage k of a pipeline of p is virtual stage c x p + k; its predicted times per micro-batch."""

    first_node: int
    last_node: int
    node_names: list[str]
    fwd_time_s: float
    bwd_time_s: float
    send_time_s: float  # its activation to the next virtual stage (0 for the pipeline's last)
    recompute_layers: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class StagePlan:
    index: int
    host: str
    device: str  # DeviceSpec.name
    device_type: str
    backend: str
    dtype: str  # compute dtype on this device; also what it sends on the wire
    quantization: str  # what this device applies ("none" where nf4 is unsupported)
    first_node: int  # inclusive index into graph.nodes
    last_node: int  # inclusive
    node_names: list[str]
    endpoint: str  # tcp://address:port this stage binds for its inbound traffic
    threads: int | None
    fwd_time_s: float  # predicted, per micro-batch
    bwd_time_s: float
    send_time_s: float  # activation to the next stage (0 for the last)
    memory: MemoryBreakdown
    program: list[str]  # text-form actions (hetero.program)
    artifact: str = ""  # stage artifact directory, relative to plan.json
    # Predicted seconds an action costs besides compute ("RA"/"SA"/"RG"/"SG": one message's CPU
    # time; "STEP": the optimizer step), and the gradient-norm round trip to the coordinator.
    overhead_s: dict[str, float] = field(default_factory=dict)
    step_sync_s: float = 0.0
    # Decoder layers that recompute their forward during backward (keeping only their input), and
    # the seconds per micro-batch that adds to bwd_time_s (which includes it).
    recompute_layers: list[str] = field(default_factory=list)
    recompute_time_s: float = 0.0
    # Decoder layers whose frozen weights live in host RAM and are copied to the device before each use
    # (planner.offload), the seconds per micro-batch that adds to fwd_time_s + bwd_time_s (which include it),
    # the bytes copied host-to-device per optimizer step, and the most frozen-weight bytes resident on the
    # device at once (the other layers' plus the streaming buffer): what the runtime must stay within.
    stream_layers: list[str] = field(default_factory=list)
    stream_time_s: float = 0.0
    streamed_bytes_per_step: float = 0.0
    frozen_resident_cap_bytes: float = 0.0
    # The hand-offs to the next stage of its pipeline, and their gradients back, on the wire: none, int8 or int4
    # (planner.compression; runtime/wire/compress.py). "none" on a pipeline's last stage.
    compress_out: str = "none"
    # The process name this stage's process runs under: its key file, its transport name, its peers' name for it.
    # Empty: stage<index>. A plan re-planned during a run (runtime.elastic) keeps each device's name from the plan
    # it replaces, so a host's key files, and a worker started with the first plan.json, stay valid for it.
    name: str = ""
    # Under an interleaved schedule, the device's chunks after its first (the first is first_node..last_node, with
    # fwd_time_s, bwd_time_s and send_time_s its own); its program names each action's chunk. Empty otherwise.
    chunks: list[ChunkPlan] = field(default_factory=list)

    def stream_summary(self) -> str:
        """``37 layers stream from host RAM (+38 ms/mb, 793 GB/step)``; empty when none streams."""
        if not self.stream_layers:
            return ""
        ms = self.stream_time_s * 1e3
        time = f"{ms:.3g} ms" if ms < 1e3 else f"{self.stream_time_s:.3g} s"
        gb = self.streamed_bytes_per_step / 1e9
        amount = f"{gb:,.0f}" if gb >= 100 else f"{gb:.3g}"
        return f"{len(self.stream_layers)} layers stream from host RAM (+{time}/mb, {amount} GB/step)"

    def actions(self) -> list[Action]:
        """This stage's program parsed (hetero.program's one parser); ValueError names a bad token."""
        return parse_program(self.program)

    def spans(self) -> list[tuple[int, int]]:
        """The node spans of this stage's chunks, the first (first_node..last_node) first: one but interleaved."""
        return [(self.first_node, self.last_node)] + [(c.first_node, c.last_node) for c in self.chunks]

    def nodes(self) -> list[int]:
        """The graph nodes this stage's device holds (every chunk's)."""
        return [i for a, b in self.spans() for i in range(a, b + 1)]

    def compute_s(self) -> float:
        """Predicted forward + backward seconds of one micro-batch through all of this stage's chunks."""
        return self.fwd_time_s + self.bwd_time_s + sum(c.fwd_time_s + c.bwd_time_s for c in self.chunks)


@dataclass(frozen=True)
class ReplicaPlan:
    """One pipeline replica of a data x pipeline plan: its stages and its share of the step's batch.

    Replicas hold the whole model each, on disjoint devices, and train on disjoint micro-batches of
    the same optimizer step; at the step their LoRA gradients are summed (through the coordinator)
    so the update is the one a single device computes over the whole global batch.
    """

    stages: list[int]  # indices into Plan.stages, in pipeline order (replica r's follow replica r-1's)
    num_micro_batches: int  # this replica's share of train.num_micro_batches
    first_micro_batch: int  # where its share starts in the step's micro-batches
    step_time_s: float = 0.0  # predicted step time of this replica alone (before the reduction)


@dataclass(frozen=True)
class Prediction:
    step_time_s: float
    tokens_per_step: int
    tokens_per_s: float
    bubble_fraction: float  # idle fraction of the pipeline's device-time during a step
    stage_busy: list[float]  # per stage: busy fraction of the step
    stage_memory_gb: list[float]
    reduce_s: float = 0.0  # summing LoRA gradients across replicas at the optimizer step (0: one replica)
    # tokens_per_step and tokens_per_s count every token a step computes, padding included. Where `hetero compile`
    # measured the data (Plan.data_stats): the share of them that carries a label, and the trained (label)
    # tokens per second that makes; None: no data statistics, only computed tokens are known.
    label_fraction: float | None = None
    trained_tokens_per_s: float | None = None
    # runtime.elastic=auto copies the stages' state to the coordinator's memory every ``state_copy_every`` steps,
    # ``state_copy_s`` a copy (planner/model/state_copy.py); 0: not priced (plans from before).
    state_copy_bytes: float = 0.0
    state_copy_s: float = 0.0
    state_copy_every: int = 0


def with_label_fraction(prediction: Prediction, label_fraction: float | None) -> Prediction:
    """``prediction`` with its trained tokens/s: ``label_fraction`` x the computed tokens/s (None: unknown)."""
    if label_fraction is None:
        return dataclasses.replace(prediction, label_fraction=None, trained_tokens_per_s=None)
    return dataclasses.replace(prediction, label_fraction=label_fraction,
                               trained_tokens_per_s=label_fraction * prediction.tokens_per_s)


@dataclass(frozen=True)
class DataStats:
    """The training data as `hetero compile` measured it, tokenized with the model's tokenizer as `hetero run` does
    (the whole file, or a sample of a big one): what the plan's trained tokens/s rests on. Not hashed: the same
    placement trains any data."""

    source: str  # data.path, or the bundled demo set
    records: int  # records measured
    total_records: int  # records in the file (more than ``records``: a sample was measured)
    median_tokens: int  # tokens per record, before truncation to seq_len
    p95_tokens: int
    longest_tokens: int
    truncated: int  # measured records longer than seq_len (cut to it)
    seq_len: int
    packed: bool  # data.packing
    rows_per_epoch: int  # rows of seq_len tokens one pass over the whole file takes (scaled from a sample)
    efficiency: float  # record tokens / computed tokens (the rest is padding)
    label_fraction: float  # label (trained) tokens / computed tokens
    suggested_seq_len: int  # the shortest seq_len that cuts no measured record (multiple of 64, at most seq_len)
    # The causal length whose attention does the rows' work (hetero/packing.py LengthStats): what the cost model
    # priced attention at (0: not measured; seq_len then).
    attention_len: float = 0.0
    # Measured records with a text far longer than a row can use (runtime/run/data.py cut_ids): tokenized from its
    # start only, so the token counts above are lower bounds for them.
    cut_before_tokenizing: int = 0

    @property
    def sampled(self) -> bool:
        """Whether the figures come from a sample of the file's records."""
        return self.records < self.total_records

    def steps_per_epoch(self, train: TrainSpec, epochs: int = 1) -> int:
        """Optimizer steps ``epochs`` passes over the data take: its rows over the step's micro_batch_size x
        num_micro_batches (hetero/packing.py steps_for_epochs; the runtime counts them from the data it reads)."""
        from hetero.packing import steps_for_epochs

        return steps_for_epochs(epochs, self.rows_per_epoch, train.micro_batch_size * train.num_micro_batches)


@dataclass(frozen=True)
class Baseline:
    name: str  # best_single_device | even_split | tflops_proportional
    description: str
    feasible: bool
    reason: str = ""  # why infeasible
    devices: list[str] = field(default_factory=list)
    layer_counts: list[int] = field(default_factory=list)  # decoder layers per stage
    prediction: Prediction | None = None


@dataclass(frozen=True)
class SolverReport:
    solver: str  # "exact DP" or "PuLP/CBC" (planner/search/solve.py): whose answer this is, and who proved it
    status: str  # pulp.LpStatus text (the exact DP reports in the same words)
    sol_status: str  # pulp.LpSolution text ("Optimal Solution Found", "Solution Found", ...)
    proven_optimal: bool  # that solver proved no placement is faster (under the cost model)
    gap: float | None  # relative gap between best solution and bound, when known
    objective_s: float | None
    solve_time_s: float
    time_limit_s: float
    num_variables: int = 0
    num_constraints: int = 0
    message: str = ""
    # The questions a plan answers (SETTLED_PARTS) -> whether the search settled each (proved it, or the
    # settings fixed it); proven_optimal only when every one is. Empty for manual splits and old plans.
    settled: dict[str, bool] = field(default_factory=dict)
    unsettled: dict[str, str] = field(default_factory=dict)  # per part not settled: what was searched, why it stopped
    # When not proven: the best lower bound on the step time of any plan the search covers (None: none known).
    lower_bound_s: float | None = None


# What "proven optimal" covers: how many stages, the data-parallel replicas (how many, their shares),
# which layers recompute, and which device runs which layers.
SETTLED_PARTS = ("stages", "replicas", "recompute", "placement")


@dataclass(frozen=True)
class Plan:
    model: ModelSpec
    cluster: ClusterSpec
    train: TrainSpec
    data: DataSpec
    planner: PlannerOptions
    graph: LayerGraph
    stages: list[StagePlan]
    prediction: Prediction
    baselines: list[Baseline]
    solver: SolverReport
    verdict: list[str]  # sentences a person reads: why this plan, and when a single device is as good
    config: dict[str, Any] = field(default_factory=dict)  # the resolved Hydra config
    # Where each cost number came from ("profile", "roofline (why)"); empty for datasheet-only plans.
    cost_sources: dict[str, str] = field(default_factory=dict)
    input_hash: str = ""
    # Who may talk to the run's processes (hetero/security.py): the mode and every process's public key.
    security: SecuritySpec = field(default_factory=SecuritySpec)
    # Data x pipeline: the pipeline replicas (empty: one pipeline of every stage, all micro-batches).
    replicas: list[ReplicaPlan] = field(default_factory=list)
    eval: EvalSpec = field(default_factory=EvalSpec)  # held-out evaluation (run-time settings, not hashed)
    data_stats: DataStats | None = None  # the data as `hetero compile` measured it (None: not readable then)
    created: str = ""
    hetero_version: str = __version__
    schema_version: int = PLAN_SCHEMA_VERSION

    @property
    def schedule(self) -> str:
        return self.train.schedule

    @property
    def pipelines(self) -> list[ReplicaPlan]:
        """The plan's replicas; a plan without any is one pipeline of all its stages."""
        if self.replicas:
            return self.replicas
        return [ReplicaPlan(list(range(len(self.stages))), self.train.num_micro_batches, 0,
                            self.prediction.step_time_s)]

    def replica_of(self, k: int) -> tuple[int, ReplicaPlan, int]:
        """Stage k's replica index, the replica, and k's position in its pipeline."""
        for r, rep in enumerate(self.pipelines):
            if k in rep.stages:
                return r, rep, rep.stages.index(k)
        raise PlanError(f"stage {k} belongs to no replica of the plan; {_RECOMPILE}")

    def prev_stage(self, k: int) -> int | None:
        """The stage that feeds stage k its activations (None: k is the first of its pipeline)."""
        _, rep, pos = self.replica_of(k)
        return rep.stages[pos - 1] if pos > 0 else None

    def next_stage(self, k: int) -> int | None:
        """The stage stage k sends its activations to (None: k is the last of its pipeline)."""
        _, rep, pos = self.replica_of(k)
        return rep.stages[pos + 1] if pos + 1 < len(rep.stages) else None

    def stage_id(self, k: int) -> str:
        """Stage k's process name (stage<k> unless the plan names it otherwise: StagePlan.name)."""
        return self.stages[k].name or stage_name(k)

    def stage_ids(self) -> list[str]:
        return [self.stage_id(k) for k in range(len(self.stages))]

    def stage_named(self, name: str) -> int | None:
        """The index of the stage whose process is ``name``; None when no stage of this plan is."""
        for k in range(len(self.stages)):
            if self.stage_id(k) == name:
                return k
        return None

    def micro_batches_of(self, k: int) -> int:
        """Micro-batches stage k runs per optimizer step (its replica's share)."""
        return self.replica_of(k)[1].num_micro_batches

    def with_spans(self, spans: list[list[int]], recompute: list[list[str]]) -> Plan:
        """This plan with its stages holding other node spans (a rebalanced run): same devices, programs and
        input hash; the per-stage predictions are the compile's (the move's own are in its metrics line)."""
        if len(spans) != len(self.stages) or len(recompute) != len(self.stages):
            raise PlanError(f"a rebalance names {len(spans)} spans for {len(self.stages)} stages")
        stages = [dataclasses.replace(s, first_node=int(a), last_node=int(b), recompute_layers=list(r),
                                      node_names=[n.name for n in self.graph.nodes[int(a):int(b) + 1]])
                  for s, (a, b), r in zip(self.stages, spans, recompute, strict=True)]
        moved = dataclasses.replace(self, stages=stages)
        check_plan(moved, "a rebalance")
        return moved

    def to_json(self) -> str:
        data = to_dict(self)
        for host in data["cluster"]["hosts"]:
            if host.get("ssh") is None:
                del host["ssh"]  # hosts started by hand: plan.json as before ssh settings existed
        for stage in data["stages"]:
            if not stage["chunks"]:
                del stage["chunks"]  # one chunk per device: plan.json as before interleaved schedules
                if not stage["memory"]["chunk_gb_per_mb"] and not stage["memory"]["working_gb"]:
                    del stage["memory"]["chunk_gb_per_mb"], stage["memory"]["working_gb"]  # likewise
        return json.dumps(data, indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, data: Any, where: str = "plan.json", require_security: bool = True) -> Plan:
        """``require_security``: refuse a plan without its security section (the input hash does not cover it, so a
        plan that lost it would otherwise run with no authentication, by accident); `hetero keys` repairs one."""
        check_schema_version(data, where=where, what="plan", version=PLAN_SCHEMA_VERSION, error=PlanError,
                             fix=_RECOMPILE)
        if require_security and not has_security(data):
            raise PlanError(f"{where}: no 'security' section with a mode (removed by hand?): its processes would accept "
                            f"anyone; make keys with `hetero keys {where}` (and copy them to every host), or write "
                            "\"security\": {\"mode\": \"none\"} into it to run without authentication on purpose")
        if isinstance(data, dict) and isinstance(data.get("data"), dict) and "packing" not in data["data"]:
            data = {**data, "data": {**data["data"], "packing": False}}  # compiled before packing: padded rows, as run
        plan = from_dict(cls, data, where, PlanError)
        check_plan(plan, where)
        return plan

    @classmethod
    def load(cls, path: str | Path, require_security: bool = True) -> Plan:
        """Read and validate plan.json; every defect becomes a one-line PlanError."""
        p = Path(path)
        data = read_versioned_json(p, what="plan", version=PLAN_SCHEMA_VERSION, error=PlanError, fix=_RECOMPILE,
                                   missing_fix="run `hetero compile` first")
        plan = cls.from_dict(data, str(p), require_security)
        if plan.input_hash and plan.input_hash != compute_input_hash(plan):
            raise PlanError(f"{p}: input hash does not match its contents (edited by hand?); recompile it")
        return plan


def compute_input_hash(plan: Plan) -> str:
    """Hash of what decides the placement: model, fleet, graph, planner options, placement-bound train keys.

    Runtime-overridable training keys (lr, steps, ...) are left out, so overriding them at
    `hetero run` keeps the hash, and every peer can check it runs the same plan.
    """
    from hetero.specs import RUNTIME_OVERRIDABLE

    def canonical(cls: type, obj: Any) -> Any:
        # Round-trip through the schema so an int held in a float field (30 vs 30.0) hashes the
        # same before saving and after loading.
        return to_dict(from_dict(cls, to_dict(obj), cls.__name__, PlanError))

    train = {k: v for k, v in canonical(TrainSpec, plan.train).items() if k not in RUNTIME_OVERRIDABLE}
    planner = canonical(PlannerOptions, plan.planner)
    # Options at their defaults: plans from before each option keep their hash.
    for key, default in (("recompute", "auto"), ("replicas", None), ("offload", "auto"), ("compression", "none"),
                         ("interleave", "auto"), ("exclude", [])):
        if key in planner and planner[key] == default:
            del planner[key]
    cluster = canonical(ClusterSpec, plan.cluster)
    for host in cluster["hosts"]:
        del host["ssh"]  # how `hetero run` reaches a host is not placement (and may be added to plan.json)
        for key in ("cores", "usable_cores", "ram_gb"):  # unset: plans from before these keep their hash
            if host.get(key) is None:
                host.pop(key, None)
        for device in host["devices"]:
            if device.get("host_link_gbs") is None:
                device.pop("host_link_gbs", None)
    model = canonical(ModelSpec, plan.model)
    if model.get("attn_implementation") == "auto":
        del model["attn_implementation"]  # the default: plans from before the option keep their hash
    if model.get("experts_implementation") == "grouped":
        del model["experts_implementation"]  # likewise
    payload = {
        "model": model,
        "cluster": cluster,
        "planner": planner,
        "train": train,
        "graph_version": plan.graph.version,
        "stages": [(s.device, s.first_node, s.last_node, s.dtype, s.quantization, s.program)
                   + ((s.recompute_layers,) if s.recompute_layers else ())
                   + ((s.stream_layers,) if s.stream_layers else ())
                   + ((s.compress_out,) if s.compress_out != "none" else ())
                   + ((f"as {s.name}",) if s.name else ())
                   + ((s.spans(), [c.recompute_layers for c in s.chunks]) if s.chunks else ()) for s in plan.stages],
        "schema_version": plan.schema_version,
    }
    if plan.data.packing:  # the stages expect packed rows' positions (plans from before packing: rows of one record)
        payload["packing"] = True
    if plan.replicas:  # one-pipeline plans keep the hash they had before replicas existed
        payload["replicas"] = [(r.stages, r.num_micro_batches, r.first_micro_batch) for r in plan.replicas]
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]

