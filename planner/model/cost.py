"""The cost table: one planning problem's costs, evaluated once as dense arrays.

``build_cost_table`` evaluates a cost model (planner.model.cost_model: the interface and the datasheet
roofline; planner.model.profile_cost: a measured profile) for every (node, device) and every link of a
planning problem into a ``CostTable``: the exact DP, the ILP, the brute force, the baselines and the
manual split all read the very same numbers, and none of them calls back into the fleet or the cost
model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from hetero.errors import ConfigError
from hetero.graph import LayerGraph
from hetero.planner.model.cost_model import (
    CostModel,
    lora_tensors,
    wire_bytes_per_token,
    wire_values_per_token,
)
from hetero.planner.model.stream_costs import stream_columns
from hetero.planner.schedule.step_form import StepForm, step_form
from hetero.specs import ClusterSpec, DeviceSpec, ModelSpec, PlannerOptions, TrainSpec

if TYPE_CHECKING:
    from hetero.planner.model.link_costs import LinkCosts

GB = 1e9
SYNC_BYTES = 256.0  # a gradient-norm or clip message
GRAD_WIRE_BYTES_PER_PARAM = 4.0  # replicas reduce LoRA gradients in fp32
REDUCE_PROBE_BYTES = 64e6  # the message size at which a reduction's per-byte cost is measured
RECOMPUTE_MODES = ("auto", "none", "full")
COMPRESSION_MODES = ("none", "int8", "int4", "auto")
AUTO_SCHEME = "int8"  # what planner.compression=auto puts on a link it compresses


def in_flight(schedule: str, position_from_end: int, num_micro_batches: int) -> int:
    """Micro-batches whose activations a stage holds at its peak; position 0 is the last stage (the
    schedule's step form says: 1F1B holds min(position_from_end + 1, m), GPipe all m)."""
    return step_form(schedule).held(position_from_end, num_micro_batches)


def _rows(values: object) -> list[list[float]]:
    """A [row][column] list of floats from any nested sequence (numpy arrays included)."""
    return [[float(x) for x in row] for row in values]  # type: ignore[attr-defined]


@dataclass
class CostTable:
    """Every cost the planner needs, evaluated once as dense arrays: the solvers read nothing else.

    [node][device] arrays in seconds and bytes. Links are per [node][wire kind][sender host][receiver
    host]: a device sends the cut after a node in its wire kind (its compute dtype decides the bytes),
    so storage grows with hosts and dtypes, not with devices squared, and the cost model is still
    evaluated at the exact byte counts (a measured link need not be linear in bytes). A table can be
    built from random arrays (no fleet, no cost model): unset link, message and sync arrays are zero.
    """

    fwd_s: list[list[float]]
    bwd_s: list[list[float]]
    weights: list[list[float]]
    lora: list[list[float]]
    activations_per_mb: list[list[float]]
    usable_bytes: list[float]  # memory_gb * (1 - headroom), per device
    workspace_bytes: float
    schedule: str
    num_micro_batches: int
    tokens: int = 0  # per micro-batch (for tokens/s)
    model_dtype: str = "auto"
    # Where each device sits and what it sends: host index, wire kind index.
    host_of: list[int] = field(default_factory=list)
    wire_kind: list[int] = field(default_factory=list)
    wire_bytes: list[list[float]] = field(default_factory=list)  # [node][kind] bytes per micro-batch (information)
    link_s: list[list[list[list[float]]]] = field(default_factory=list)  # [node][kind][host a][host b] one way
    # CPU seconds a stage on [device] spends to send / receive one message across the cut after [node]
    # sized as [kind] sends it (gradients going back are costed at the same size).
    message_send_s: list[list[list[float]]] = field(default_factory=list)  # [node][kind][device]
    message_recv_s: list[list[list[float]]] = field(default_factory=list)  # [node][kind][device]
    # planner.compression=auto: [node][kind][host a][host b] whether link_s is the compressed hand-off's (AUTO_SCHEME,
    # its encode and decode included); empty otherwise.
    link_compress: list[list[list[list[bool]]]] = field(default_factory=list)
    # Where hand-offs between hosts may go either way (planner.compression auto or none, several hosts): every link
    # [node][kind][host a][host b] uncompressed, and with AUTO_SCHEME hand-offs as auto prices them; empty otherwise.
    link_plain_s: list[list[list[list[float]]]] = field(default_factory=list)
    link_squeezed_s: list[list[list[list[float]]]] = field(default_factory=list)
    sync_round_trip_s: list[list[float]] = field(default_factory=list)  # [host][coordinator's host]
    # Outside the layers (see CostModel.optimizer_step_s):
    opt_s: list[list[float]] = field(default_factory=list)  # [node][device] its share of the optimizer step
    opt_fixed_s: list[float] = field(default_factory=list)  # [device] the step's constant part
    # Activation recomputation (planner.recompute): per [node][device] what a recomputing node keeps
    # per micro-batch (its input; = activations_per_mb where it cannot recompute) and the backward
    # seconds it adds (one more forward); which nodes can; and the mode (auto | none | full).
    recompute_per_mb: list[list[float]] = field(default_factory=list)
    recompute_s: list[list[float]] = field(default_factory=list)
    recomputable: list[bool] = field(default_factory=list)
    recompute_mode: str = "none"
    # Data-parallel replicas (planner.replicas): the LoRA gradient bytes of each [node] as they cross the
    # wire (fp32), and the seconds per byte of a stage's gradients going to the coordinator and the sum
    # coming back, serialization included, per [host][coordinator's host]. Unset: zeros.
    grad_bytes: list[float] = field(default_factory=list)
    reduce_s_per_byte: list[list[float]] = field(default_factory=list)
    # Shared CPU cores: per [device] the cores its compute holds (a CPU stage's threads; 0: not a CPU), per
    # [host] its cores (0: not known). Unset: nobody shares (planner/schedule/simulator.py's CoreShare).
    core_need: list[int] = field(default_factory=list)
    host_cores: list[int] = field(default_factory=list)
    host_usable_cores: list[float] = field(default_factory=list)  # per [host]: measured by a run (0: all of them)
    # Weight streaming (planner.offload, planner/streaming.py): per [node][device] the frozen bytes a streamed
    # decoder layer keeps in host RAM and the seconds each copy of them adds (past what compute hides); per
    # [device] the seconds the first copy of a pass adds, one buffer slot's bytes and whether it may stream;
    # which nodes can; per [host] the RAM bytes for streamed weights (0: none). Unset: nothing streams.
    stream_bytes: list[list[float]] = field(default_factory=list)
    stream_fetch_s: list[list[float]] = field(default_factory=list)
    stream_start_s: list[float] = field(default_factory=list)
    stream_buffer: list[float] = field(default_factory=list)
    can_stream: list[bool] = field(default_factory=list)
    streamable: list[bool] = field(default_factory=list)
    stream_mode: str = "none"
    host_ram_bytes: list[float] = field(default_factory=list)
    # The fleet's devices, for names in plans and messages; solvers never read them (may be empty).
    devices: list[DeviceSpec] = field(default_factory=list)
    _prefix: dict[int, tuple[list[float], list[int], list[float]]] = field(
        default_factory=dict, repr=False, compare=False)
    _stream_prefix: dict[int, tuple[list[int], list[float], list[float]]] = field(
        default_factory=dict, repr=False, compare=False)
    _classes: list[int] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("fwd_s", "bwd_s", "weights", "lora", "activations_per_mb", "opt_s", "recompute_per_mb",
                     "recompute_s"):
            setattr(self, name, _rows(getattr(self, name)))
        self.usable_bytes = [float(x) for x in self.usable_bytes]
        self.opt_fixed_s = [float(x) for x in self.opt_fixed_s]
        self.recomputable = [bool(x) for x in self.recomputable]
        n, nd = len(self.fwd_s), len(self.usable_bytes)
        for name in ("fwd_s", "bwd_s", "weights", "lora", "activations_per_mb"):
            rows = getattr(self, name)
            if len(rows) != n or any(len(r) != nd for r in rows):
                raise ValueError(f"CostTable.{name} must be [{n} nodes][{nd} devices]")
        self.host_of = [int(h) for h in self.host_of] or [0] * nd
        self.wire_kind = [int(k) for k in self.wire_kind] or [0] * nd
        if len(self.host_of) != nd or len(self.wire_kind) != nd:
            raise ValueError("CostTable.host_of and wire_kind need one entry per device")
        hosts, kinds = max(self.host_of) + 1, max(self.wire_kind) + 1
        self.link_s = ([[_rows(hk) for hk in kinds_] for kinds_ in self.link_s] if len(self.link_s)
                       else [[[[0.0] * hosts for _ in range(hosts)] for _ in range(kinds)] for _ in range(n)])
        zeros = [[[0.0] * nd for _ in range(kinds)] for _ in range(n)]
        self.message_send_s = [_rows(r) for r in self.message_send_s] if len(self.message_send_s) else zeros
        self.message_recv_s = [_rows(r) for r in self.message_recv_s] if len(self.message_recv_s) else zeros
        self.sync_round_trip_s = (_rows(self.sync_round_trip_s) if len(self.sync_round_trip_s)
                                  else [[0.0] * hosts for _ in range(hosts)])
        if not self.recompute_per_mb:
            self.recompute_per_mb = [list(r) for r in self.activations_per_mb]
        if not self.recompute_s:
            self.recompute_s = [[0.0] * nd for _ in range(n)]
        if not self.recomputable:
            self.recomputable = [False] * n
        self.grad_bytes = [float(x) for x in self.grad_bytes] or [0.0] * n
        self.reduce_s_per_byte = (_rows(self.reduce_s_per_byte) if len(self.reduce_s_per_byte)
                                  else [[0.0] * hosts for _ in range(hosts)])
        self.core_need = [int(x) for x in self.core_need] or [0] * nd
        self.host_cores = [int(x) for x in self.host_cores] or [0] * hosts
        self.host_usable_cores = [float(x) for x in self.host_usable_cores] or [0.0] * len(self.host_cores)
        self._stream_defaults(n, nd, hosts)
        if len(self.core_need) != nd or len(self.host_cores) < hosts:
            raise ValueError("CostTable.core_need needs one entry per device and host_cores one per host")
        short = [(len(self.link_s), n), (len(self.message_send_s), n), (len(self.message_recv_s), n),
                 (len(self.recomputable), n), (len(self.sync_round_trip_s), hosts), (len(self.grad_bytes), n),
                 (len(self.reduce_s_per_byte), hosts), *((len(row), hosts) for row in self.reduce_s_per_byte),
                 *((len(per_kind), kinds) for per_kind in self.link_s + self.message_send_s + self.message_recv_s),
                 *((len(rows), hosts) for per_kind in self.link_s for rows in per_kind)]
        if any(have < need for have, need in short):
            raise ValueError("CostTable link/message/sync/recompute/reduce arrays do not match the nodes, kinds "
                             "and hosts")

    def _stream_defaults(self, n: int, nd: int, hosts: int) -> None:
        """Streaming arrays as floats, zeros where unset (nothing streams)."""
        self.stream_bytes = _rows(self.stream_bytes) if len(self.stream_bytes) else [[0.0] * nd for _ in range(n)]
        self.stream_fetch_s = (_rows(self.stream_fetch_s) if len(self.stream_fetch_s)
                               else [[0.0] * nd for _ in range(n)])
        self.stream_start_s = [float(x) for x in self.stream_start_s] or [0.0] * nd
        self.stream_buffer = [float(x) for x in self.stream_buffer] or [0.0] * nd
        self.can_stream = [bool(x) for x in self.can_stream] or [False] * nd
        self.streamable = [bool(x) for x in self.streamable] or [False] * n
        self.host_ram_bytes = [float(x) for x in self.host_ram_bytes] or [0.0] * hosts
        if (len(self.stream_bytes) != n or len(self.stream_fetch_s) != n or len(self.streamable) != n
                or any(len(x) != nd for x in (self.stream_start_s, self.stream_buffer, self.can_stream))):
            raise ValueError("CostTable streaming arrays do not match the nodes and devices")

    def stream_prefixes(self, d: int) -> tuple[list[int], list[float], list[float]]:
        """Device d's streaming prefix sums: streamable nodes before each node; bytes and copy seconds over the
        streamable nodes in order."""
        if d not in self._stream_prefix:
            srank, sbytes, sfetch = [0], [0.0], [0.0]
            for i in range(self.num_nodes):
                can = self.streamable[i]
                srank.append(srank[-1] + int(can))
                if can:
                    sbytes.append(sbytes[-1] + self.stream_bytes[i][d])
                    sfetch.append(sfetch[-1] + self.stream_fetch_s[i][d])
            self._stream_prefix[d] = (srank, sbytes, sfetch)
        return self._stream_prefix[d]

    def stream_choices(self, d: int, first: int, last: int, mode: str | None = None) -> list[int]:
        """How many streamed layers a stage of device d over nodes first..last may have under ``mode``."""
        mode = mode or self.stream_mode
        srank = self.stream_prefixes(d)[0]
        count = srank[last + 1] - srank[first]
        if mode == "none" or count == 0 or not self.can_stream[d]:
            return [0]
        if mode == "full":
            return [count]
        return list(range(count + 1))

    @property
    def form(self) -> StepForm:
        """The schedule's step algebra (planner/schedule/step_form.py): what the solvers read about it."""
        return step_form(self.schedule)

    @property
    def num_nodes(self) -> int:
        return len(self.fwd_s)

    @property
    def num_devices(self) -> int:
        return len(self.usable_bytes)

    def device_name(self, d: int) -> str:
        """``name (display name)`` of device d, or ``device d`` for a table without a fleet."""
        if d < len(self.devices):
            return f"{self.devices[d].name} ({self.devices[d].display_name})"
        return f"device {d}"

    def prefixes(self, d: int) -> tuple[list[float], list[int], list[float]]:
        """Device d's prefix sums: activations per node, recomputable nodes before each node, and
        what recomputing saves (activations - kept) over the recomputable nodes in order."""
        if d not in self._prefix:
            acts, rank, saved = [0.0], [0], [0.0]
            for i in range(self.num_nodes):
                acts.append(acts[-1] + self.activations_per_mb[i][d])
                can = self.recomputable[i]
                rank.append(rank[-1] + int(can))
                if can:
                    saved.append(saved[-1] + (self.activations_per_mb[i][d] - self.recompute_per_mb[i][d]))
            self._prefix[d] = (acts, rank, saved)
        return self._prefix[d]

    def recompute_choices(self, first: int, last: int, mode: str | None = None) -> list[int]:
        """How many recomputing layers a stage over nodes first..last may have under ``mode``."""
        mode = mode or self.recompute_mode
        _, rank, _ = self.prefixes(0)
        count = rank[last + 1] - rank[first]
        if mode == "none" or count == 0:
            return [0]
        if mode == "full":
            return [count]
        return list(range(count + 1))

    def transfer_s(self, node: int, sender: int, receiver: int) -> float:
        """Seconds to send the cut after ``node`` from device index ``sender`` to ``receiver``."""
        return self.link_s[node][self.wire_kind[sender]][self.host_of[sender]][self.host_of[receiver]]

    def priced_links(self, link_s: list[list[list[list[float]]]], compressed: bool = True) -> CostTable:
        """This table with other link times (``compressed``: keep which links auto compressed; else none is)."""
        return replace(self, link_s=link_s, link_compress=self.link_compress if compressed else [],
                       _prefix={}, _stream_prefix={}, _classes=[])

    def uncompressed(self) -> CostTable:
        """This table with every hand-off between hosts uncompressed (itself where none is priced compressed)."""
        return self.priced_links(self.link_plain_s, compressed=False) if self.link_compress else self

    def message_s(self, node: int, sender: int, device: int) -> tuple[float, float]:
        """(send, receive) CPU seconds on ``device`` for one message across the cut after ``node``
        (sized as ``sender`` sends it; gradients going back are costed at the same size)."""
        kind = self.wire_kind[sender]
        return self.message_send_s[node][kind][device], self.message_recv_s[node][kind][device]

    def sync_s(self, device: int, coordinator: int) -> float:
        """The step's gradient-norm round trip between ``device`` and the coordinator (on ``coordinator``'s host)."""
        return self.sync_round_trip_s[self.host_of[device]][self.host_of[coordinator]]

    def device_classes(self) -> list[int]:
        """Per device, its class: devices of one class are interchangeable (same host, memory, wire
        kind and every [node][device] column), numbered by first appearance."""
        if not self._classes:
            keys: dict[tuple, int] = {}  # type: ignore[type-arg]
            for d in range(self.num_devices):
                self._classes.append(keys.setdefault((self.host_of[d], *device_key(self, d)), len(keys)))
        return self._classes


def device_key(table: CostTable, d: int) -> tuple:  # type: ignore[type-arg]
    """What a device is to the solvers, its host aside: wire kind, memory, cores, streaming, and every [node][device]
    column. Devices with one key on one host are one class (CostTable.device_classes)."""
    rows = (table.fwd_s, table.bwd_s, table.weights, table.lora, table.activations_per_mb, table.recompute_per_mb,
            table.recompute_s, table.opt_s, table.stream_bytes, table.stream_fetch_s)
    messages = tuple(r[d] for per_node in (table.message_send_s, table.message_recv_s) for kinds in per_node for r in kinds)
    return (table.wire_kind[d], table.usable_bytes[d], table.core_need[d], table.stream_start_s[d],
            table.stream_buffer[d], table.can_stream[d], table.opt_fixed_s[d] if table.opt_fixed_s else 0.0,
            *(tuple(r[d] for r in t) for t in rows), messages)


def subtable(table: CostTable, num_micro_batches: int, devices: list[int] | None = None) -> CostTable:
    """The same problem with ``num_micro_batches`` per step on ``devices`` only (in that order; default:
    all): what one pipeline replica solves. Hosts and wire kinds keep their indices."""
    keep = list(range(table.num_devices)) if devices is None else list(devices)

    def cols(rows: list[list[float]]) -> list[list[float]]:
        return [[row[d] for d in keep] for row in rows]

    return dataclasses.replace(
        table, num_micro_batches=num_micro_batches,
        fwd_s=cols(table.fwd_s), bwd_s=cols(table.bwd_s), weights=cols(table.weights), lora=cols(table.lora),
        activations_per_mb=cols(table.activations_per_mb), usable_bytes=[table.usable_bytes[d] for d in keep],
        host_of=[table.host_of[d] for d in keep], wire_kind=[table.wire_kind[d] for d in keep],
        core_need=[table.core_need[d] for d in keep],
        message_send_s=[cols(per_kind) for per_kind in table.message_send_s],
        message_recv_s=[cols(per_kind) for per_kind in table.message_recv_s],
        opt_s=cols(table.opt_s) if table.opt_s else [],
        opt_fixed_s=[table.opt_fixed_s[d] for d in keep] if table.opt_fixed_s else [],
        recompute_per_mb=cols(table.recompute_per_mb), recompute_s=cols(table.recompute_s),
        stream_bytes=cols(table.stream_bytes), stream_fetch_s=cols(table.stream_fetch_s),
        stream_start_s=[table.stream_start_s[d] for d in keep], stream_buffer=[table.stream_buffer[d] for d in keep],
        can_stream=[table.can_stream[d] for d in keep],
        devices=[table.devices[d] for d in keep] if table.devices else [],
        _prefix={}, _classes=[], _stream_prefix={})


def _check_problem(graph: LayerGraph, cluster: ClusterSpec, train: TrainSpec, options: PlannerOptions) -> None:
    """A clear error for an empty fleet or graph and for out-of-range options."""
    if not cluster.devices:
        raise ConfigError(f"fleet '{cluster.name}' has no devices")
    if not graph.nodes:
        raise ConfigError(f"layer graph of '{graph.model_name}' has no nodes")
    if train.micro_batch_size < 1 or train.num_micro_batches < 1:
        raise ConfigError("train.micro_batch_size and train.num_micro_batches must be at least 1")
    if not 0.0 <= options.memory_headroom < 1.0:
        raise ConfigError(f"planner.memory_headroom must be in [0, 1), got {options.memory_headroom}")
    if options.recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"planner.recompute={options.recompute!r}: choose one of {', '.join(RECOMPUTE_MODES)}")
    if options.offload not in RECOMPUTE_MODES:
        raise ConfigError(f"planner.offload={options.offload!r}: choose one of {', '.join(RECOMPUTE_MODES)}")
    if options.compression not in COMPRESSION_MODES:
        raise ConfigError(f"planner.compression={options.compression!r}: choose one of {', '.join(COMPRESSION_MODES)}")


