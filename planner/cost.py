"""Cost models: per (node, device) compute time and memory, per (host, host) transfer time.

``CostModel`` is the interface; ``RooflineCostModel`` fills it from datasheet numbers and
``planner.profile_cost.ProfileCostModel`` from a measured profile (``hetero profile``). ``CostTable``
evaluates a cost model once for every (node, device) of a planning problem, so the ILP, the brute
force, the baselines and the manual split all read the very same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from hetero.errors import ConfigError
from hetero.graph import LayerGraph
from hetero.specs import (
    BYTES_PER_DTYPE,
    QUANT_BYTES_PER_PARAM,
    ClusterSpec,
    DeviceSpec,
    ModelSpec,
    PlannerOptions,
    TrainSpec,
)

NF4_BYTES_PER_PARAM = QUANT_BYTES_PER_PARAM["nf4"]
# LoRA parameters train in fp32: the parameter, its gradient and AdamW's two moments.
LORA_BYTES_PER_PARAM = 16.0
GB = 1e9
# Rough datasheet-path figures for what a stage pays outside its layers (a profile measures them):
# AdamW touches ~32 bytes per fp32 LoRA parameter (param, grad, two moments; the grad norm reads
# the grad again); every LoRA tensor costs a few ops of Python/launch overhead per step, far more
# on CPU (one tensor at a time) than on GPUs (multi-tensor kernels). A message costs its Python
# encode/decode plus, from or to a GPU, a copy over the host link.
OPTIMIZER_BYTES_PER_PARAM = 32.0
OPTIMIZER_PER_TENSOR_S = {"cpu": 50e-6}
OPTIMIZER_PER_TENSOR_DEFAULT_S = 10e-6
MESSAGE_FIXED_S = 100e-6
HOST_COPY_BYTES_PER_S = 12e9  # PCIe 4.0 x16 in practice
SYNC_BYTES = 256.0  # a gradient-norm or clip message
RECOMPUTE_MODES = ("auto", "none", "full")


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of a dtype name; "auto" graphs are costed at 2 bytes (bf16/fp16)."""
    if dtype == "auto":
        return 2.0
    try:
        return BYTES_PER_DTYPE[dtype]
    except KeyError:
        raise ConfigError(f"unknown dtype '{dtype}': use float32, bfloat16 or float16") from None


@dataclass(frozen=True)
class NodeMemory:
    """Bytes one node needs on one device."""

    weights: float  # frozen base weights, at the device's dtype and quantization
    lora: float  # LoRA params + grads + AdamW moments (fp32)
    activations_per_mb: float  # saved for backward, per micro-batch in flight
    # What the node keeps per micro-batch in flight when it recomputes (its input); None: it cannot.
    recompute_per_mb: float | None = None


class CostModel(Protocol):
    """What the planner asks of a cost model; a measured profile can replace the roofline."""

    def node_time_s(
        self, graph: LayerGraph, model: ModelSpec, node: int, device: DeviceSpec, tokens: int
    ) -> tuple[float, float]:
        """(forward, backward) seconds of node ``node`` on ``device`` for a micro-batch of ``tokens``."""
        ...

    def node_memory(
        self, graph: LayerGraph, model: ModelSpec, node: int, device: DeviceSpec, tokens: int
    ) -> NodeMemory:
        """Bytes node ``node`` needs on ``device`` with micro-batches of ``tokens`` tokens."""
        ...

    def transfer_time_s(self, cluster: ClusterSpec, host_a: str, host_b: str, num_bytes: float) -> float:
        """Seconds to move ``num_bytes`` from a device on ``host_a`` to one on ``host_b``."""
        ...

    def optimizer_step_s(self, device: DeviceSpec, model: ModelSpec, lora_params: int, lora_tensors: int) -> float:
        """Seconds of one optimizer step (grad norm, AdamW, zero_grad) over this much LoRA on ``device``.

        Must be linear in (lora_params, lora_tensors): the planner splits it into a per-stage constant
        (the value at 0, 0) and per-node parts.
        """
        ...

    def message_s(self, device: DeviceSpec, num_bytes: float) -> tuple[float, float]:
        """(send, receive) seconds ``device``'s stage spends on one message of ``num_bytes``."""
        ...


