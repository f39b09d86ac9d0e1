"""Experts fed inputs the router scales (Llama 4), computed for the tokens routed to them only.

transformers' Llama 4 block repeats every token once per expert, multiplies each copy by the router's score for that
expert (a sigmoid of the chosen experts' logits, 0 for the others) and runs all experts on all copies: E times the
work of the experts a token uses (16x for Scout). An expert fed a zero input outputs zero (its projections have no
biases, and SiLU(0) is 0), so computing the chosen experts only is exact, gradients included.

``routed_input_forward`` takes the block's place (``use_routed``): one routing pass sorts the (token, slot) pairs by
expert, each pair's input scaled by its score; the experts run as two grouped matmuls over the sorted rows where the
device has torch's grouped GEMM (runtime/stage/experts.py ``grouped_fast``), otherwise (and for NF4 experts) one pair
of matmuls per used expert after one host read of the counts; the rows go back to their pairs, each once, summed per token, and the
shared expert adds its output as transformers' block does.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from hetero.runtime.stage.experts import NF4Experts


def use_routed(model: nn.Module, module: str, grouped: bool) -> int:
    """Give every decoder layer's scaled-input experts block (the parent of ``module``, hetero/families.py) the
    routed forward: over grouped matmuls (``grouped``) or per used expert. Returns how many blocks."""
    parent_name = module.rpartition(".")[0]
    count = 0
    for layer in model.model.layers.values() if isinstance(model.model.layers, nn.ModuleDict) else model.model.layers:
        block = layer.get_submodule(parent_name) if parent_name else layer
        if not hasattr(block, "router") or not hasattr(block, "experts"):
            continue  # a dense layer
        block.forward = types.MethodType(routed_input_forward, block)
        block.hetero_grouped = grouped
        count += 1
    return count


def routed_input_forward(self: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's output and router logits, as transformers' Llama 4 block computes them."""
    h = hidden_states.reshape(-1, self.hidden_dim)
    scores, logits = self.router(h)  # scores [T, E]: sigmoid of the chosen experts' logits, 0 elsewhere
    chosen = torch.topk(logits, self.top_k, dim=1).indices
    routed = _run(self.experts, h, chosen, scores.gather(1, chosen), getattr(self, "hetero_grouped", True))
    return self.shared_expert(h) + routed, logits


def _run(experts: Any, h: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, grouped: bool) -> torch.Tensor:
    tokens, k = chosen.shape
    flat = chosen.reshape(-1)
    with torch.no_grad():
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=experts.num_experts)
    x = h.index_select(0, order // k) * weights.reshape(-1)[order, None].to(h.dtype)
    if grouped and not isinstance(experts, NF4Experts):
        from transformers.integrations.moe import _grouped_mm

        offsets = torch.cumsum(counts, 0).to(torch.int32)  # [E, H, 2I] and [E, I, H]: input-major, as it takes them
        gate, up = _grouped_mm(x, experts.gate_up_proj, offsets).chunk(2, dim=-1)
        y = _grouped_mm(up * experts.act_fn(gate), experts.down_proj, offsets)
    else:  # NF4 (each used expert dequantizes its matrices on its rows), or no fast grouped GEMM here
        expert = experts._expert if isinstance(experts, NF4Experts) else (lambda e, rows: _dense(experts, e, rows))
        pieces, start = [], 0
        for e, n in enumerate(counts.tolist()):  # the one host read
            if n:
                pieces.append(expert(e, x[start:start + n]))
                start += n
        y = torch.cat(pieces) if pieces else x.new_zeros(0, h.size(-1))
    out = h.new_zeros(tokens * k, h.size(-1))
    if y.numel():
        out = out.index_copy(0, order, y.to(h.dtype))
    return out.view(tokens, k, -1).sum(dim=1)


def _dense(experts: Any, e: int, rows: torch.Tensor) -> torch.Tensor:
    gate, up = (rows @ experts.gate_up_proj[e]).chunk(2, dim=-1)
    return (up * experts.act_fn(gate)) @ experts.down_proj[e]
