"""A stage's frozen weights: read exactly its tensors from the safetensors files, cast, quantize to NF4.

safetensors and bitsandbytes are imported inside the functions that use them: a stage without nf4
never imports bitsandbytes (seconds of CPU at start, and it pulls in torch._inductor).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from hetero.errors import CheckpointError
from hetero.runtime.pretrained import weight_index

TIED_HEAD, TIED_SOURCE = "lm_head.weight", "model.embed_tokens.weight"


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


def _sources(wanted: list[str], index: dict[str, str], model_dir: Path, k: int, tied: bool) -> dict[str, str]:
    """Where each of the stage's tensors is stored: its own name, or the embedding for a tied head."""
    sources = {}
    for name in wanted:
        source = name
        if source not in index and tied and name == TIED_HEAD:
            source = TIED_SOURCE  # tied head: the checkpoint stores the embedding only
        if source not in index:
            raise CheckpointError(
                f"stage {k}: tensor '{source}' is not in the weights at {model_dir}; "
                "the weights do not match model.architecture"
            )
        sources[name] = source
    return sources


def load_weights(model: nn.Module, model_dir: Path, dtype: torch.dtype, k: int, tied: bool) -> None:
    """Load exactly stage k's tensors into ``model`` (on the meta device), cast to ``dtype``."""
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items() if not n.endswith("rotary_emb.inv_freq")}
    sources = _sources(list(expected), weight_index(model_dir), model_dir, k, tied)
    read = load_tensors(model_dir, sorted(set(sources.values())))
    state: dict[str, torch.Tensor] = {}
    for name, source in sources.items():
        t = read[source] if source == name else read[source].clone()  # a tied head keeps its own copy, as loaded
        if tuple(t.shape) != expected[name]:
            raise CheckpointError(
                f"stage {k}: '{name}' has shape {tuple(t.shape)} in {model_dir}, the architecture says {expected[name]}"
            )
        state[name] = t.to(dtype) if t.is_floating_point() else t
    # strict=False only because rotary inv_freq is computed, not loaded; every other key was checked above.
    model.load_state_dict(state, strict=False, assign=True)


def quantize_nf4(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Replace the decoder layers' nn.Linear with bitsandbytes NF4 Linear4bit on ``device``; returns how many."""
    count = 0
    for layer in model.model.layers.values():
        for parent in list(layer.modules()):
            for child_name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, child_name, _nf4_linear(child, dtype, device))
                    count += 1
    return count


def _nf4_linear(child: nn.Linear, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """One nn.Linear as an NF4 Linear4bit computing in ``dtype`` on ``device``."""
    import bitsandbytes as bnb

    q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None, compute_dtype=dtype,
                          compress_statistics=False, quant_type="nf4", device="meta")
    q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4",
                                 compress_statistics=False, module=q)
    if child.bias is not None:
        q.bias = nn.Parameter(child.bias.data, requires_grad=False)
    q = q.to(device)  # bitsandbytes quantizes when the weight moves to a device
    # On a CPU with AVX512-BF16, an eval-mode forward of an input without grad repacks the
    # weight into a CPU-only layout whose matmul has no input gradient: later training steps
    # would silently stop back-propagating through this stage. Keep the portable layout.
    q.support_avx512bf16_for_cpu = False
    return q
