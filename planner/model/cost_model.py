"""Cost models: per (node, device) compute time and memory, per (host, host) transfer time.

``CostModel`` is the interface the planner asks; ``RooflineCostModel`` answers it from datasheet
numbers and ``planner.model.profile_cost.ProfileCostModel`` from a measured profile (``hetero profile``).
planner.model.cost evaluates one once per planning problem into a dense ``CostTable``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from hetero.errors import ConfigError
from hetero.graph import LayerGraph
from hetero.specs import BYTES_PER_DTYPE, QUANT_BYTES_PER_PARAM, ClusterSpec, DeviceSpec, ModelSpec

NF4_BYTES_PER_PARAM = QUANT_BYTES_PER_PARAM["nf4"]
# LoRA parameters train in fp32: the parameter, its gradient and AdamW's two moments.
LORA_BYTES_PER_PARAM = 16.0
# Rough datasheet-path figures for what a stage pays outside its layers (a profile measures them):
# AdamW touches ~32 bytes per fp32 LoRA parameter (param, grad, two moments; the grad norm reads
# the grad again); every LoRA tensor costs a few ops of Python/launch overhead per step, far more
# on CPU (one tensor at a time) than on GPUs (multi-tensor kernels). A message costs its Python
# encode/decode plus, from or to a GPU, a copy over the host link.
OPTIMIZER_BYTES_PER_PARAM = 32.0
OPTIMIZER_PER_TENSOR_S = {"cpu": 50e-6}
OPTIMIZER_PER_TENSOR_DEFAULT_S = 10e-6
MESSAGE_FIXED_S = 100e-6
# Compressed hand-offs (planner.compression, runtime/wire/compress.py): bytes of memory traffic per value that
# encoding (sender) and decoding (receiver) cost, as time = values x bytes / the device's memory bandwidth. Fitted to
# bench/bench_compress.py on fp32 W1 hand-offs, one CPU thread of the 2-vCPU sandbox (51.2 GB/s datasheet),
# 2026-11-28: encode int8 7.5 ns a value, decode 0.7; int4 18 and 13 (the 64 x 64 rotation).
CODEC_BYTES_PER_VALUE = {"int8": (384.0, 36.0), "int4": (920.0, 670.0)}  # (encode, decode)
# What a value costs on the wire: its level (1 byte, or half of one) and its share of a float32 scale per 64 values.
WIRE_BYTES_PER_VALUE = {"int8": 1.0 + 4.0 / 64, "int4": 0.5 + 4.0 / 64}
# CurveZMQ (security=curve, the default off loopback) encrypts each message whole in the sender's ZeroMQ I/O thread and
# decrypts it whole in the receiver's: under it a hand-off takes its transfer plus its bytes at this rate (both ends'
# work, one after the other). Measured with bench/bench_cipher.py on the 2-vCPU sandbox (pyzmq 27.3, libzmq 4.3.5),
# 2026-11-29: 0.41-0.42 GB/s for 0.5 MiB messages (two runs), 0.34 at 16 MiB (an 8B model's bf16 hand-off of 2,048
# tokens), 0.29 at 32 MiB. A `hetero profile` measures each link under the mode the plan uses, the cipher included; this prices the
# links it did not measure.
CURVE_BYTES_PER_S = 0.35e9
HOST_COPY_BYTES_PER_S = 12e9  # PCIe 4.0 x16 in practice
# Pinned host-to-device copies reach about 80% of PCIe's theoretical rate (CUDA's bandwidthTest on
# PCIe 4.0 x16: ~25 of 31.5 GB/s); datasheets and fleet files state the theoretical rate.
HOST_LINK_EFFICIENCY = 0.8
# Quantized linears are not faster than dense ones in training: bitsandbytes dequantizes the weight to
# the compute dtype on every use. MatMul4Bit's forward is `linear(A, dequantize_4bit(W))` and its
# backward dequantizes W again for the input gradient (bitsandbytes/autograd/_functions.py);
# MatMul8bitLt's backward likewise rebuilds the 16-bit weight (CB * SCB / 127), and its forward's
# int8 matmul is credited no speed-up here. So a quantized linear costs the dense one (its matmul
# reads the dequantized weight) plus, in forward and again in backward, one memory-bound pass that
# reads the quantized bytes and writes the compute-dtype weight: DEQUANT_PASSES passes of
# (quantized + compute-dtype bytes) per linear parameter over the datasheet memory bandwidth. A
# profile or a run measures the quantized layer itself (dequantization included) and replaces this.
DEQUANT_PASSES = {"fwd": 1, "bwd": 1}


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

    def codec_s(self, device: DeviceSpec, compression: str, values: float) -> tuple[float, float]:
        """(encode, decode) seconds of a compressed hand-off of ``values`` values on ``device`` (0 for none)."""
        ...

    def host_copy_bytes_per_s(self, device: DeviceSpec) -> float:
        """Bytes per second at which a streamed layer's frozen weights reach ``device`` from host RAM."""
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


