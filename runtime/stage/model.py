"""One pipeline stage: only this stage's layers of the HF CausalLM, its own weights, quantized, with LoRA.

The stage keeps the full model's module tree and names (decoder layers stay under their original
index in an ``nn.ModuleDict``), so every parameter name equals the whole model's and peft's
``get_peft_model_state_dict`` keys are in whole-model key space: the trained adapter is simply the
union of the stages' states.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.utils.checkpoint
from torch import nn

from hetero.errors import CheckpointError, PlanError, UnsupportedModelError
from hetero.plan import Plan
from hetero.runtime.stage.lora import share_lora_inputs

# Families whose CausalLM is `model.{embed_tokens, layers, norm, rotary_emb}` + `lm_head`, whose decoder
# layer takes (hidden, attention_mask, position_ids, position_embeddings), and whose model forward adds
# nothing else between those modules (Gemma scales embeddings, so it is not here).
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def peft_key(param_name: str, adapter: str = "default") -> str:
    """The PEFT state-dict key of a LoRA parameter name (peft drops the adapter name)."""
    return param_name.replace(f".{adapter}.", ".")


@dataclass
class StageLayout:
    """Which parts of the model stage k holds (from the plan's node span)."""

    embed: bool
    layers: list[int]
    norm: bool
    head: bool


def stage_layout(plan: Plan, k: int) -> StageLayout:
    """Read stage k's node span from the plan's LayerGraph."""
    if not 0 <= k < len(plan.stages):
        raise PlanError(f"stage {k} does not exist: the plan has {len(plan.stages)} stages (0..{len(plan.stages) - 1})")
    sp = plan.stages[k]
    nodes = plan.graph.nodes[sp.first_node : sp.last_node + 1]
    if not nodes:
        raise PlanError(f"stage {k}: empty node span {sp.first_node}..{sp.last_node}; recompile the plan")
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


def recompute_indices(plan: Plan, k: int, layout: StageLayout) -> frozenset[int]:
    """Decoder layer indices of stage k that the plan says recompute; they must be the stage's own."""
    found = set()
    for name in plan.stages[k].recompute_layers:
        m = _LAYER_RE.search(name)
        if m is None or int(m.group(1)) not in layout.layers:
            raise PlanError(f"stage {k}: recompute_layers names '{name}', not one of this stage's decoder layers; "
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
    peft_model: nn.Module | None  # the PeftModel around it (None when no LoRA target lives here)
    quantization: str
    recompute: frozenset[int] = frozenset()  # decoder layer indices that recompute in backward

    # The first stage of a pipeline holds the embedding, the last the LM head (every replica has both).
    @property
    def is_first(self) -> bool:
        return self.layout.embed

    @property
    def is_last(self) -> bool:
        return self.layout.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Stage 0 takes input ids [B, S]; others hidden states [B, S, H]. The last stage returns logits."""
        inner = self.model.model
        h = inner.embed_tokens(x) if self.layout.embed else x
        seq = h.shape[1]
        # Every stage rebuilds positions and rotary cos/sin: cheaper than sending them.
        position_ids = torch.arange(seq, device=h.device).unsqueeze(0)
        position_embeddings = inner.rotary_emb(h, position_ids)
        training = torch.is_grad_enabled()
        for index, layer in inner.layers.items():
            # attention_mask=None: causal SDPA; right padding needs no mask (pads only follow real tokens).
            kwargs = {"attention_mask": None, "position_ids": position_ids, "position_embeddings": position_embeddings}
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
        if self.layout.head:
            h = self.model.lm_head(h)
        return h

    def lora_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Trainable parameters (the LoRA matrices), in module order."""
        root = self.peft_model if self.peft_model is not None else self.model
        return [(n, p) for n, p in root.named_parameters() if p.requires_grad]

    def lora_parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.lora_named_parameters()]

    def lora_state(self) -> dict[str, torch.Tensor]:
        """This stage's LoRA weights in whole-model PEFT key space, as CPU float32 copies."""
        if self.peft_model is None:
            return {}
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.peft_model)
        return {k: v.detach().to("cpu", torch.float32).clone() for k, v in state.items()}

    def load_lora_state(self, state: dict[str, torch.Tensor], *, strict: bool = True) -> list[str]:
        """Copy LoRA weights (whole-model key space) into this stage; returns the keys it took."""
        if self.peft_model is None:
            return []
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        mine = set(get_peft_model_state_dict(self.peft_model))
        taken = {k: v for k, v in state.items() if k in mine}
        missing = sorted(mine - set(taken))
        if strict and missing:
            raise CheckpointError(
                f"stage {self.index}: the adapter lacks {len(missing)} LoRA tensor(s) of this stage "
                f"(first: {missing[0]}); it was trained with other lora.target_modules or another model"
            )
        with torch.no_grad():
            set_peft_model_state_dict(self.peft_model, taken)
        return sorted(taken)