def compute_dtype(device: DeviceSpec, model: ModelSpec) -> str:
    """The dtype ``device`` computes (and sends) in for this model."""
    return device.compute_dtype(model.dtype)


def weight_bytes(graph: LayerGraph, node: int, device: DeviceSpec, model: ModelSpec) -> float:
    """Frozen weight bytes of a node on a device: linear weights quantized, the rest at compute dtype."""
    n = graph.nodes[node]
    elem = dtype_bytes(compute_dtype(device, model))
    quant = device.quantization(model.quantization)
    per_linear = QUANT_BYTES_PER_PARAM.get(quant, elem)
    return (n.num_params - n.linear_params) * elem + n.linear_params * per_linear


def wire_bytes_per_token(graph: LayerGraph, node: int, device: DeviceSpec, model: ModelSpec) -> float:
    """Bytes per token sent across the cut after ``node`` by a stage on ``device`` (its compute dtype)."""
    if node >= len(graph.edges):
        return 0.0
    scale = dtype_bytes(compute_dtype(device, model)) / dtype_bytes(graph.dtype)
    return graph.edges[node].bytes_per_token * scale


class RooflineCostModel:
    """time = max(FLOPs / (datasheet TFLOPS x efficiency), bytes touched / memory bandwidth)."""

    def __init__(self, efficiency: float = 0.4) -> None:
        if not 0.0 < efficiency <= 1.0:
            raise ConfigError(f"planner.efficiency must be in (0, 1], got {efficiency}")
        self.efficiency = efficiency

    def _flops_per_s(self, device: DeviceSpec, dtype: str) -> float:
        tflops = device.tflops.get(dtype, 0.0) or device.tflops.get("float32", 0.0)
        if tflops <= 0:
            raise ConfigError(f"device '{device.name}' has no TFLOPS figure for {dtype}: fix its hardware spec")
        return tflops * 1e12 * self.efficiency

    def node_time_s(
        self, graph: LayerGraph, model: ModelSpec, node: int, device: DeviceSpec, tokens: int
    ) -> tuple[float, float]:
        """(forward, backward) seconds of one node for one micro-batch (roofline)."""
        n = graph.nodes[node]
        dtype = compute_dtype(device, model)
        flops_per_s = self._flops_per_s(device, dtype)
        bandwidth = device.memory_bandwidth_gbs * 1e9
        if bandwidth <= 0:
            raise ConfigError(f"device '{device.name}' has no memory bandwidth: fix its hardware spec")
        weights = weight_bytes(graph, node, device, model)
        act = n.activation_bytes_per_token * tokens * dtype_bytes(dtype) / dtype_bytes(graph.dtype)
        # Forward reads the weights once and writes the saved activations; backward reads the
        # weights again (input grads) and reads the saved activations while writing their grads.
        fwd = max(n.fwd_flops_per_token * tokens / flops_per_s, (weights + act) / bandwidth)
        bwd = max(n.bwd_flops_per_token * tokens / flops_per_s, (weights + 2 * act) / bandwidth)
        return fwd, bwd

    def node_memory(
        self, graph: LayerGraph, model: ModelSpec, node: int, device: DeviceSpec, tokens: int
    ) -> NodeMemory:
        """Weights at the device's dtype/quantization, fp32 LoRA state, activations per micro-batch."""
        n = graph.nodes[node]
        scale = dtype_bytes(compute_dtype(device, model)) / dtype_bytes(graph.dtype)
        rec = n.recompute_bytes_per_token
        return NodeMemory(
            weights=weight_bytes(graph, node, device, model),
            lora=n.lora_params * LORA_BYTES_PER_PARAM,
            activations_per_mb=n.activation_bytes_per_token * tokens * scale,
            recompute_per_mb=None if rec is None else rec * tokens * scale,
        )

    def transfer_time_s(self, cluster: ClusterSpec, host_a: str, host_b: str, num_bytes: float) -> float:
        """Bytes over the link's bandwidth plus its latency."""
        try:
            link = cluster.link(host_a, host_b)
        except KeyError as exc:
            raise ConfigError(f"fleet '{cluster.name}': {exc.args[0]}; add it under links:") from None
        return num_bytes / link.bytes_per_s + link.latency_us * 1e-6

    def optimizer_step_s(self, device: DeviceSpec, model: ModelSpec, lora_params: int, lora_tensors: int) -> float:
        """Per-tensor overhead plus the bytes AdamW touches over the device's memory bandwidth."""
        per_tensor = OPTIMIZER_PER_TENSOR_S.get(device.backend, OPTIMIZER_PER_TENSOR_DEFAULT_S)
        bandwidth = max(device.memory_bandwidth_gbs, 1e-3) * 1e9
        return lora_tensors * per_tensor + lora_params * OPTIMIZER_BYTES_PER_PARAM / bandwidth

    def message_s(self, device: DeviceSpec, num_bytes: float) -> tuple[float, float]:
        """Encode/decode overhead, plus the copy between a GPU and its host."""
        cost = MESSAGE_FIXED_S + (num_bytes / HOST_COPY_BYTES_PER_S if device.backend != "cpu" else 0.0)
        return cost, cost


