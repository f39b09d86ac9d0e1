"""Build an HF causal LM on the meta device and trace it into a chain of pipeline units with torch.fx.

transformers 5.x has no ``transformers.utils.fx`` and ``torch.fx.symbolic_trace`` of the HF model
fails on its decorators and dynamic control flow, so we trace a small wrapper (``PipelineView``)
whose forward is the pipeline's view of the model: embed -> rotary -> decoder layers -> norm -> head.
The embedding, each decoder layer, the final norm, the head and the rotary embedding are leaf
modules: the tracer records one ``call_module`` per unit instead of descending into it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from hetero.errors import ConfigError
from hetero.families import family, layer_types
from hetero.protocol import COMPUTE_DTYPES as COMPUTE_DTYPE_NAMES
from hetero.specs import ModelSpec

COMPUTE_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in COMPUTE_DTYPE_NAMES}


def cost_dtype(model: ModelSpec) -> str:
    """The dtype costs are computed in: the model's dtype, or bfloat16 for "auto"."""
    if model.dtype == "auto":
        return "bfloat16"
    if model.dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"model.dtype={model.dtype!r} is not one of auto, {', '.join(COMPUTE_DTYPES)}")
    return model.dtype


def build_config(architecture: dict[str, Any], attn_implementation: str = "auto", experts: str = "grouped") -> Any:
    """An HF config object from an architecture dict (config.json contents), computing with ``attn_implementation``
    (model.attn_implementation) and ``experts`` (model.experts_implementation); no download."""
    if not isinstance(architecture, dict):
        raise ConfigError("model.architecture must be a mapping (an HF config.json as a dict)")
    model_type = architecture.get("model_type")
    family(model_type)  # hetero/families.py: the families the runtime can split too (one line if not)
    from transformers import AutoConfig

    kwargs = {k: v for k, v in architecture.items() if k not in ("model_type", "transformers_version")}
    try:
        config = AutoConfig.for_model(model_type, **kwargs)
    except (TypeError, ValueError, KeyError, *_strict_config_errors()) as exc:
        reason = " ".join(str(exc).split())  # huggingface_hub's validation errors span lines
        raise ConfigError(f"model.architecture is not a valid {model_type} config: {reason}") from None
    # As the runtime trains it (SDPA, or eager where the family needs it: Gemma 2's class refuses SDPA). Shapes do
    # not depend on it; costs follow it (compiler/costs.py).
    fam = family(model_type)
    fam.configure(config, attn_implementation, experts)
    if config._attn_implementation in ("flash_attention_2", "flex_attention"):
        # The meta model runs SDPA's shapes (no flash-attn needed here, no flex kernel on the meta device); the
        # costs follow the kernel the stages will run (hetero/families.py attention_in_use).
        config.hetero_attention = config._attn_implementation
        config._attn_implementation = "sdpa"
    if fam.experts is not None and getattr(config, "output_router_logits", False):
        raise ConfigError(f"model.architecture.output_router_logits is true: hetero trains this {model_type} "
                          "model without the router's auxiliary load-balancing loss; set it to false")
    return config


def _strict_config_errors() -> tuple[type[Exception], ...]:
    """What newer transformers raise for a config field of the wrong type (huggingface_hub strict dataclasses)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: configs are not validated this way
        return ()
    return (StrictDataclassError,)


def build_meta_model(model: ModelSpec, dtype: str | None = None) -> nn.Module:
    """The full CausalLM on the meta device: real structure and parameter names, no memory, no weights."""
    from transformers import AutoModelForCausalLM

    config = build_config(model.architecture, model.attn_implementation, model.experts_implementation)
    torch_dtype = COMPUTE_DTYPES[dtype or cost_dtype(model)]
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch_dtype)


class PipelineView(nn.Module):
    """The CausalLM as the pipeline sees it; shares (does not copy) the model's submodules."""

    def __init__(self, causal_lm: nn.Module) -> None:
        super().__init__()
        base = causal_lm.model
        # Families whose rotary embedding gives each layer kind its own cos/sin (hetero/families.py): the kinds.
        fam = family(causal_lm.config.model_type)
        self.layer_kinds: list[str] | None = layer_types(causal_lm.config) if fam.rotary_per_layer_type else None
        self.rotary_complex = fam.rotary_complex
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.layers = base.layers
        self.norm = base.norm
        self.head = causal_lm.lm_head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        ropes: list[Any]
        if self.rotary_complex:  # one complex tensor (DeepSeek): the layers take it whole
            ropes = [self.rotary(hidden, position_ids)] * len(self.layers)
        elif self.layer_kinds is None:
            rope = self.rotary(hidden, position_ids)
            ropes = [(rope[0], rope[1])] * len(self.layers)
        else:
            by_kind = {}
            for kind in sorted(set(self.layer_kinds)):
                rope = self.rotary(hidden, position_ids, kind)
                by_kind[kind] = (rope[0], rope[1])
            ropes = [by_kind[kind] for kind in self.layer_kinds]
        for layer, rope in zip(self.layers, ropes, strict=True):
            # No mask tensor: sdpa applies causality itself (is_causal), which keeps flash kernels usable.
            hidden = layer(hidden, attention_mask=None, position_embeddings=rope)
        hidden = self.norm(hidden)
        return self.head(hidden)


