"""A mixture of experts' weights in NF4: each expert's matrices as bitsandbytes Linear4bit.

transformers keeps a MoE layer's experts as two 3-D tensors (``gate_up_proj`` [E, 2I, H], ``down_proj``
[E, H, I]) that bitsandbytes' Linear4bit cannot hold. ``NF4Experts`` takes their place: one Linear4bit per
expert matrix, so only the experts a token is routed to compute and each dequantizes its weight when used. The
experts are frozen; LoRA trains the attention (hetero/families.py).

It computes as transformers' experts of ``model.experts_implementation`` do:
- grouped (the default): one routing pass sorts the (token, slot) pairs by expert and reads the per-expert
  counts to the host once per layer; each expert then runs on its contiguous rows (no grouped matmul exists for
  NF4 weights, so the fewest kernels are one dequantize and two matmuls per used expert) and one index_add puts
  the weighted rows back;
- eager: transformers' per-expert loop (a ``torch.where`` and a host sync per expert), the reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class NF4Experts(nn.Module):
    """Every expert of one MoE layer, each matrix an NF4 Linear4bit; computes as transformers' experts."""

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module], act_fn: Callable[[torch.Tensor], torch.Tensor],
                 grouped: bool = True):
        super().__init__()
        self.num_experts = len(gate_up)
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)
        self.act_fn = act_fn
        self.grouped = grouped

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up[e](x).chunk(2, dim=-1)
        return self.down[e](self.act_fn(gate) * up)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        """``hidden_states`` [tokens, H]; each token's top-k experts and routing weights [tokens, k] (an index equal
        to the expert count is a slot routed nowhere, as transformers allows)."""
        if self.grouped:
            return self._grouped(hidden_states, top_k_index, top_k_weights)
        return self._eager(hidden_states, top_k_index, top_k_weights)

    def _grouped(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                 ) -> torch.Tensor:
        k = top_k_index.size(-1)
        flat = top_k_index.reshape(-1)
        with torch.no_grad():
            order = torch.argsort(flat, stable=True)  # the (token, slot) pairs by expert
            counts = torch.bincount(flat, minlength=self.num_experts + 1)[:self.num_experts].tolist()  # one sync
        rows = order[:sum(counts)]  # slots routed nowhere sort last and are dropped
        token = rows // k
        x = hidden_states[token]
        pieces, start = [], 0
        for e, n in enumerate(counts):
            if n:
                pieces.append(self._expert(e, x[start:start + n]))
                start += n
        out = torch.zeros_like(hidden_states)
        if pieces:
            y = torch.cat(pieces) * top_k_weights.reshape(-1)[rows, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    def _eager(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
               ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            # [experts + 1, k, tokens]: which token chose which expert in which of its k slots
            chosen = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            used = chosen.sum(dim=(-1, -2)).nonzero()
        for (e,) in used.tolist():
            if e == self.num_experts:
                continue
            slot, token = torch.where(chosen[e])
            y = self._expert(e, hidden_states[token]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def quantize_experts(layer: nn.Module, module: str, nf4: Callable[[torch.Tensor], nn.Module]) -> bool:
    """Replace the experts at ``module`` (a dotted path inside the decoder layer) with NF4Experts built by ``nf4``
    (a 2-D weight -> its Linear4bit), computing as the experts' config says (grouped unless eager); False when the
    layer has none there (a dense layer of a MoE model)."""
    parent_name, _, name = module.rpartition(".")
    parent = layer.get_submodule(parent_name) if parent_name else layer
    experts = getattr(parent, name, None)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.dim() != 3:
        return False
    grouped = getattr(getattr(experts, "config", None), "_experts_implementation", "grouped_mm") != "eager"
    setattr(parent, name, NF4Experts([nf4(w) for w in gate_up.data], [nf4(w) for w in down.data], experts.act_fn,
                                     grouped))
    return True