def lora_tensors(graph: LayerGraph, model: ModelSpec, node: int) -> int:
    """LoRA tensors (A and B per adapted linear) of a node: every target in a decoder layer, else one linear."""
    n = graph.nodes[node]
    if n.lora_params <= 0:
        return 0
    return 2 * max(1, len(model.lora.target_modules)) if n.kind == "decoder" else 2


def in_flight(schedule: str, position_from_end: int, num_micro_batches: int) -> int:
    """Micro-batches whose activations a stage holds at its peak; position 0 is the last stage.

    1F1B: stage k of S holds min(S - k, m), i.e. min(position_from_end + 1, m). GPipe: all m.
    """
    if schedule == "gpipe":
        return num_micro_batches
    return min(position_from_end + 1, num_micro_batches)


@dataclass
class CostTable:
    """Every cost the planner needs, evaluated once: [node][device] arrays in seconds and bytes."""

    devices: list[DeviceSpec]
    fwd_s: list[list[float]]
    bwd_s: list[list[float]]
    weights: list[list[float]]
    lora: list[list[float]]
    activations_per_mb: list[list[float]]
    wire_bytes: list[list[float]]  # per micro-batch, across the cut after node i, from device d
    usable_bytes: list[float]  # memory_gb * (1 - headroom), per device
    workspace_bytes: float
    tokens: int
    schedule: str
    num_micro_batches: int
    cluster: ClusterSpec
    cost_model: CostModel
    model_dtype: str = "auto"
    # Outside the layers (see CostModel.optimizer_step_s / message_s):
    opt_s: list[list[float]] = field(default_factory=list)  # [node][device] its share of the optimizer step
    opt_fixed_s: list[float] = field(default_factory=list)  # [device] the step's constant part
    # Activation recomputation (planner.recompute): per [node][device] what a recomputing node keeps
    # per micro-batch (its input; = activations_per_mb where it cannot recompute) and the backward
    # seconds it adds (one more forward); which nodes can; and the mode (auto | none | full).
    recompute_per_mb: list[list[float]] = field(default_factory=list)
    recompute_s: list[list[float]] = field(default_factory=list)
    recomputable: list[bool] = field(default_factory=list)
    recompute_mode: str = "none"
    _prefix: dict[int, tuple[list[float], list[int], list[float]]] = field(
        default_factory=dict, repr=False, compare=False)

    @property
    def num_nodes(self) -> int:
        return len(self.fwd_s)

    def prefixes(self, d: int) -> tuple[list[float], list[int], list[float]]:
        """Device d's prefix sums: activations per node, recomputable nodes before each node, and
        what recomputing saves (activations - kept) over the recomputable nodes in order."""
        if d not in self._prefix:
            acts, rank, saved = [0.0], [0], [0.0]
            for i in range(self.num_nodes):
                acts.append(acts[-1] + self.activations_per_mb[i][d])
                can = bool(self.recomputable) and self.recomputable[i]
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
        a, b = self.devices[sender], self.devices[receiver]
        return self.cost_model.transfer_time_s(self.cluster, a.host, b.host, self.wire_bytes[node][sender])

    def message_s(self, node: int, sender: int, device: int) -> tuple[float, float]:
        """(send, receive) CPU seconds on ``device`` for one message across the cut after ``node``
        (sized as ``sender`` sends it; gradients going back are costed at the same size)."""
        send, recv = self.cost_model.message_s(self.devices[device], self.wire_bytes[node][sender])
        return float(send), float(recv)

    def sync_s(self, device: int, coordinator: int) -> float:
        """The step's gradient-norm round trip between ``device`` and the coordinator (on ``coordinator``'s host)."""
        a, b = self.devices[device].host, self.devices[coordinator].host
        return 2.0 * self.cost_model.transfer_time_s(self.cluster, a, b, SYNC_BYTES)


