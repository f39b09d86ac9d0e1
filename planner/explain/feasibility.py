"""Explain why a model does not fit a fleet, with numbers a person can act on."""

from __future__ import annotations

from hetero.errors import InfeasiblePlanError
from hetero.graph import LayerGraph
from hetero.planner.model.cost import GB, CostTable
from hetero.planner.model.cost_model import NF4_BYTES_PER_PARAM, dtype_bytes
from hetero.planner.model.stream_costs import BUFFER_LAYERS
from hetero.specs import ModelSpec


def _usable_gb(table: CostTable) -> list[float]:
    return [max(0.0, (u - table.workspace_bytes) / GB) for u in table.usable_bytes]


def _fleet_text(table: CostTable) -> str:
    usable = _usable_gb(table)
    parts = ", ".join(f"{d.name} {u:.1f}" for d, u in zip(table.devices, usable, strict=True))
    return f"the fleet has {sum(usable):.1f} GB usable ({parts})"



def check_single_nodes(table: CostTable, graph: LayerGraph) -> None:
    """Raise if some node alone (with one micro-batch of activations) fits no device."""
    usable = _usable_gb(table)
    for i, node in enumerate(graph.nodes):
        need = [
            (table.weights[i][d] + table.lora[i][d] + table.activations_per_mb[i][d]) / GB
            for d in range(len(table.devices))
        ]
        if all(n > u for n, u in zip(need, usable, strict=True)):
            best = max(range(len(usable)), key=lambda d: usable[d] - need[d])
            dev = table.devices[best]
            raise InfeasiblePlanError(
                f"layer '{node.name}' alone needs {need[best]:.1f} GB on {dev.name} ({dev.display_name}), "
                f"which has {usable[best]:.1f} GB usable, and no device has more room: use nf4 quantization, "
                f"a shorter model.seq_len or train.micro_batch_size=1, or a larger device"
            )


def _streaming(table: CostTable) -> tuple[float, float]:
    """(GB of frozen weights that can stream less one stage's buffer, GB of RAM on the hosts that stream)
    where planner.offload lets devices stream; (0, 0) where none can."""
    if table.stream_mode == "none" or not any(table.can_stream):
        return 0.0, 0.0
    can = [d for d in range(table.num_devices) if table.can_stream[d]]
    streamed = sum(sum(row[d] for d in can) / len(can) for row in table.stream_bytes)
    buffer = BUFFER_LAYERS * max(table.stream_buffer[d] for d in can)
    hosts = {table.host_of[d] for d in can}
    return max(0.0, streamed - buffer) / GB, sum(table.host_ram_bytes[h] for h in hosts) / GB


def explain_infeasible(table: CostTable, graph: LayerGraph, model: ModelSpec, num_stages: int | None) -> str:
    """One line: what the model needs (recomputing as planner.recompute allows), what the fleet has,
    and what would help."""
    n = len(table.devices)
    recompute = table.recompute_mode != "none" and any(table.recomputable)
    weights = sum(sum(row) / n for row in table.weights) / GB
    lora = sum(sum(row) / n for row in table.lora) / GB
    kept = table.recompute_per_mb if recompute else table.activations_per_mb
    acts = sum(sum(row) / n for row in kept) / GB
    if recompute:  # plus one layer's full activations while it re-runs
        acts += max(sum(table.activations_per_mb[i]) / n for i in range(table.num_nodes) if table.recomputable[i]) / GB
    have = sum(_usable_gb(table))
    dtype = model.dtype if model.dtype != "auto" else graph.dtype
    streamed, ram = _streaming(table)
    weights -= streamed
    how = ("with recomputation" if recompute else "without recomputation") + (" and streaming" if streamed else "")
    msg = (
        f"{model.name} ({dtype}, quantization {model.quantization}) needs {weights + lora + acts:.1f} GB {how}, "
        f"{_fleet_text(table)}: {weights:.1f} GB weights + {lora:.1f} GB LoRA state + {acts:.1f} GB activations "
        f"(one micro-batch in flight{', every layer recomputing' if recompute else ''}"
        f"{f', {streamed:.1f} GB of frozen weights streaming from host RAM' if streamed else ''}); usable is after "
        f"planner.memory_headroom and {table.workspace_bytes / GB:.1f} GB workspace per device"
    )
    if streamed and streamed > ram:
        msg += f"; host RAM is short too: streaming needs {streamed:.1f} GB, ram_gb gives {ram:.1f} GB"
    if table.recompute_mode == "none" and any(table.recomputable):
        msg += "; planner.recompute=auto would recompute activations to fit"
    if not streamed and table.stream_mode != "none" and not any(table.can_stream) and any(table.streamable):
        msg += ("; a host's ram_gb (docs/fleet.md) would let its GPUs stream frozen weights from host RAM "
                "(planner.offload)")
    if model.quantization != "nf4":
        elem = dtype_bytes(graph.dtype)
        nf4 = sum((nd.num_params - nd.linear_params) * elem + nd.linear_params * NF4_BYTES_PER_PARAM for nd in graph.nodes)
        msg += f"; nf4 would need {nf4 / GB:.1f} GB for weights (model.quantization=nf4)"
    if num_stages:
        msg += f"; planner.num_stages={num_stages} may be too few"
    elif weights + lora + acts <= have:
        msg += (
            "; the total would fit, but no contiguous split does (activations of micro-batches in flight "
            "or one big layer): try fewer train.num_micro_batches, schedule=1f1b, or a smaller micro-batch"
        )
    return msg
