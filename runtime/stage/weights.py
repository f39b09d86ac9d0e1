"""A stage's frozen weights: read exactly its tensors from the safetensors files, cast, quantize to NF4.

safetensors and bitsandbytes are imported inside the functions that use them: a stage without nf4
never imports bitsandbytes (seconds of CPU at start, and it pulls in torch._inductor).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hetero.errors import CheckpointError
from hetero.families import Experts, Family, stored_names
from hetero.runtime.pretrained import weight_index
from hetero.runtime.wire.frames import accumulate_dtype

TIED_HEAD, TIED_SOURCE = "lm_head.weight", "model.embed_tokens.weight"
_LAYER_PREFIX = re.compile(r"^(model\.layers\.\d+\.)(.+)$")


def load_tensors(model_dir: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Read just ``names`` from the model's safetensors files, opening each needed file once."""
    from safetensors import safe_open

    index = weight_index(model_dir)
    missing = [n for n in names if n not in index]
    if missing:
        raise CheckpointError(f"{model_dir}: missing tensors {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    by_file: dict[str, list[str]] = defaultdict(list)
    for name in names:
        by_file[index[name]].append(name)
    out: dict[str, torch.Tensor] = {}
    for file, file_names in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in file_names:
                out[name] = f.get_tensor(name)
    return out


@dataclass(frozen=True)
class Mxfp4:
    """A fused expert tensor stored in MXFP4 (gpt-oss's hub checkpoints): ``{name}_blocks`` [E, out, G, 16] of
    packed 4-bit E2M1 codes (two per byte, the low nibble first) and ``{name}_scales`` [E, out, G] of shared
    power-of-two exponents (biased by 127), one per 32 consecutive input values (the OCP microscaling format)."""

    blocks: str
    scales: str


# E2M1 (fp4) values by code: sign bit, two exponent bits, one mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# a stored name, per expert the stored parts of a fused tensor, or MXFP4 blocks and scales
Source = str | tuple[tuple[str, ...], ...] | Mxfp4


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str = "experts") -> torch.Tensor:
    """MXFP4 ``blocks`` [E, out, G, 16] and ``scales`` [E, out, G] -> the bf16 tensor [E, in, out] (in = 32 G) that
    transformers' gpt-oss experts hold (exact: an fp4 value times a power of two fits bf16), one expert at a time
    (a whole gpt-oss-120b projection's codes at once would take tens of GB)."""
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise CheckpointError(f"'{name}': MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not "
                              "match ([experts, out, groups, 16] and [experts, out, groups]); the checkpoint is damaged "
                              "or not gpt-oss's")
    experts, rows, groups, _ = blocks.shape
    lut = torch.tensor(FP4_VALUES, dtype=torch.bfloat16)
    out = torch.empty(experts, groups * 32, rows, dtype=torch.bfloat16)
    for e in range(experts):
        codes = torch.stack([blocks[e] & 0x0F, blocks[e] >> 4], dim=-1).flatten(-2).to(torch.int32)  # [out, G, 32]
        scale = torch.exp2(scales[e].to(torch.float32) - 127).to(torch.bfloat16).unsqueeze(-1)
        out[e] = (lut[codes] * scale).flatten(-2).t()
    return out


def _stored_as(name: str, experts: Experts | None, num_experts: int) -> Source | None:
    """How a checkpoint stores HF tensor ``name`` under another name: a MoE layer's fused experts as one weight
    per expert (hetero/families.py), a renamed router; None: under its own name."""
    match = _LAYER_PREFIX.match(name)
    if experts is None or match is None:
        return None
    layer, rel = match.groups()
    parts = dict(experts.stored).get(rel)
    if parts is not None:
        return tuple(tuple(layer + part.format(e=e) for part in parts) for e in range(num_experts))
    renamed = dict(experts.renamed).get(rel)
    return layer + renamed if renamed else None


def _sources(wanted: dict[str, tuple[int, ...]], index: dict[str, str], model_dir: Path, k: int, tied: bool,
             fam: Family | None = None) -> dict[str, Source]:
    """Where each of the stage's tensors is stored: its own name, the embedding for a tied head, or its family's
    checkpoint names (experts stored one by one, a multimodal checkpoint's language model under a prefix)."""
    sources: dict[str, Source] = {}
    for name, shape in wanted.items():
        source: Source = name
        if name not in index:
            if tied and name == TIED_HEAD:
                source = TIED_SOURCE  # tied head: the checkpoint stores the embedding only
            elif f"{name}_blocks" in index and f"{name}_scales" in index:
                source = Mxfp4(f"{name}_blocks", f"{name}_scales")
            else:
                source = _stored_as(name, fam.experts if fam else None, shape[0] if shape else 0) or name
            if isinstance(source, str) and source not in index and fam is not None:
                source = next((n for n in stored_names(fam, source) if n in index), source)
        missing = [n for n in _flat(source) if n not in index]
        if missing:
            raise CheckpointError(
                f"stage {k}: tensor '{missing[0]}' is not in the weights at {model_dir}; "
                "the weights do not match model.architecture"
            )
        sources[name] = source
    return sources