def expert_weight_bytes(graph: LayerGraph, node: int, device: DeviceSpec, model: ModelSpec) -> float:
    """Of weight_bytes, a node's mixture-of-experts weights (quantized as its Linear weights are)."""
    elem = dtype_bytes(compute_dtype(device, model))
    quant = device.quantization(model.quantization)
    return graph.nodes[node].expert_params * QUANT_BYTES_PER_PARAM.get(quant, elem)


def dense_weight_bytes(graph: LayerGraph, node: int, dtype: str) -> float:
    """Weight bytes of a node with every parameter at ``dtype`` (what a dequantized matmul reads)."""
    return graph.nodes[node].num_params * dtype_bytes(dtype)


def dequant_s(graph: LayerGraph, node: int, device: DeviceSpec, model: ModelSpec) -> float:
    """Seconds of one dequantization pass over a node's quantized linear weights on ``device`` (0: not
    quantized there): read the quantized bytes, write the compute-dtype weight, at the datasheet bandwidth."""
    quant = device.quantization(model.quantization)
    if quant not in QUANT_BYTES_PER_PARAM:
        return 0.0
    per_param = QUANT_BYTES_PER_PARAM[quant] + dtype_bytes(compute_dtype(device, model))
    return graph.nodes[node].linear_params * per_param / (max(device.memory_bandwidth_gbs, 1e-3) * 1e9)


def wire_bytes_per_token(graph: LayerGraph, node: int, device: DeviceSpec, model: ModelSpec,
                         compression: str = "none") -> float:
    """Bytes per token sent across the cut after ``node`` by a stage on ``device`` (its compute dtype, or the
    ``compression`` scheme's levels and scales)."""
    if node >= len(graph.edges):
        return 0.0
    if compression != "none":
        return wire_values_per_token(graph, node) * WIRE_BYTES_PER_VALUE[compression]
    scale = dtype_bytes(compute_dtype(device, model)) / dtype_bytes(graph.dtype)
    return graph.edges[node].bytes_per_token * scale


def wire_values_per_token(graph: LayerGraph, node: int) -> float:
    """Values per token crossing the cut after ``node`` (its hidden state: bytes at the graph's dtype / that size)."""
    return graph.edges[node].bytes_per_token / dtype_bytes(graph.dtype) if node < len(graph.edges) else 0.0


def codec_s(device: DeviceSpec, compression: str, values: float) -> tuple[float, float]:
    """(encode, decode) seconds of ``values`` hand-off values on ``device`` under ``compression`` (0 for none)."""
    if compression == "none" or values <= 0:
        return 0.0, 0.0
    rate = max(device.memory_bandwidth_gbs, 1e-3) * 1e9
    encode, decode = CODEC_BYTES_PER_VALUE[compression]
    return values * encode / rate, values * decode / rate


