"""One pipeline stage: only this stage's layers of the HF CausalLM, its own weights, quantized, with LoRA.

The stage keeps the full model's module tree and names (decoder layers stay under their original
index in an ``nn.ModuleDict``), so every parameter name equals the whole model's and the PEFT keys
of its LoRA weights (runtime/stage/lora.py) are in whole-model key space: the trained adapter is
simply the union of the stages' states. Building a stage imports neither peft nor, without nf4,
bitsandbytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from hetero.errors import PlanError

# the families the runtime can split (and the compiler traces), and their layers' attention kinds
from hetero.families import FULL, SLIDING, family, layer_types, needs_mask
from hetero.plan import Plan
from hetero.runtime.stage.attention import Segments, implementation, register, runtime_attention, segments_of
from hetero.runtime.stage.experts import SORTED, grouped_fast, register_sorted
from hetero.runtime.stage.lora import add_lora, load_lora_state, lora_state
from hetero.runtime.stage.routed import use_routed
from hetero.runtime.stage.streaming import WeightStreamer, frozen_device_bytes, stream_layer
from hetero.runtime.stage.weights import load_weights, quantize_nf4
from hetero.runtime.wire.frames import TORCH_DTYPES

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


@dataclass
class StageLayout:
    """Which parts of the model stage k holds (from the plan's node span)."""

    embed: bool
    layers: list[int]
    norm: bool
    head: bool


def stage_layout(plan: Plan, k: int, chunk: int = 0) -> StageLayout:
    """Read stage k's node span (of its ``chunk``, under an interleaved schedule) from the plan's LayerGraph."""
    if not 0 <= k < len(plan.stages):
        raise PlanError(f"stage {k} does not exist: the plan has {len(plan.stages)} stages (0..{len(plan.stages) - 1})")
    spans = plan.stages[k].spans()
    if not 0 <= chunk < len(spans):
        raise PlanError(f"stage {k} holds {len(spans)} chunks, not chunk {chunk}")
    first, last = spans[chunk]
    nodes = plan.graph.nodes[first : last + 1]
    if not nodes:
        raise PlanError(f"stage {k}: empty node span {first}..{last}; recompile the plan")
    layout = StageLayout(embed=False, layers=[], norm=False, head=False)
    for node in nodes:
        if node.kind == "embedding":
            layout.embed = True
        elif node.kind == "norm":
            layout.norm = True
        elif node.kind == "head":
            layout.head = True
        elif node.kind == "decoder":
            m = _LAYER_RE.search(node.name) or next(
                (r for r in (_LAYER_RE.search(p) for p in node.param_names) if r), None
            )
            if m is None:
                raise PlanError(f"stage {k}: decoder node '{node.name}' names no layer index; recompile the plan")
            layout.layers.append(int(m.group(1)))
    return layout


def recompute_indices(plan: Plan, k: int, layout: StageLayout, chunk: int = 0) -> frozenset[int]:
    """Decoder layer indices of stage k (its ``chunk``) that the plan says recompute; they must be its own."""
    sp = plan.stages[k]
    names = sp.recompute_layers if chunk == 0 else sp.chunks[chunk - 1].recompute_layers
    return _own_layers(names, "recompute_layers", k, layout)


def stream_indices(plan: Plan, k: int, layout: StageLayout) -> frozenset[int]:
    """Decoder layer indices of stage k whose frozen weights the plan streams from host RAM."""
    return _own_layers(plan.stages[k].stream_layers, "stream_layers", k, layout)


def _own_layers(names: list[str], what: str, k: int, layout: StageLayout) -> frozenset[int]:
    found = set()
    for name in names:
        m = _LAYER_RE.search(name)
        if m is None or int(m.group(1)) not in layout.layers:
            raise PlanError(f"stage {k}: {what} names '{name}', not one of this stage's decoder layers; "
                            "recompile the plan")
        found.add(int(m.group(1)))
    return frozenset(found)


@dataclass
class Stage:
    """A built stage: the pruned CausalLM (LoRA injected) and how to run it forward."""

    index: int
    device: torch.device
    dtype: torch.dtype
    layout: StageLayout
    model: nn.Module  # the pruned HF CausalLM; parameter names equal the full model's
    lora_model: nn.Module | None  # LoraModel around it, named as a PeftModel (None: no LoRA target lives here)
    quantization: str
    recompute: frozenset[int] = frozenset()  # decoder layer indices that recompute in backward
    # What the family's model forward does outside the layers (hetero/families.py): 1.0 = nothing.
    embed_multiplier: float = 1.0
    logits_divisor: float = 1.0
    logits_softcap: float | None = None
    rotary_per_layer_type: bool = False  # each layer kind its own cos/sin (hetero/families.py)
    streamer: WeightStreamer | None = None  # the streamed layers' weights (plan stream_layers), None: none stream
    _layer_kinds: dict[int, str] | None = field(default=None, repr=False)

    # The first stage of a pipeline holds the embedding, the last the LM head (every replica has both).
    @property
    def is_first(self) -> bool:
        return self.layout.embed

    @property
    def is_last(self) -> bool:
        return self.layout.head

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, logits: bool = True) -> torch.Tensor:
        """Stage 0 takes input ids [B, S]; others hidden states [B, S, H]. The last stage returns logits (without
        ``logits``: the final norm's output, for the chunked loss). ``positions``: packed rows' position ids [B, S]
        (restarting at each record; runtime/run/data.py)."""
        inner = self.model.model
        h = inner.embed_tokens(x) if self.layout.embed else x
        if self.layout.embed and self.embed_multiplier != 1.0:
            h = h * self.embed_multiplier  # as the family's model forward does (granite's embedding_multiplier)
        seq = h.shape[1]
        kinds = self._kinds()
        # Every stage rebuilds rotary cos/sin and masks from the positions: cheaper than sending them.
        segments: Segments | None = None
        if positions is None and self.model.config._attn_implementation == implementation("flex_attention"):
            positions = torch.arange(seq).expand(h.shape[0], seq)  # flex attention takes its causal shape from segments
        if positions is None:
            position_ids = torch.arange(seq, device=h.device).unsqueeze(0)
            masks = attention_masks(self.model, h, position_ids, set(kinds.values()))
        else:  # attention within each record (runtime/stage/attention.py): no mask tensor
            segments, position_ids, masks = segments_of(positions), positions.to(h.device), {}
        rope = rotary_tables(self.model, h, position_ids, set(kinds.values()), self.rotary_per_layer_type)
        training = torch.is_grad_enabled()
        for index, layer in inner.layers.items():
            kind = kinds[int(index)]
            kwargs = {"attention_mask": masks.get(kind), "position_ids": position_ids,
                      "position_embeddings": rope[kind]}
            if segments is not None:
                kwargs["hetero_segments"] = segments
            if training and int(index) in self.recompute:
                # Keep only the layer's input; its forward runs again in backward, with the RNG state
                # of this forward (LoRA dropout draws the same mask). Non-reentrant: works when the
                # input needs no grad (stage 0), with keyword arguments, and with bitsandbytes layers.
                out = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False, preserve_rng_state=True,
                                                        **kwargs)
            else:
                out = layer(h, **kwargs)
            h = out[0] if isinstance(out, tuple) else out
        if self.layout.norm:
            h = inner.norm(h)
        return self.logits(h) if self.layout.head and logits else h

    @property
    def frozen_head(self) -> bool:
        """Whether the head has no parameter to train (no LoRA on lm_head): its loss gradient is then computed in
        forward (runtime/stage/loss.py)."""
        return not any(p.requires_grad for p in self.model.lm_head.parameters())

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head, and what the family's CausalLM does to its output (a divisor, a soft cap)."""
        h = self.model.lm_head(h)
        if self.logits_divisor != 1.0:
            h = h / self.logits_divisor
        if self.logits_softcap is not None:
            h = torch.tanh(h / self.logits_softcap) * self.logits_softcap
        return h

    def _kinds(self) -> dict[int, str]:
        """This stage's decoder layers' attention kinds, by layer index (computed once)."""
        if self._layer_kinds is None:
            kinds = layer_types(self.model.config)
            self._layer_kinds = {int(i): kinds[int(i)] for i in self.model.model.layers}
        return self._layer_kinds

    def lora_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Trainable parameters (the LoRA matrices), in module order."""
        root = self.lora_model if self.lora_model is not None else self.model
        return [(n, p) for n, p in root.named_parameters() if p.requires_grad]

    def lora_parameters(self) -> list[nn.Parameter]:
        """Trainable parameters (the LoRA matrices), in module order."""
        return [p for _, p in self.lora_named_parameters()]

    def lora_state(self) -> dict[str, torch.Tensor]:
        """This stage's LoRA weights in whole-model PEFT key space, as CPU float32 copies."""
        return {} if self.lora_model is None else lora_state(self.lora_model)

    def load_lora_state(self, state: dict[str, torch.Tensor], *, strict: bool = True) -> list[str]:
        """Copy LoRA weights (whole-model key space) into this stage; returns the keys it took."""
        if self.lora_model is None:
            return []
        return load_lora_state(self.lora_model, state, f"stage {self.index}", strict=strict)