def _build_config(architecture: dict):
    from transformers import AutoConfig

    arch = dict(architecture)
    model_type = arch.pop("model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"the runtime cannot split model_type '{model_type}'; supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    config = AutoConfig.for_model(model_type, **arch)
    # SDPA with attention_mask=None is causal; eager attention without a mask would not be.
    config._attn_implementation = "sdpa"
    return config


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
    return model


def _load_weights(model: nn.Module, model_dir: Path, dtype: torch.dtype, k: int, tied: bool) -> None:
    """Load exactly this stage's tensors, opening only the safetensors files that hold them."""
    from safetensors import safe_open

    from hetero.pretrained import weight_index

    index = weight_index(model_dir)
    wanted = [n for n in model.state_dict() if not n.endswith("rotary_emb.inv_freq")]
    by_file: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for name in wanted:
        source = name
        if source not in index and tied and name == "lm_head.weight":
            source = "model.embed_tokens.weight"  # tied head: the checkpoint stores the embedding only
        if source not in index:
            raise CheckpointError(
                f"stage {k}: tensor '{source}' is not in the weights at {model_dir}; "
                "the weights do not match model.architecture"
            )
        by_file[index[source]].append((name, source))
    state: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        path = Path(file) if Path(file).is_absolute() else model_dir / file
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name, source in names:
                t = f.get_tensor(source)
                state[name] = t.to(dtype) if t.is_floating_point() else t
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    for name, t in state.items():
        if tuple(t.shape) != shapes[name]:
            raise CheckpointError(
                f"stage {k}: '{name}' has shape {tuple(t.shape)} in {model_dir}, the architecture says {shapes[name]}"
            )
    # strict=False only because rotary inv_freq is computed, not loaded; every other key was checked above.
    model.load_state_dict(state, strict=False, assign=True)


def _quantize_nf4(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Replace the decoder layers' nn.Linear with bitsandbytes NF4 Linear4bit; returns how many."""
    import bitsandbytes as bnb

    count = 0
    for layer in model.model.layers.values():
        for parent in list(layer.modules()):
            for child_name, child in list(parent.named_children()):
                if type(child) is not nn.Linear:
                    continue
                q = bnb.nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    compute_dtype=dtype,
                    compress_statistics=False,
                    quant_type="nf4",
                    device="meta",
                )
                q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4",
                                             compress_statistics=False, module=q)
                if child.bias is not None:
                    q.bias = nn.Parameter(child.bias.data, requires_grad=False)
                q = q.to(device)  # bitsandbytes quantizes when the weight moves to a device
                # On a CPU with AVX512-BF16, an eval-mode forward of an input without grad repacks the
                # weight into a CPU-only layout whose matmul has no input gradient: later training steps
                # would silently stop back-propagating through this stage. Keep the portable layout.
                q.support_avx512bf16_for_cpu = False
                setattr(parent, child_name, q)
                count += 1
    return count


def _init_lora_deterministically(peft_model: nn.Module, seed: int) -> None:
    """Initialise each lora_A from a generator keyed by (seed, parameter name), like peft's kaiming init.

    The initial adapter then does not depend on how the model is split into stages.
    """
    for name, p in peft_model.named_parameters():
        if "lora_A" in name and p.requires_grad:
            key = hashlib.sha256(f"{seed}:{name}".encode()).digest()
            gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(key[:8], "little"))
            w = torch.empty(p.shape, dtype=torch.float32)
            nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=gen)
            with torch.no_grad():
                p.copy_(w.to(p.dtype))


def build_stage(plan: Plan, k: int, device: torch.device, *, seed: int | None = None) -> Stage:
    """Build stage k of the plan on ``device``: its weights only, cast/quantized, with LoRA added."""
    from peft import LoraConfig, get_peft_model

    from hetero.pretrained import resolve_dir

    layout = stage_layout(plan, k)
    sp = plan.stages[k]
    if sp.dtype not in TORCH_DTYPES:
        raise PlanError(f"stage {k}: unknown dtype '{sp.dtype}'; expected one of {sorted(TORCH_DTYPES)}")
    dtype = TORCH_DTYPES[sp.dtype]
    config = _build_config(plan.model.architecture)
    model = _skeleton(config, layout)
    model_dir = resolve_dir(plan.model)
    _load_weights(model, model_dir, dtype, k, tied=bool(getattr(config, "tie_word_embeddings", False)))
    model.requires_grad_(False)
    if sp.quantization == "nf4":
        # Quantize layer by layer while moving to the device: the unquantized stage never sits in device memory.
        _quantize_nf4(model, dtype, device)
    elif sp.quantization not in ("none", ""):
        raise PlanError(f"stage {k}: quantization '{sp.quantization}' is not supported by the runtime (none, nf4)")
    model.to(device)
    model.eval()  # dropout off in the frozen base; LoRA dropout follows lora.dropout via train()

    lora = plan.model.lora
    targets = set(lora.target_modules)
    has_target = any(name.rsplit(".", 1)[-1] in targets for name, _ in model.named_modules())
    peft_model = None
    if has_target:
        config_lora = LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )
        peft_model = get_peft_model(model, config_lora)
        _init_lora_deterministically(peft_model, plan.train.seed if seed is None else seed)
        peft_model.to(device)
        peft_model.train()
        share_lora_inputs(peft_model)
    stage = Stage(k, device, dtype, layout, model, peft_model, sp.quantization,
                  recompute_indices(plan, k, layout))
    if lora.init_from:
        from hetero.runtime.run.adapter import load_adapter_state

        stage.load_lora_state(load_adapter_state(Path(lora.init_from), lora))
    return stage
