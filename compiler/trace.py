"""trace(ModelSpec) -> LayerGraph: the model as a chain of pipeline units with costs, from torch.fx on meta."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx

from hetero.errors import ConfigError
from hetero.families import check_seq_len
from hetero.graph import CutEdge, LayerGraph, LayerNode, TensorSpec
from hetero.specs import ModelSpec

from .costs import unit_cost
from .fxgraph import TracedModel, build_meta_model, cost_dtype, module_of_unit, trace_model

__all__ = ["trace", "trace_with_module"]


def trace(model: ModelSpec, attention_len: float | None = None, label_share: float | None = None) -> LayerGraph:
    """Trace ``model`` on the meta device (no weights, no download) into a costed LayerGraph. ``attention_len``:
    packed rows' attention is priced at this causal length (the records', hetero/packing.py) instead of seq_len."""
    return trace_with_module(model, attention_len, label_share)[0]


def trace_with_module(model: ModelSpec, attention_len: float | None = None,
                      label_share: float | None = None) -> tuple[LayerGraph, TracedModel]:
    """Like ``trace``, also returning the traced fx module (emit prints each stage's segment of it). ``label_share``:
    the share of computed tokens with a label, the only ones the loss head computes logits for (None: all)."""
    if model.seq_len < 1:
        raise ConfigError(f"model.seq_len must be a positive integer, got {model.seq_len}")
    check_seq_len(model.architecture, model.seq_len)
    dtype = cost_dtype(model)
    causal_lm = build_meta_model(model, dtype)
    config = causal_lm.config
    traced = trace_model(causal_lm)
    _check_lora_targets(causal_lm, model.lora.target_modules, model.model_type)

    state = causal_lm.state_dict(keep_vars=True)
    tied = causal_lm.lm_head.weight is causal_lm.model.embed_tokens.weight
    nodes = [_node(unit, causal_lm, state, tied, model, dtype, attention_len, label_share) for unit in traced.units]
    _check_partition(nodes, state, tied)

    notes = _notes(model, config, nodes, tied)
    if attention_len:
        notes.append(f"attention priced at the packed records' lengths: as causal attention over {attention_len:.0f} "
                     f"tokens, not model.seq_len={model.seq_len} (attention stays inside each record)")
    graph = LayerGraph(
        model_name=model.name,
        model_type=model.model_type,
        seq_len=model.seq_len,
        dtype=dtype,
        quantization=model.quantization,
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        num_layers=int(config.num_hidden_layers),
        nodes=nodes,
        edges=_edges(traced, model.seq_len),
        notes=notes,
    )
    return graph, traced


def _notes(model: ModelSpec, config: Any, nodes: list[LayerNode], tied: bool) -> list[str]:
    """What a reader of the LayerGraph should know about how it was costed."""
    notes = [
        "Nodes: embed, layers.0..N-1, norm, head; costs per token at seq_len with the attention the runtime "
        "trains with (causal SDPA kernels skip the masked half); activation_bytes_per_token without recomputation, "
        "recompute_bytes_per_token (decoder layers) what a recomputed layer keeps: its input.",
        "rope_cos/rope_sin (a complex rotary's rope_freqs) cross every decoder cut but are recomputed=True: each "
        "stage rebuilds them from "
        "positions (rotary embedding), so only hidden_states goes on the wire. Attention masks never travel: "
        "SDPA is causal without one, and each stage builds those its layers need (docs/models.md).",
        "FLOPs count matmuls (2 per multiply-add); backward = input grads through frozen weights + "
        "LoRA input/weight grads (frozen weights get no weight grads), attention backward 2.5x forward.",
        "activation_bytes_per_token = tensors autograd keeps for backward under LoRA (fp32 adapters, inputs "
        "shared at the compute dtype); "
        "the head's value is its peak with fp32 logits for the loss.",
    ]
    if model.dtype == "auto":
        notes.append("model.dtype is auto: costs are in bfloat16; stages on fp16/fp32 devices rescale bytes.")
    if model.quantization != "none":
        notes.append(
            f"quantization {model.quantization}: only decoder Linear weights and experts (linear_params) are quantized; "
            "embeddings, norms and the head stay in the compute dtype."
        )
    sliding = [n.name for n in nodes if n.layer_type == "sliding_attention"]
    window = getattr(config, "sliding_window", None)
    if sliding and window and model.seq_len > window:
        notes.append(
            f"sliding_window={window} < seq_len={model.seq_len}: {len(sliding)} sliding-window layers get the "
            "window's mask, and attention FLOPs count every key (a masked kernel does not skip the masked ones)."
        )
    if tied:
        notes.append(
            "tie_word_embeddings: the head has no weight of its own; it loads model.embed_tokens.weight "
            "(checkpoints carry no lm_head.weight). Two stages holding embed and head each load a copy."
        )
    return notes


def _node(
    unit: str, causal_lm: Any, state: dict[str, Any], tied: bool, model: ModelSpec, dtype: str,
    attention_len: float | None = None,
    label_share: float | None = None,
) -> LayerNode:
    prefix, module = module_of_unit(causal_lm, unit)
    kind = {"embed": "embedding", "norm": "norm", "head": "head"}.get(unit, "decoder")
    params = {k: v for k, v in state.items() if k.startswith(prefix)}
    if unit == "head" and tied:
        params = {"model.embed_tokens.weight": state["model.embed_tokens.weight"]}
    cost = unit_cost(
        kind,
        module,
        prefix if unit != "head" else "",
        params,
        causal_lm.config,
        model.seq_len,
        dtype,
        model.quantization,
        model.lora.r,
        model.lora.target_modules,
        model.lora.dropout,
        int(unit.split(".", 1)[1]) if kind == "decoder" else 0,
        attention_len,
        label_share,
    )
    return LayerNode(
        name=unit,
        kind=kind,  # type: ignore[arg-type]
        param_names=list(params),
        num_params=cost.num_params,
        linear_params=cost.linear_params,
        param_bytes=cost.param_bytes,
        lora_params=cost.lora_params,
        fwd_flops_per_token=cost.fwd_flops_per_token,
        bwd_flops_per_token=cost.bwd_flops_per_token,
        activation_bytes_per_token=cost.activation_bytes_per_token,
        recompute_bytes_per_token=cost.recompute_bytes_per_token,
        expert_params=cost.expert_params,
        layer_type=cost.layer_type,
        dispatch_bytes_per_token=cost.dispatch_bytes_per_token,
    )


def _check_lora_targets(causal_lm: Any, targets: list[str], model_type: str) -> None:
    """peft refuses targets that match nothing; say so at compile time instead of at run time."""
    from hetero.families import family

    names = {n.rsplit(".", 1)[-1] for n, _ in causal_lm.named_modules()} | {
        n for n, _ in causal_lm.named_modules()
    }
    missing = [t for t in targets if t not in names and not any(n.endswith("." + t) for n in names)]
    own = family(model_type).lora_targets_of(causal_lm.config)
    if missing or not targets:
        raise ConfigError(
            f"model.lora.target_modules {missing or targets} match no module of this {model_type} model; its "
            f"decoder layers' Linear layers are {', '.join(own)} (for example "
            f"lora.target_modules=[{','.join(own)}])"
        )
    from torch import nn

    for name, module in causal_lm.named_modules():
        short = name.rsplit(".", 1)[-1]
        # A router that subclasses Linear (Llama 4's returns its scores and logits) is no Linear for LoRA either
        router = type(module).__name__.endswith("Router")
        if (short in targets or name in targets) and (router or not isinstance(module, (nn.Linear, nn.Embedding))):
            experts = " (a mixture of experts' router and experts get no LoRA here: docs/models.md)" if family(
                model_type).experts else ""
            raise ConfigError(
                f"model.lora.target_modules names '{short}', a {type(module).__name__} in this {model_type} model, "
                f"not a Linear layer LoRA can wrap{experts}; its decoder layers' Linear layers are {', '.join(own)}")


def _check_partition(nodes: list[LayerNode], state: dict[str, Any], tied: bool) -> None:
    """Every state-dict entry belongs to exactly one unit (a bug here would silently drop weights)."""
    seen = [p for n in nodes for p in n.param_names]
    expected = set(state) - ({"lm_head.weight"} if tied else set())
    if set(seen) != expected or len(seen) != len(set(seen)) + (1 if tied else 0):
        raise AssertionError(f"state-dict partition mismatch: {sorted(expected ^ set(seen))[:5]}")


def _symbolic_shape(shape: torch.Size, traced: TracedModel) -> list[int | str]:
    return ["batch" if d == traced.batch else "seq" if d == traced.seq else int(d) for d in shape]


def _tensor_spec(node: fx.Node, traced: TracedModel, seq_len: int) -> TensorSpec:
    meta = node.meta["tensor_meta"]
    shape = _symbolic_shape(meta.shape, traced)
    per_token = math.prod(d for d in shape if isinstance(d, int))
    if "seq" not in shape:  # a per-sequence tensor: spread it over the sequence's tokens
        per_token = per_token / seq_len
    is_unit_output = (
        node.op == "call_module"
        and traced.owner[node.name] < len(traced.units)
        and node.name not in traced.recomputed
    )
    return TensorSpec(
        name="hidden_states" if is_unit_output else node.name,
        shape=shape,
        dtype=str(meta.dtype).removeprefix("torch."),
        bytes_per_token=float(per_token * meta.dtype.itemsize),
        recomputed=node.name in traced.recomputed,
    )


def _edges(traced: TracedModel, seq_len: int) -> list[CutEdge]:
    """For each cut, the tensors made at or before it and used after it (fx liveness over units)."""
    last_use: dict[str, int] = {}
    producers: dict[str, fx.Node] = {}
    for node in traced.module.graph.nodes:
        if node.op == "output":
            continue
        for arg in node.all_input_nodes:
            last_use[arg.name] = max(last_use.get(arg.name, -1), traced.owner[node.name])
            producers[arg.name] = arg
    edges = []
    for cut, unit in enumerate(traced.units[:-1]):
        crossing = [
            producers[name]
            for name, use in last_use.items()
            if traced.owner[name] <= cut < use and hasattr(producers[name].meta.get("tensor_meta"), "shape")
        ]
        tensors = [_tensor_spec(n, traced, seq_len) for n in crossing]
        tensors.sort(key=lambda t: (t.recomputed, t.name))
        edges.append(CutEdge(after=unit, tensors=tensors))
    return edges
