"""What streaming a decoder layer's frozen weights from host RAM costs, per (node, device) (planner.offload).

A streamed decoder layer keeps its frozen (base, possibly NF4-packed) Linear weights in pinned host RAM;
the runtime copies them to the device each time the layer runs: in its forward and again in its backward
per micro-batch (backward needs W for the input gradient); a layer that also recomputes copies no third
time (its re-run forward, just before its backward, finds it in the buffer). LoRA weights, norms and optimizer state stay on the device. Both schedules run the
same micro-batch by micro-batch, so 1F1B and GPipe pay the same copies (a layer-major GPipe that reuses
one copy for all micro-batches would need every micro-batch's activations at once: not what runs).

The model, conservative and simple (docs/memory.md):

- copy_s = frozen bytes / the cost model's host copy rate: a profile's measured rate (`hetero profile` times the
  runtime's own copy), else on a GPU host_link_gbs x HOST_LINK_EFFICIENCY, on a CPU device (``full`` only: RAM
  to the same RAM is a memcpy) its memory bandwidth / 2 (read and write).
- On a GPU the copy of the next layer overlaps the current layer's compute (side stream, prefetch). Each
  copy is charged what the layer's own forward cannot hide, max(0, copy_s - fwd_s) (the forward is the
  shortest compute next to it), and each pass (forward, backward) once more the hidden part of the
  largest layer's copy: its first copy waits in full. A CPU hides nothing: every copy costs copy_s.
- The device holds a buffer of BUFFER_LAYERS streamed layers (current + prefetched), each slot sized as
  the device's largest streamable layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero.errors import ConfigError
from hetero.graph import LayerGraph
from hetero.planner.model.cost_model import CostModel, compute_dtype, dtype_bytes
from hetero.specs import QUANT_BYTES_PER_PARAM, ClusterSpec, DeviceSpec, ModelSpec

GB = 1e9
BUFFER_LAYERS = 2  # the layer being computed and the next one, prefetched


@dataclass
class StreamColumns:
    """A CostTable's streaming arrays (see its fields)."""

    bytes: list[list[float]]
    fetch_s: list[list[float]]
    start_s: list[float]
    buffer: list[float]
    can_stream: list[bool]
    streamable: list[bool]
    ram_bytes: list[float]


def frozen_linear_bytes(graph: LayerGraph, node: int, device: DeviceSpec, model: ModelSpec) -> float:
    """Bytes of a node's frozen Linear weights on ``device`` (quantized as there): what streams."""
    quant = device.quantization(model.quantization)
    per_linear = QUANT_BYTES_PER_PARAM.get(quant, dtype_bytes(compute_dtype(device, model)))
    return graph.nodes[node].linear_params * per_linear


def _may_stream(cluster: ClusterSpec, mode: str) -> list[bool]:
    """Per device: auto streams GPUs with a host link on hosts with ram_gb; full every device (or refuses)."""
    out = []
    for d in cluster.devices:
        ram = cluster.host(d.host).ram_gb
        if mode == "full":
            if ram is None:
                raise ConfigError(f"planner.offload=full: host '{d.host}' has no ram_gb; set hardware.hosts[].ram_gb "
                                  "(docs/fleet.md)")
            if d.backend != "cpu" and not d.host_link_gbs:
                raise ConfigError(f"planner.offload=full: device '{d.name}' has no host link; set its host_link_gbs "
                                  "or pcie in the fleet file (docs/fleet.md)")
        out.append(mode == "full" or (mode == "auto" and ram is not None and bool(d.host_link_gbs)
                                      and d.backend != "cpu"))
    return out


def stream_columns(graph: LayerGraph, model: ModelSpec, cluster: ClusterSpec, fwd_s: list[list[float]],
                   mode: str, cost_model: CostModel) -> StreamColumns:
    """Every decoder layer's streamed bytes and per-copy seconds on every device that may stream."""
    devices = cluster.devices
    can = _may_stream(cluster, mode)
    streamable = [n.kind == "decoder" and n.linear_params > 0 for n in graph.nodes]
    nbytes = [[frozen_linear_bytes(graph, i, d, model) if streamable[i] and can[j] else 0.0
               for j, d in enumerate(devices)] for i in range(len(graph.nodes))]
    fetch = [[0.0] * len(devices) for _ in graph.nodes]
    start, buffer = [0.0] * len(devices), [0.0] * len(devices)
    for j, d in enumerate(devices):
        if not any(row[j] > 0 for row in nbytes):
            continue
        rate = cost_model.host_copy_bytes_per_s(d)
        hides = d.backend != "cpu"
        for i in range(len(graph.nodes)):
            if nbytes[i][j] <= 0:
                continue
            copy = nbytes[i][j] / rate
            fetch[i][j] = max(0.0, copy - fwd_s[i][j]) if hides else copy
            start[j] = max(start[j], copy - fetch[i][j])
            buffer[j] = max(buffer[j], nbytes[i][j])
    return StreamColumns(nbytes, fetch, start, buffer, can, streamable,
                         [(h.ram_gb or 0.0) * GB for h in cluster.hosts])
