"""A mixture of experts' weights in NF4: each expert's matrices as bitsandbytes Linear4bit.

transformers keeps a MoE layer's experts as two 3-D tensors (``gate_up_proj`` [E, 2I, H], ``down_proj``
[E, H, I]) that bitsandbytes' Linear4bit cannot hold. ``NF4Experts`` takes their place: one Linear4bit per
expert matrix, and the forward of transformers' per-expert loop (the same for Qwen3-MoE and Mixtral), so only
the experts a token is routed to compute and each dequantizes its weight when used. The experts are frozen;
LoRA trains the attention (hetero/families.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class NF4Experts(nn.Module):
    """Every expert of one MoE layer, each matrix an NF4 Linear4bit; computes as transformers' eager experts."""

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module], act_fn: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.num_experts = len(gate_up)
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)
        self.act_fn = act_fn

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        """``hidden_states`` [tokens, H]; each token's top-k experts and routing weights [tokens, k]."""
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            # [experts + 1, k, tokens]: which token chose which expert in which of its k slots (index E: none, as
            # transformers allows)
            chosen = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            used = chosen.sum(dim=(-1, -2)).nonzero()
        for (e,) in used.tolist():
            if e == self.num_experts:
                continue
            slot, token = torch.where(chosen[e])
            gate, up = self.gate_up[e](hidden_states[token]).chunk(2, dim=-1)
            y = self.down[e](self.act_fn(gate) * up) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def quantize_experts(layer: nn.Module, module: str, nf4: Callable[[torch.Tensor], nn.Module]) -> bool:
    """Replace the experts at ``module`` (a dotted path inside the decoder layer) with NF4Experts built by ``nf4``
    (a 2-D weight -> its Linear4bit); False when the layer has none there (a dense layer of a MoE model)."""
    parent_name, _, name = module.rpartition(".")
    parent = layer.get_submodule(parent_name) if parent_name else layer
    experts = getattr(parent, name, None)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.dim() != 3:
        return False
    setattr(parent, name, NF4Experts([nf4(w) for w in gate_up.data], [nf4(w) for w in down.data], experts.act_fn))
    return True