@dataclass
class _NodeCosts:
    """The [node][device] compute and memory columns of a CostTable, and which nodes can recompute."""

    fwd: list[list[float]] = field(default_factory=list)
    bwd: list[list[float]] = field(default_factory=list)
    weights: list[list[float]] = field(default_factory=list)
    lora: list[list[float]] = field(default_factory=list)
    activations: list[list[float]] = field(default_factory=list)
    recompute_per_mb: list[list[float]] = field(default_factory=list)
    recompute_s: list[list[float]] = field(default_factory=list)
    recomputable: list[bool] = field(default_factory=list)


def _node_costs(graph: LayerGraph, model: ModelSpec, devices: list[DeviceSpec], cost_model: CostModel,
                tokens: int) -> _NodeCosts:
    """Every node's times and memory on every device, and what recomputing it keeps and costs."""
    out = _NodeCosts()
    for i in range(len(graph.nodes)):
        times = [cost_model.node_time_s(graph, model, i, d, tokens) for d in devices]
        mems = [cost_model.node_memory(graph, model, i, d, tokens) for d in devices]
        out.fwd.append([t[0] for t in times])
        out.bwd.append([t[1] for t in times])
        out.weights.append([m.weights for m in mems])
        out.lora.append([m.lora for m in mems])
        out.activations.append([m.activations_per_mb for m in mems])
        # A layer recomputes only if the graph says what it keeps and that is less than it saves.
        can = graph.nodes[i].kind == "decoder" and all(
            m.recompute_per_mb is not None and m.recompute_per_mb < m.activations_per_mb for m in mems)
        out.recomputable.append(can)
        out.recompute_per_mb.append([m.recompute_per_mb if can and m.recompute_per_mb is not None
                                     else m.activations_per_mb for m in mems])
        out.recompute_s.append([t[0] if can else 0.0 for t in times])
    return out