class RooflineCostModel:
    """time = max(FLOPs / (datasheet TFLOPS x efficiency), bytes touched / memory bandwidth), plus the
    dequantization passes of NF4/int8 linears (DEQUANT_PASSES)."""

    def __init__(self, efficiency: float = 0.4, security: str = "none") -> None:
        if not 0.0 < efficiency <= 1.0:
            raise ConfigError(f"planner.efficiency must be in (0, 1], got {efficiency}")
        self.efficiency = efficiency
        # ``security``: the plan's mode; curve encrypts every message (CURVE_BYTES_PER_S on each byte sent).
        self.cipher_s_per_byte = 1.0 / CURVE_BYTES_PER_S if security == "curve" else 0.0

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
        dequant = dequant_s(graph, node, device, model)
        # The matmuls read the weights at the compute dtype (a quantized one dequantized first: dequant_s).
        weights = weight_bytes(graph, node, device, model) if dequant == 0 else dense_weight_bytes(graph, node, dtype)
        scale = dtype_bytes(dtype) / dtype_bytes(graph.dtype)
        act = n.activation_bytes_per_token * tokens * scale
        # Forward reads the weights once and writes the saved activations; backward reads the
        # weights again (input grads) and reads the saved activations while writing their grads.
        fwd = max(n.fwd_flops_per_token * tokens / flops_per_s, (weights + act) / bandwidth)
        bwd = max(n.bwd_flops_per_token * tokens / flops_per_s, (weights + 2 * act) / bandwidth)
        # A mixture of experts' routing kernels run between the matmuls: their traffic adds (backward: its
        # gradients scattered back and gathered again, twice the forward's).
        dispatch = n.dispatch_bytes_per_token * tokens * scale / bandwidth
        return (fwd + dispatch + DEQUANT_PASSES["fwd"] * dequant,
                bwd + 2 * dispatch + DEQUANT_PASSES["bwd"] * dequant)

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
        """Bytes over the link's bandwidth plus its latency, and under CurveZMQ the cipher's work on them."""
        try:
            link = cluster.link(host_a, host_b)
        except KeyError as exc:
            raise ConfigError(f"fleet '{cluster.name}': {exc.args[0]}; add it under links:") from None
        return num_bytes / link.bytes_per_s + link.latency_us * 1e-6 + num_bytes * self.cipher_s_per_byte

    def optimizer_step_s(self, device: DeviceSpec, model: ModelSpec, lora_params: int, lora_tensors: int) -> float:
        """Per-tensor overhead plus the bytes AdamW touches over the device's memory bandwidth."""
        per_tensor = OPTIMIZER_PER_TENSOR_S.get(device.backend, OPTIMIZER_PER_TENSOR_DEFAULT_S)
        bandwidth = max(device.memory_bandwidth_gbs, 1e-3) * 1e9
        return lora_tensors * per_tensor + lora_params * OPTIMIZER_BYTES_PER_PARAM / bandwidth

    def message_s(self, device: DeviceSpec, num_bytes: float) -> tuple[float, float]:
        """Encode/decode overhead, plus the copy between a GPU and its host."""
        cost = MESSAGE_FIXED_S + (num_bytes / HOST_COPY_BYTES_PER_S if device.backend != "cpu" else 0.0)
        return cost, cost

    def codec_s(self, device: DeviceSpec, compression: str, values: float) -> tuple[float, float]:
        """The codec's memory traffic over the device's memory bandwidth (CODEC_BYTES_PER_VALUE)."""
        return codec_s(device, compression, values)

    def host_copy_bytes_per_s(self, device: DeviceSpec) -> float:
        """The host link's share a pinned copy reaches (HOST_LINK_EFFICIENCY); on a CPU, its memcpy rate (read and
        write over its memory bandwidth)."""
        if device.backend == "cpu":
            return max(device.memory_bandwidth_gbs, 1e-3) * 1e9 / 2.0
        return max(device.host_link_gbs or 0.0, 1e-3) * 1e9 * HOST_LINK_EFFICIENCY


def plan_roofline(plan: Any) -> RooflineCostModel:
    """The datasheet cost model a compiled Plan was priced with: its planner.efficiency and security mode."""
    return RooflineCostModel(plan.planner.efficiency, plan.security.mode)


def lora_tensors(graph: LayerGraph, model: ModelSpec, node: int) -> int:
    """LoRA tensors (A and B per adapted linear) of a node: every target in a decoder layer, else one linear."""
    n = graph.nodes[node]
    if n.lora_params <= 0:
        return 0
    return 2 * max(1, len(model.lora.target_modules)) if n.kind == "decoder" else 2