def rotary_tables(model: nn.Module, h: torch.Tensor, position_ids: torch.Tensor, kinds: set[str],
                  per_kind: bool) -> dict[str, Any]:
    """The rotary cos/sin a CausalLM's layers of each attention kind in ``kinds`` take: one pair for all, or
    (``per_kind``: hetero/families.py) a pair per kind."""
    rotary = model.model.rotary_emb
    if not per_kind:
        shared = rotary(h, position_ids)
        return dict.fromkeys(kinds, shared)
    return {kind: rotary(h, position_ids, kind) for kind in sorted(kinds)}


def attention_masks(model: nn.Module, h: torch.Tensor, position_ids: torch.Tensor, kinds: set[str]
                    ) -> dict[str, Any]:
    """attention_mask per attention kind in ``kinds``: none for causal SDPA (right padding needs none: pads only
    follow real tokens); the causal or sliding-window mask HF builds where the family's attention is eager, or
    where a sliding window is shorter than the sequence (hetero/families.py needs_mask)."""
    config = model.config
    fam = family(config.model_type)
    wanted = sorted(k for k in kinds if needs_mask(fam, config, k, h.shape[1]))
    if not wanted:
        return {}
    from transformers.masking_utils import (
        create_causal_mask,
        create_chunked_causal_mask,
        create_sliding_window_causal_mask,
    )

    build = {FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask,
             "chunked_attention": create_chunked_causal_mask}  # Llama 4
    unknown = [k for k in wanted if k not in build]
    if unknown:
        raise PlanError(f"layer kind '{unknown[0]}' of this {config.model_type} model is not one hetero builds masks "
                        f"for ({FULL}, {SLIDING}): this family needs support (docs/models.md)")
    kw = {"config": config, "inputs_embeds": h, "attention_mask": None, "cache": None, "position_ids": position_ids}
    return {kind: build[kind](**kw) for kind in wanted}