class _LayerShapes(ShapeProp):
    """ShapeProp that gives the ``given`` modules' outputs the shape and dtype of their first input, unrun."""

    def __init__(self, gm: fx.GraphModule, given: set[str]) -> None:
        super().__init__(gm)
        self._given = given

    def call_module(self, target: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        if target in self._given:
            return torch.empty_like(args[0])
        return super().call_module(target, args, kwargs)


class _UnitTracer(fx.Tracer):
    """Keeps the given modules (the pipeline units and the rotary embedding) as single call_module nodes."""

    def __init__(self, leaves: set[int]) -> None:
        super().__init__()
        self._leaves = leaves

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return id(m) in self._leaves or super().is_leaf_module(m, module_qualified_name)


@dataclass
class TracedModel:
    """The traced wrapper plus, per fx node, which pipeline unit owns it and whether it is recomputable."""

    module: fx.GraphModule
    units: list[str]  # pipeline unit names in order: embed, layers.0, ..., norm, head
    owner: dict[str, int] = field(default_factory=dict)  # fx node name -> unit index
    recomputed: set[str] = field(default_factory=set)  # fx node names any stage can rebuild
    batch: int = 0  # the sentinel sizes the shapes were propagated with
    seq: int = 0


def _sentinels(config: Any) -> tuple[int, int]:
    """Batch and seq sizes that no config dimension equals, so shapes map back to symbols unambiguously."""
    used = {v for v in vars(config).values() if isinstance(v, int)}
    for batch, seq in ((3, 7), (5, 11), (13, 17), (19, 23), (29, 31)):
        if batch not in used and seq not in used:
            return batch, seq
    raise ConfigError(
        "model.architecture: cannot pick symbolic batch/seq sizes (every candidate is a config size)"
    )


def trace_model(causal_lm: nn.Module) -> TracedModel:
    """Trace the wrapper of a meta-device CausalLM and propagate shapes at sentinel batch/seq sizes."""
    view = PipelineView(causal_lm)
    num_layers = len(view.layers)
    units = ["embed", *(f"layers.{i}" for i in range(num_layers)), "norm", "head"]
    leaves = {id(view.embed), id(view.rotary), id(view.norm), id(view.head), *(id(m) for m in view.layers)}
    graph = _UnitTracer(leaves).trace(view)
    gm = fx.GraphModule(view, graph, class_name="PipelineView")
    _name_rotary_outputs(gm)

    traced = TracedModel(module=gm, units=units)
    unit_index = {name: i for i, name in enumerate(units)}
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target in unit_index:
            traced.owner[node.name] = unit_index[node.target]
            continue
        # Helpers (position ids, rotary cos/sin) belong to the earliest unit that can compute them:
        # the latest unit among their inputs (placeholders count as unit 0).
        inputs = [traced.owner.get(a.name, 0) for a in node.all_input_nodes]
        traced.owner[node.name] = max(inputs, default=0)
        # A helper is recomputable when no unit's output flows into its values. The rotary module reads
        # its hidden-state argument only for dtype/device, so its outputs count as recomputable too.
        is_rotary = node.op == "call_module" and node.target == "rotary"
        derived = [a for a in node.all_input_nodes if a.op != "placeholder"]
        if node.op != "output" and (is_rotary or all(a.name in traced.recomputed for a in derived)):
            traced.recomputed.add(node.name)

    traced.batch, traced.seq = _sentinels(causal_lm.config)
    ids = torch.zeros(traced.batch, traced.seq, dtype=torch.long, device="meta")
    # A mixture of experts picks its experts by data (nonzero, item), which the meta device cannot run: its decoder
    # layers are given their output, a tensor like their input.
    moe = family(causal_lm.config.model_type).experts is not None
    _LayerShapes(gm, {f"layers.{i}" for i in range(num_layers)} if moe else set()).propagate(ids)
    return traced


def _name_rotary_outputs(gm: fx.GraphModule) -> None:
    """Give the rotary getitem nodes readable names (rope_cos, rope_sin; with a rotary per layer kind, the kind
    follows: rope_cos_sliding_attention; a complex rotary's one output: rope_freqs) for edges and segment code."""
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target == "rotary" and not any(
                user.target is operator.getitem for user in node.users):
            node.name = "rope_freqs"  # one complex tensor (hetero/families.py rotary_complex)
        if node.op == "call_function" and node.target is operator.getitem:
            src = node.args[0]
            if isinstance(src, fx.Node) and src.op == "call_module" and src.target == "rotary":
                kind = f"_{src.args[2]}" if len(src.args) > 2 else ""
                node.name = ("rope_cos", "rope_sin")[node.args[1]] + kind
    gm.recompile()


def module_of_unit(causal_lm: nn.Module, unit: str) -> tuple[str, nn.Module]:
    """The state-dict prefix and module of a pipeline unit in the full CausalLM."""
    if unit == "embed":
        return "model.embed_tokens.", causal_lm.model.embed_tokens
    if unit == "norm":
        return "model.norm.", causal_lm.model.norm
    if unit == "head":
        return "lm_head.", causal_lm.lm_head
    if unit.startswith("layers."):
        i = int(unit.split(".", 1)[1])
        return f"model.layers.{i}.", causal_lm.model.layers[i]
    raise KeyError(unit)