def _optimizer_costs(graph: LayerGraph, model: ModelSpec, devices: list[DeviceSpec],
                     cost_model: CostModel) -> tuple[list[float], list[list[float]]]:
    """The optimizer step's constant part per [device] and each [node][device]'s share of the rest."""
    opt_fixed = [cost_model.optimizer_step_s(d, model, 0, 0) for d in devices]
    opt = [[cost_model.optimizer_step_s(d, model, graph.nodes[i].lora_params, lora_tensors(graph, model, i))
            - opt_fixed[j] for j, d in enumerate(devices)] for i in range(len(graph.nodes))]
    return opt_fixed, opt


def _wire_kinds(graph: LayerGraph, model: ModelSpec, devices: list[DeviceSpec], tokens: int,
                compression: str = "none") -> tuple[list[int], list[list[float]]]:
    """One wire kind per distinct bytes-per-cut column (a dtype, or the compression scheme): the kind per device,
    [node][kind] bytes."""
    n_nodes = len(graph.nodes)
    kinds: dict[tuple[float, ...], int] = {}
    wire_kind = [kinds.setdefault(tuple(wire_bytes_per_token(graph, i, d, model, compression) * tokens
                                        for i in range(n_nodes)), len(kinds)) for d in devices]
    return wire_kind, [[k[i] for k in kinds] for i in range(n_nodes)]