def _build_config(architecture: dict, choice: str = "auto", device: torch.device | None = None,
                  dtype: torch.dtype | None = None, experts: str = "grouped"):
    """The HF config a stage computes with: the family's settings, the attention of ``model.attn_implementation``
    (``choice``) as it runs on ``device`` at ``dtype`` (auto: flash-attn where a CUDA stage in fp16/bf16 has it)
    and the experts of ``model.experts_implementation``."""
    from transformers import AutoConfig

    arch = dict(architecture)
    model_type = arch.pop("model_type", None)
    fam = family(model_type)  # hetero/families.py: one line for a family the runtime cannot split
    config = AutoConfig.for_model(model_type, **arch)
    fam.configure(config, choice, experts)  # SDPA without a mask is causal; layers that need one get it (attention_masks)
    # Sinks (gpt-oss): eager only, whatever flash-attn a stage has (hetero/families.py)
    base = config._attn_implementation if fam.sinks else runtime_attention(config._attn_implementation, choice,
                                                                             device, dtype)
    # The same implementation, wrapped to keep packed records apart (runtime/stage/attention.py)
    register()
    config._attn_implementation = implementation(base)
    if getattr(config, "_experts_implementation", None) == "grouped_mm" and not grouped_fast(device, dtype):
        register_sorted()  # no fast grouped GEMM here: the experts over sorted rows (runtime/stage/experts.py)
        config._experts_implementation = SORTED
    if getattr(config, "hetero_experts", None) == "grouped_mm" and not grouped_fast(device, dtype):
        config.hetero_experts = SORTED  # Llama 4's routed experts per used expert (runtime/stage/routed.py)
    return config


def preload(architecture: dict) -> None:
    """Import what building a stage of this model needs (its transformers model class and what that
    pulls in: seconds of CPU), so stage processes forked afterwards start with it in memory."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    MODEL_FOR_CAUSAL_LM_MAPPING[type(_build_config(architecture))]  # resolving the class imports its module


def _skeleton(config, layout: StageLayout) -> nn.Module:
    """The full CausalLM on the meta device, pruned to this stage's modules (no memory, no init cost)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    inner = model.model
    all_layers = inner.layers
    bad = [i for i in layout.layers if not 0 <= i < len(all_layers)]
    if bad:
        raise PlanError(f"plan names decoder layer {bad[0]}, the model has {len(all_layers)}; recompile the plan")
    inner.layers = nn.ModuleDict({str(i): all_layers[i] for i in layout.layers})
    if not layout.embed:
        inner.embed_tokens = None
    if not layout.norm:
        inner.norm = None
    if not layout.head:
        model.lm_head = None
    # Real rotary buffers (inv_freq is computed, not loaded): rebuild the module off the meta device.
    inner.rotary_emb = type(inner.rotary_emb)(config=config)
    _computed_buffers(model)
    experts = family(config.model_type).experts
    routed = getattr(config, "hetero_experts", "eager")
    if experts is not None and experts.scaled_input and routed != "eager":  # Llama 4: the chosen experts only
        use_routed(model, experts.module, grouped=routed == "grouped_mm")
    return model


