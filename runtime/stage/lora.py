"""LoRA's forward without peft's per-projection fp32 input copies.

peft casts each LoRA'd Linear's input to the adapter's dtype (fp32) before ``lora_A``, and autograd
keeps that copy for A's weight gradient: under bf16 q, k and v each keep their own fp32 copy of the
same normed hidden state (gate and up likewise), about half of what a decoder layer saves. Here the
same arithmetic runs in one autograd function that keeps the input as it arrived (one tensor,
shared by every projection that reads it) plus the r-wide fp32 output of A, and casts again in
backward. With lora.dropout > 0 it keeps a one-byte mask per element instead of a dropped-out copy.

Where the base layer is a plain ``nn.Linear`` whose weight has the input's and the adapter's dtype
(fp32 on CPU, or bf16 adapters on a bf16 model), base and adapter run as one fused linear
(``_LoraLinear``): the adapter's output is accumulated into the base GEMM's output (``addmm_``, the
scaling folded into the GEMM), and in backward the adapter's input gradient into the base's. That
drops, per adapted projection, a full-width delta tensor, its scaling multiply and the add, forward
and backward -- about a quarter of a W1 stage's compute on this CPU (docs/benchmarks.md). Peers
running stock peft pay them. The rounding of the delta differs from peft's by an ulp; fp32 training
equals plain peft to 1e-4 (tests/test_runtime_equivalence.py), and a run equals itself bit for bit.
Elsewhere (bitsandbytes 4-bit, bf16 base with fp32 adapters) the delta runs on its own, as peft
orders it.
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


class _LoraLinear(torch.autograd.Function):
    """x @ W^T + b + (dropout(x) @ A^T) @ B^T * scaling as one linear, for a frozen nn.Linear base.

    Saves what the unfused path saves (x, A's r-wide output, the dropout mask; weights are parameters).
    The r-wide products are computed r-rows-first (A @ x^T, not x @ A^T): on CPU BLAS the skinny
    orientation is ~4x slower at LoRA's shapes (measured 2026-11-23, docs/benchmarks.md)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a_weight: torch.Tensor,
                b_weight: torch.Tensor, scaling: float, p: float) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        out = x2.mm(weight.t()) if bias is None else torch.addmm(bias, x2, weight.t())
        mask = None
        xa = x2
        if p > 0:
            mask = torch.rand_like(x2) >= p
            xa = x2 * mask / (1.0 - p)
        a_t = a_weight.mm(xa.t())  # r x N
        out.addmm_(a_t.t(), b_weight.t(), alpha=scaling)
        ctx.scaling, ctx.p, ctx.has_bias = scaling, p, bias is not None
        ctx.save_for_backward(x, weight, a_weight, b_weight, a_t, mask)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, a_weight, b_weight, a_t, mask = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        grad_b = a_t.mm(g2).t().mul_(ctx.scaling)  # (g^T a) as (a^T g)^T
        ga_t = b_weight.t().mm(g2.t()).mul_(ctx.scaling)  # r x N: the gradient reaching A's output
        xa = x2 if mask is None else x2 * mask / (1.0 - ctx.p)
        grad_a = ga_t.mm(xa)
        grad_x = None
        if ctx.needs_input_grad[0]:
            gx = g2.mm(weight)
            if mask is None:
                gx.addmm_(ga_t.t(), a_weight)
            else:
                gx.add_(ga_t.t().mm(a_weight) * mask / (1.0 - ctx.p))
            grad_x = gx.view(x.shape)
        grad_bias = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias, grad_a, grad_b.contiguous(), None, None


def _fusable(module: Any, x: torch.Tensor) -> bool:
    """A frozen plain nn.Linear base, no hooks, the input's and the adapter's dtype on its weight."""
    base = module.base_layer
    return (type(base) is nn.Linear and not base.weight.requires_grad and not base._forward_hooks
            and not base._forward_pre_hooks and x.dtype == base.weight.dtype == module._hetero_a_dtype
            and x.device == base.weight.device and x.dim() >= 2)


def _forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """peft's vanilla single-adapter LoRA forward, through _LoraLinear or _LoraDelta."""
    name = self.active_adapters[0]
    dropout = self.lora_dropout[name]
    p = float(dropout.p) if isinstance(dropout, nn.Dropout) and dropout.training else 0.0
    if not args and not kwargs and _fusable(self, x):
        base = self.base_layer
        return _LoraLinear.apply(x, base.weight, base.bias, self.lora_A[name].weight, self.lora_B[name].weight,
                                 self.scaling[name], p)
    result = self.base_layer(x, *args, **kwargs)
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
        module._hetero_a_dtype = module.lora_A[module.active_adapters[0]].weight.dtype
        module.forward = types.MethodType(_forward, module)
        count += 1
    return count