def build_cost_table(
    graph: LayerGraph,
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    options: PlannerOptions,
    cost_model: CostModel,
) -> CostTable:
    """Evaluate ``cost_model`` for every (node, device) of the fleet."""
    devices = cluster.devices
    if not devices:
        raise ConfigError(f"fleet '{cluster.name}' has no devices")
    if not graph.nodes:
        raise ConfigError(f"layer graph of '{graph.model_name}' has no nodes")
    if train.micro_batch_size < 1 or train.num_micro_batches < 1:
        raise ConfigError("train.micro_batch_size and train.num_micro_batches must be at least 1")
    if not 0.0 <= options.memory_headroom < 1.0:
        raise ConfigError(f"planner.memory_headroom must be in [0, 1), got {options.memory_headroom}")
    if options.recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"planner.recompute={options.recompute!r}: choose one of {', '.join(RECOMPUTE_MODES)}")
    tokens = train.micro_batch_size * graph.seq_len
    n_nodes = len(graph.nodes)
    fwd, bwd, w, lo, act, wire, rec, rec_s = ([], [], [], [], [], [], [], [])
    recomputable = []
    for i in range(n_nodes):
        times = [cost_model.node_time_s(graph, model, i, d, tokens) for d in devices]
        mems = [cost_model.node_memory(graph, model, i, d, tokens) for d in devices]
        fwd.append([t[0] for t in times])
        bwd.append([t[1] for t in times])
        w.append([m.weights for m in mems])
        lo.append([m.lora for m in mems])
        act.append([m.activations_per_mb for m in mems])
        wire.append([wire_bytes_per_token(graph, i, d, model) * tokens for d in devices])
        # A layer recomputes only if the graph says what it keeps and that is less than it saves.
        can = graph.nodes[i].kind == "decoder" and all(
            m.recompute_per_mb is not None and m.recompute_per_mb < m.activations_per_mb for m in mems)
        recomputable.append(can)
        rec.append([m.recompute_per_mb if can and m.recompute_per_mb is not None else m.activations_per_mb
                    for m in mems])
        rec_s.append([t[0] if can else 0.0 for t in times])
    opt_fixed = [cost_model.optimizer_step_s(d, model, 0, 0) for d in devices]
    opt = [[cost_model.optimizer_step_s(d, model, graph.nodes[i].lora_params, lora_tensors(graph, model, i)) - opt_fixed[j]
            for j, d in enumerate(devices)] for i in range(n_nodes)]
    return CostTable(
        devices=devices,
        fwd_s=fwd,
        bwd_s=bwd,
        weights=w,
        lora=lo,
        activations_per_mb=act,
        wire_bytes=wire,
        usable_bytes=[d.memory_gb * (1.0 - options.memory_headroom) * GB for d in devices],
        workspace_bytes=options.workspace_gb * GB,
        tokens=tokens,
        schedule=train.schedule,
        num_micro_batches=train.num_micro_batches,
        cluster=cluster,
        cost_model=cost_model,
        model_dtype=model.dtype,
        opt_s=opt,
        opt_fixed_s=opt_fixed,
        recompute_per_mb=rec,
        recompute_s=rec_s,
        recomputable=recomputable,
        recompute_mode=options.recompute,
    )