def _computed_buffers(model: nn.Module) -> None:
    """Buffers computed at construction, not loaded (Gemma's embedding scale), made real off the meta device:
    HF keeps the number beside such a buffer as ``scalar_<name>``."""
    for module_name, module in model.named_modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is None or not buf.is_meta or name not in module._non_persistent_buffers_set:
                continue  # real already, or in the state dict: loaded from the checkpoint (a router's bias)
            scalar = getattr(module, f"scalar_{name}", None)
            if scalar is None:
                raise PlanError(f"{module_name}.{name} is a computed buffer the runtime cannot rebuild "
                                f"({type(module).__name__}): this model family needs support (docs/models.md)")
            module.register_buffer(name, torch.tensor(scalar), persistent=False)


def _base_model(plan: Plan, k: int, layout: StageLayout, dtype: torch.dtype, device: torch.device
                ) -> tuple[nn.Module, WeightStreamer | None]:
    """Stage k's frozen part of the CausalLM on ``device``: its own weights only, cast, quantized as planned, its
    streamed layers' Linear weights in host memory (and the streamer that holds them)."""
    from hetero.runtime.pretrained import resolve_dir

    sp = plan.stages[k]
    config = _build_config(plan.model.architecture, plan.model.attn_implementation, device, dtype,
                           plan.model.experts_implementation)
    model = _skeleton(config, layout)
    load_weights(model, resolve_dir(plan.model), dtype, k, tied=bool(getattr(config, "tie_word_embeddings", False)),
                 fam=family(plan.model.model_type))
    model.requires_grad_(False)
    streamed = stream_indices(plan, k, layout)
    streamer = WeightStreamer(k, device, sp.frozen_resident_cap_bytes) if streamed else None

    def offload(index: int, layer: nn.Module) -> None:
        # Right after a layer is quantized (or before anything moves): its Linears never stay in device memory.
        if streamer is not None and index in streamed:
            stream_layer(layer, index, streamer)

    if sp.quantization == "nf4":
        # Quantize layer by layer while moving to the device: the unquantized stage never sits in device memory.
        quantize_nf4(model, dtype, device, family(plan.model.model_type).experts, after_layer=offload)
    elif sp.quantization not in ("none", ""):
        raise PlanError(f"stage {k}: quantization '{sp.quantization}' is not supported by the runtime (none, nf4)")
    else:
        for index, layer in model.model.layers.items():
            offload(int(index), layer)
    model.to(device)
    model.eval()  # dropout off in the frozen base; LoRA dropout follows lora.dropout via train()
    if streamer is not None:
        streamer.finish(frozen_device_bytes(model))
    return model, streamer


def build_stage(plan: Plan, k: int, device: torch.device, *, seed: int | None = None, chunk: int = 0) -> Stage:
    """Build stage k of the plan on ``device``: its weights only, cast/quantized, with LoRA added (under an
    interleaved schedule, one of its chunks: build_chunks)."""
    layout = stage_layout(plan, k, chunk)
    sp = plan.stages[k]
    if sp.dtype not in TORCH_DTYPES:
        raise PlanError(f"stage {k}: unknown dtype '{sp.dtype}'; expected one of {sorted(TORCH_DTYPES)}")
    dtype = TORCH_DTYPES[sp.dtype]
    model, streamer = _base_model(plan, k, layout, dtype, device)
    lora = plan.model.lora
    lora_model = add_lora(model, lora, plan.train.seed if seed is None else seed)
    if lora_model is not None:
        lora_model.to(device)
        lora_model.train()  # as peft's model.train(): LoRA dropout on (and any dropout of the base)
    fam = family(plan.model.model_type)
    stage = Stage(k, device, dtype, layout, model, lora_model, sp.quantization, recompute_indices(plan, k, layout, chunk),
                  fam.embedding_multiplier(plan.model.architecture), fam.logits_scale(plan.model.architecture),
                  fam.softcap(model.config), fam.rotary_per_layer_type, streamer=streamer)
    if lora.init_from:
        from hetero.runtime.stage.adapter import load_adapter_state

        stage.load_lora_state(load_adapter_state(Path(lora.init_from), lora))
    return stage


def build_chunks(plan: Plan, k: int, device: torch.device, *, seed: int | None = None) -> list[Stage]:
    """Every chunk of stage k (one Stage each; one chunk but under an interleaved schedule)."""
    return [build_stage(plan, k, device, seed=seed, chunk=c) for c in range(len(plan.stages[k].spans()))]