def training_fleet(cluster: ClusterSpec, *left_out: str | None) -> ClusterSpec:
    """The fleet less the devices that do not train: the evaluation device and planner.exclude's."""
    if not (out := set(left_out) - {None}):
        return cluster
    return dataclasses.replace(cluster, hosts=[dataclasses.replace(h, devices=[d for d in h.devices if d.name not in out])
                                               for h in cluster.hosts])


def _link_table(graph: LayerGraph, model: ModelSpec, cluster: ClusterSpec, tokens: int, compression: str,
                cost_model: CostModel) -> tuple[list[int], list[list[float]], LinkCosts]:
    """Each device's wire kind, each kind's bytes per cut, and the links' costs (planner/model/link_costs.py LinkCosts)
    under planner.compression."""
    from hetero.planner.model.link_costs import auto_inputs, link_costs  # (it reads this module's constants)

    devices = cluster.devices
    fixed = compression if compression != "auto" else "none"  # one scheme on every link
    wire_kind, kind_bytes = _wire_kinds(graph, model, devices, tokens, fixed)
    codec = [[cost_model.codec_s(d, fixed, wire_values_per_token(graph, i) * tokens) for d in devices]
             for i in range(len(graph.nodes))] if fixed != "none" else None
    # Every link between hosts is priced compressed beside plain where hand-offs may go either way (the plan's per-link
    # advice, planner/explain/compress_advice.py); auto takes the faster per link.
    weighed = compression in ("auto", "none") and len(cluster.hosts) > 1
    sources = getattr(cost_model, "sources", None)  # a profile's record of what it priced (plan.cost_sources)
    cited = set(sources) if isinstance(sources, dict) else set()
    links = link_costs(cluster, cost_model, [h.name for h in cluster.hosts], kind_bytes, codec,
                       auto_inputs(graph, cluster, tokens, cost_model) if weighed else None, auto=compression == "auto")
    if compression == "none" and isinstance(sources, dict):  # the codec priced only for the verdict's per-link lines
        for key in [k for k in sources if k.startswith("codec ") and k not in cited]:
            del sources[key]
    return wire_kind, kind_bytes, links


