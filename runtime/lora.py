"""LoRA's forward without peft's per-projection fp32 input copies.

peft casts each LoRA'd Linear's input to the adapter's dtype (fp32) before ``lora_A``, and autograd
keeps that copy for A's weight gradient: under bf16 q, k and v each keep their own fp32 copy of the
same normed hidden state (gate and up likewise), about half of what a decoder layer saves. Here the
same arithmetic runs in one autograd function that keeps the input as it arrived (one tensor,
shared by every projection that reads it) plus the r-wide fp32 output of A, and casts again in
backward. With lora.dropout > 0 it keeps a one-byte mask per element instead of a dropped-out copy.

Numbers are peft's: the same ops in the same order (F.linear, scaling, the cast back to the base
layer's dtype), so fp32 training equals plain peft (tests/test_runtime_equivalence.py).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class _LoraDelta(torch.autograd.Function):
    """(dropout(x) @ A^T) @ B^T * scaling in A's dtype; saves x (not a cast copy), the mask and A's output."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, a_weight: torch.Tensor, b_weight: torch.Tensor, scaling: float,
                p: float) -> torch.Tensor:
        xa = x.to(a_weight.dtype)
        mask = None
        if p > 0:
            mask = torch.rand_like(xa) >= p
            xa = xa * mask / (1.0 - p)
        a = F.linear(xa, a_weight)
        ctx.scaling, ctx.p = scaling, p
        ctx.save_for_backward(x, a_weight, b_weight, a, mask)
        return F.linear(a, b_weight) * scaling

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, a_weight, b_weight, a, mask = ctx.saved_tensors
        g = grad * ctx.scaling
        g2, a2 = g.reshape(-1, g.shape[-1]), a.reshape(-1, a.shape[-1])
        grad_b = g2.t().mm(a2)
        ga = g.matmul(b_weight)
        xa = x.to(a_weight.dtype)
        if mask is not None:
            xa = xa * mask / (1.0 - ctx.p)
        grad_a = ga.reshape(-1, ga.shape[-1]).t().mm(xa.reshape(-1, xa.shape[-1]))
        grad_x = None
        if ctx.needs_input_grad[0]:
            gx = ga.matmul(a_weight)
            if mask is not None:
                gx = gx * mask / (1.0 - ctx.p)
            grad_x = gx.to(x.dtype)
        return grad_x, grad_a, grad_b, None, None


def _forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """peft's vanilla single-adapter LoRA forward, through _LoraDelta."""
    name = self.active_adapters[0]
    result = self.base_layer(x, *args, **kwargs)
    dropout = self.lora_dropout[name]
    p = float(dropout.p) if isinstance(dropout, nn.Dropout) and dropout.training else 0.0
    delta = _LoraDelta.apply(x, self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name], p)
    if self._hetero_cast_first:  # peft's bitsandbytes layers cast the LoRA output before adding it
        return result + delta.to(result.dtype)
    return (result + delta).to(result.dtype)


def _plain(module: Any) -> bool:
    """One vanilla adapter (no DoRA or other variant), not merged, adapters on."""
    names = list(module.active_adapters)
    return (len(names) == 1 and names[0] in module.lora_A and not module.merged and not module.disable_adapters
            and names[0] not in getattr(module, "lora_variant", {}))


def share_lora_inputs(model: nn.Module) -> int:
    """Route every plain LoRA Linear of ``model`` through _LoraDelta; returns how many."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    count = 0
    for module in model.modules():
        if not hasattr(module, "lora_A") or not hasattr(module, "base_layer"):
            continue
        is_linear = isinstance(module, LoraLinear)
        is_4bit = type(module).__name__ == "Linear4bit" and type(module).__module__.startswith("peft.")
        if not (is_linear or is_4bit) or not _plain(module):
            continue
        module._hetero_cast_first = is_4bit
        module.forward = types.MethodType(_forward, module)
        count += 1
    return count