def _flat(source: Source) -> list[str]:
    if isinstance(source, Mxfp4):
        return [source.blocks, source.scales]
    return [source] if isinstance(source, str) else [n for parts in source for n in parts]


def _assemble(source: Source, read: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The tensor ``name`` from what was read: itself (a tied head's own copy), or its experts stacked, each the
    concatenation of its stored parts (gate and up projections), or dequantized from MXFP4."""
    if isinstance(source, Mxfp4):
        return dequantize_mxfp4(read[source.blocks], read[source.scales], name)
    if isinstance(source, str):
        return read[source] if source == name else read[source].clone()
    try:
        return torch.stack([torch.cat([read[part] for part in parts], dim=0) for parts in source])
    except RuntimeError:  # experts of different shapes
        shapes = sorted({tuple(read[part].shape) for parts in source for part in parts})
        raise CheckpointError(f"'{name}': its experts are stored with different shapes {shapes[:4]}; the weights "
                              "do not match model.architecture") from None


def load_weights(model: nn.Module, model_dir: Path, dtype: torch.dtype, k: int, tied: bool,
                 fam: Family | None = None) -> None:
    """Load exactly stage k's tensors into ``model`` (on the meta device), cast to ``dtype``, where ``fam``'s
    checkpoints keep them."""
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items() if not n.endswith("rotary_emb.inv_freq")}
    sources = _sources(expected, weight_index(model_dir), model_dir, k, tied, fam)
    read = load_tensors(model_dir, sorted({n for source in sources.values() for n in _flat(source)}))
    state: dict[str, torch.Tensor] = {}
    # What transformers keeps in fp32 whatever the (half) compute dtype (DeepSeek's and GLM-4.5's routers and correction
    # biases): rounded to bf16 they would pick other experts than the model trained with.
    wide = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    for name, source in sources.items():
        t = _assemble(source, read, name)
        if tuple(t.shape) != expected[name]:
            raise CheckpointError(
                f"stage {k}: '{name}' has shape {tuple(t.shape)} in {model_dir}, the architecture says {expected[name]}"
            )
        kept = any(name == m or name.endswith("." + m) or f".{m}." in name for m in wide)
        state[name] = t.to(accumulate_dtype(dtype) if kept else dtype) if t.is_floating_point() else t
    # strict=False only because rotary inv_freq is computed, not loaded; every other key was checked above.
    model.load_state_dict(state, strict=False, assign=True)


def quantize_nf4(model: nn.Module, dtype: torch.dtype, device: torch.device, experts: Experts | None = None,
                 after_layer: Callable[[int, nn.Module], None] | None = None) -> int:
    """Replace the decoder layers' nn.Linear with bitsandbytes NF4 Linear4bit on ``device``, and a mixture of
    experts' 3-D weights with one Linear4bit per expert matrix (runtime/stage/experts.py); returns how many
    modules were replaced (a layer's experts count once, as one NF4Experts). ``after_layer`` (index, layer) is
    called as each layer is done (weight streaming takes its Linears to host memory there)."""
    from hetero.runtime.stage.experts import quantize_experts

    count = 0
    for index, layer in model.model.layers.items():
        if experts is not None and quantize_experts(layer, experts.module, lambda w, b: _nf4(w, b, dtype, device),
                                                    experts.transposed):
            count += 1
        for parent in list(layer.modules()):
            for child_name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, child_name, _nf4(child.weight.data, child.bias, dtype, device))
                    count += 1
        if after_layer is not None:
            after_layer(int(index), layer)
    return count


def _nf4(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A Linear of ``weight`` [out, in] (and ``bias``) as an NF4 Linear4bit computing in ``dtype`` on ``device``."""
    import bitsandbytes as bnb

    out_features, in_features = weight.shape
    q = bnb.nn.Linear4bit(in_features, out_features, bias=bias is not None, compute_dtype=dtype,
                          compress_statistics=False, quant_type="nf4", device="meta")
    q.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", compress_statistics=False, module=q)
    if bias is not None:
        q.bias = nn.Parameter(bias.data, requires_grad=False)
    q = q.to(device)  # bitsandbytes quantizes when the weight moves to a device
    # On a CPU with AVX512-BF16, an eval-mode forward of an input without grad repacks the
    # weight into a CPU-only layout whose matmul has no input gradient: later training steps
    # would silently stop back-propagating through this stage. Keep the portable layout.
    q.support_avx512bf16_for_cpu = False
    return q