def build_cost_table(
    graph: LayerGraph,
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    options: PlannerOptions,
    cost_model: CostModel,
) -> CostTable:
    """Evaluate ``cost_model`` for every (node, device) of the fleet and every link the solvers may use."""
    _check_problem(graph, cluster, train, options)
    devices = cluster.devices
    tokens = train.micro_batch_size * graph.seq_len
    nodes = _node_costs(graph, model, devices, cost_model, tokens)
    opt_fixed, opt = _optimizer_costs(graph, model, devices, cost_model)
    hosts = [h.name for h in cluster.hosts]
    wire_kind, kind_bytes, links = _link_table(graph, model, cluster, tokens, options.compression, cost_model)
    stream = stream_columns(graph, model, cluster, nodes.fwd, options.offload, cost_model)
    return CostTable(
        fwd_s=nodes.fwd, bwd_s=nodes.bwd, weights=nodes.weights, lora=nodes.lora,
        activations_per_mb=nodes.activations,
        usable_bytes=[d.memory_gb * (1.0 - options.memory_headroom) * GB for d in devices],
        workspace_bytes=options.workspace_gb * GB,
        schedule=train.schedule,
        num_micro_batches=train.num_micro_batches,
        tokens=tokens,
        model_dtype=model.dtype,
        host_of=[hosts.index(d.host) for d in devices],
        wire_kind=wire_kind,
        wire_bytes=kind_bytes,
        link_s=links.link_s,
        message_send_s=links.message_send_s,
        message_recv_s=links.message_recv_s,
        link_compress=links.link_compress,
        link_plain_s=links.link_plain_s,
        link_squeezed_s=links.link_squeezed_s,
        sync_round_trip_s=links.sync_round_trip_s,
        opt_s=opt,
        opt_fixed_s=opt_fixed,
        recompute_per_mb=nodes.recompute_per_mb,
        recompute_s=nodes.recompute_s,
        recomputable=nodes.recomputable,
        recompute_mode=options.recompute,
        grad_bytes=[GRAD_WIRE_BYTES_PER_PARAM * n.lora_params for n in graph.nodes],
        reduce_s_per_byte=links.reduce_s_per_byte,
        core_need=[(d.threads or 1) if d.backend == "cpu" else 0 for d in devices],
        host_cores=[h.cores or 0 for h in cluster.hosts],
        host_usable_cores=[h.usable_cores or 0.0 for h in cluster.hosts],
        stream_bytes=stream.bytes, stream_fetch_s=stream.fetch_s, stream_start_s=stream.start_s,
        stream_buffer=stream.buffer, can_stream=stream.can_stream, streamable=stream.streamable,
        stream_mode=options.offload, host_ram_bytes=stream.ram_bytes,
        devices=devices,
    )


def link_scheme(table: CostTable, compression: str, node: int, sender: int, receiver: int) -> str:
    """What the hand-off across the cut after ``node`` from device ``sender`` to ``receiver`` carries:
    planner.compression's scheme, or under auto the scheme where the table priced that link compressed
    (planner/model/link_costs.py ``_auto_links``). One chunk per device and interleaved chunks alike."""
    if compression != "auto":
        return compression
    if not table.link_compress:
        return "none"
    kind, host = table.wire_kind[sender], table.host_of
    return AUTO_SCHEME if table.link_compress[node][kind][host[sender]][host[receiver]] else "none"
