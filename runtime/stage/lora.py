"""LoRA for a stage, built without peft, and its forward without peft's per-projection fp32 input copies.

``add_lora`` wraps each target Linear of a stage in ``LoraLinear``, which is peft's ``lora.Linear`` for
one plain adapter: the same module and parameter names (``base_model.model.<module>.lora_A.default.weight``
under ``LoraModel``), the same initialisation and draws from the global RNG, the same dtypes (fp32
adapters on the base layer's device), scaling alpha / r, dropout on the adapter's input. Its state is
peft's (``lora_state`` has ``get_peft_model_state_dict``'s keys). A stage process so never imports peft
(seconds of CPU at start); ``share_lora_inputs`` gives a real peft model the same forward (the profiler
and the tests build one with peft).

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
equals plain peft to 1e-4 (tests/e2e/test_runtime_equivalence.py), and a run equals itself bit for bit.
Elsewhere (bitsandbytes 4-bit, bf16 base with fp32 adapters) the delta runs on its own, as peft
orders it.
"""

from __future__ import annotations

import hashlib
import math
import types
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetero.errors import CheckpointError, PlanError
from hetero.runtime.stage.streaming import StreamedLinear
from hetero.runtime.wire.frames import accumulate_dtype
from hetero.specs import LoraSpec

ADAPTER = "default"  # peft's adapter name: part of every LoRA parameter name, dropped from the PEFT keys


def peft_key(param_name: str, adapter: str = ADAPTER) -> str:
    """The PEFT state-dict key of a LoRA parameter name (peft drops the adapter name)."""
    return param_name.replace(f".{adapter}.", ".")


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
    orientation is ~4x slower at LoRA's shapes (measured 2026-11-23, docs/benchmarks.md).

    A StreamedLinear base (``streamed``) is not saved: its weight is fetched from the stage's WeightStreamer again
    in backward, exactly when _StreamedMatmul would fetch it, so the copies are the unfused path's.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a_weight: torch.Tensor,
                b_weight: torch.Tensor, scaling: float, p: float, streamed: StreamedLinear | None = None
                ) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        out = x2.mm(weight.t()) if bias is None else torch.addmm(bias, x2, weight.t())
        mask = None
        xa = x2
        if p > 0:
            mask = torch.rand_like(x2) >= p
            xa = x2 * mask / (1.0 - p)
        a_t = a_weight.mm(xa.t())  # r x N
        out.addmm_(a_t.t(), b_weight.t(), alpha=scaling)
        ctx.scaling, ctx.p, ctx.has_bias, ctx.streamed = scaling, p, bias is not None, streamed
        ctx.save_for_backward(x, None if streamed is not None else weight, a_weight, b_weight, a_t, mask)
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
            if ctx.streamed is not None:
                weight = ctx.streamed.dense_weight(g2.dtype)
            gx = g2.mm(weight)
            if mask is None:
                gx.addmm_(ga_t.t(), a_weight)
            else:
                gx.add_(ga_t.t().mm(a_weight) * mask / (1.0 - ctx.p))
            grad_x = gx.view(x.shape)
        grad_bias = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias, grad_a, grad_b.contiguous(), None, None, None


def _fusable(base: nn.Module, a_weight: torch.Tensor, x: torch.Tensor) -> bool:
    """A frozen plain nn.Linear base (or a streamed one, not NF4), no hooks, the input's and the adapter's dtype on
    its weight."""
    if base._forward_hooks or base._forward_pre_hooks or x.dim() < 2:
        return False
    if isinstance(base, StreamedLinear):
        return (base.host.nf4 is None and x.dtype == base.host.tensors[0].dtype == a_weight.dtype
                and x.device == base.device)
    return (type(base) is nn.Linear and not base.weight.requires_grad and x.dtype == base.weight.dtype == a_weight.dtype
            and x.device == base.weight.device)


def lora_linear(base: nn.Module, x: torch.Tensor, a_weight: torch.Tensor, b_weight: torch.Tensor, scaling: float,
                dropout: nn.Module, cast_first: bool, *args: Any, **kwargs: Any) -> torch.Tensor:
    """peft's vanilla single-adapter LoRA forward, through _LoraLinear or _LoraDelta.

    ``cast_first``: add the delta cast to the base output's dtype (peft's bitsandbytes layers), rather than
    add in the delta's dtype and cast the sum (peft's ``lora.Linear``)."""
    p = float(dropout.p) if isinstance(dropout, nn.Dropout) and dropout.training else 0.0
    if not args and not kwargs and _fusable(base, a_weight, x):
        if isinstance(base, StreamedLinear):  # fetched now (copied if not resident), not saved: see _LoraLinear
            tensors = base.streamer.weights(base.layer, base.slot)
            bias = tensors[-1] if base.host.has_bias else None
            return _LoraLinear.apply(x, tensors[0], bias, a_weight, b_weight, scaling, p, base)
        return _LoraLinear.apply(x, base.weight, base.bias, a_weight, b_weight, scaling, p)
    result = base(x, *args, **kwargs)
    delta = _LoraDelta.apply(x, a_weight, b_weight, scaling, p)
    if cast_first:
        return result + delta.to(result.dtype)
    return (result + delta).to(result.dtype)


class LoraLinear(nn.Module):
    """A frozen Linear (nn.Linear, bitsandbytes Linear4bit, or either streamed from host memory: StreamedLinear)
    with one LoRA adapter: peft's ``lora.Linear``.

    Children are registered in peft's order and under peft's names (``base_layer``, ``lora_dropout.default``,
    ``lora_A.default``, ``lora_B.default``), so parameter names, their order and the PEFT keys are peft's.
    peft wraps a Linear4bit it did not load itself (the stage quantizes its own weights) in this same class,
    so the sum is formed in the adapter's dtype and then cast (``cast_first`` False) for both bases.
    """

    def __init__(self, base: nn.Linear | StreamedLinear, r: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_dropout = nn.ModuleDict({ADAPTER: nn.Dropout(p=dropout) if dropout > 0.0 else nn.Identity()})
        # Created and initialised as peft does (nn.Linear's own init, then kaiming A and zero B): the same
        # draws from the global RNG, which later draws the dropout masks.
        self.lora_A = nn.ModuleDict({ADAPTER: nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({ADAPTER: nn.Linear(r, base.out_features, bias=False)})
        nn.init.kaiming_uniform_(self.lora_A[ADAPTER].weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B[ADAPTER].weight)
        # peft moves the adapter to the base's device and upcasts a half-precision one: fp32 there (float64 over a
        # float64 base, as peft keeps it; a quantized base's weight is not a float: fp32).
        device = base.device if isinstance(base, StreamedLinear) else base.weight.device
        weight = None if isinstance(base, StreamedLinear) else base.weight
        dtype = accumulate_dtype(weight.dtype) if weight is not None and weight.is_floating_point() else torch.float32
        self.lora_A.to(device, dtype)
        self.lora_B.to(device, dtype)
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The base layer's output plus the scaled adapter's."""
        return lora_linear(self.base_layer, x, self.lora_A[ADAPTER].weight, self.lora_B[ADAPTER].weight,
                           self.scaling, self.lora_dropout[ADAPTER], False, *args, **kwargs)


class _Tuner(nn.Module):
    """peft's ``LoraModel`` level: holds the model as ``.model``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


class LoraModel(nn.Module):
    """The stage's model under peft's prefix (``base_model.model.``): parameter names equal a PeftModel's."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.base_model = _Tuner(model)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's forward, as a PeftModel's (a stage runs its parts through Stage.forward)."""
        return self.base_model.model(*args, **kwargs)


def _is_target(name: str, targets: Iterable[str]) -> bool:
    """peft's rule for a list of target_modules: the module's full name, or its name ends with '.<target>'."""
    return any(name == t or name.endswith(f".{t}") for t in targets)


def add_lora(model: nn.Module, lora: LoraSpec, seed: int) -> LoraModel | None:
    """Wrap every target Linear of ``model`` in LoraLinear, as peft's get_peft_model does; None if none is here."""
    targets = [(name, m) for name, m in model.named_modules() if name and _is_target(name, lora.target_modules)]
    if not targets:
        return None
    model.requires_grad_(False)  # peft trains the adapters only (bias "none")
    for name, module in targets:
        if not isinstance(module, (nn.Linear, StreamedLinear)):
            raise PlanError(f"lora.target_modules matches '{name}', a {type(module).__name__}; the runtime adds "
                            "LoRA to Linear layers only (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, ...)")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, LoraLinear(module, lora.r, lora.alpha, lora.dropout))
    root = LoraModel(model)
    _init_lora_a(root, seed)
    return root


def _init_lora_a(root: nn.Module, seed: int) -> None:
    """Initialise each lora_A from a generator keyed by (seed, parameter name), like peft's kaiming init.

    The initial adapter then does not depend on how the model is split into stages.
    """
    for name, p in root.named_parameters():
        if "lora_A" in name and p.requires_grad:
            key = hashlib.sha256(f"{seed}:{name}".encode()).digest()
            gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(key[:8], "little"))
            w = torch.empty(p.shape, dtype=torch.float32)
            nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=gen)
            with torch.no_grad():
                p.copy_(w.to(p.dtype))


def _lora_tensors(root: nn.Module) -> dict[str, torch.Tensor]:
    """Each LoRA layer's A and B weights under their PEFT keys, in module order (peft selects them the same way)."""
    out = {}
    for name, module in root.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "base_layer"):  # ours, or a peft model's
            for part in ("lora_A", "lora_B"):
                out[f"{name}.{part}.weight"] = getattr(module, part)[ADAPTER].weight
    return out


def lora_state(root: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA weights in PEFT key space (``get_peft_model_state_dict``'s), as CPU float32 copies (float64 ones in a
    float64 plan)."""
    return {k: v.detach().to("cpu", accumulate_dtype(v.dtype)).clone() for k, v in _lora_tensors(root).items()}


def load_lora_state(root: nn.Module, state: dict[str, torch.Tensor], where: str, *, strict: bool = True) -> list[str]:
    """Copy the entries of ``state`` (PEFT keys) that are ``root``'s LoRA weights into it; returns the keys taken."""
    mine = _lora_tensors(root)
    taken = sorted(k for k in state if k in mine)
    missing = sorted(set(mine) - set(taken))
    if strict and missing:
        raise CheckpointError(
            f"{where}: the adapter lacks {len(missing)} LoRA tensor(s) of this stage "
            f"(first: {missing[0]}); it was trained with other lora.target_modules or another model"
        )
    bad = [k for k in taken if tuple(state[k].shape) != tuple(mine[k].shape)]
    if bad:
        raise CheckpointError(f"{where}: adapter tensor {bad[0]} has shape {tuple(state[bad[0]].shape)}, this "
                              f"stage's {tuple(mine[bad[0]].shape)}: it was trained with another model or lora.r")
    with torch.no_grad():
        for k in taken:
            mine[k].copy_(state[k])
    return taken


def _peft_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A peft LoRA layer's forward through lora_linear (installed by share_lora_inputs)."""
    name = self.active_adapters[0]
    return lora_linear(self.base_layer, x, self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name],
                       self.lora_dropout[name], self._hetero_cast_first, *args, **kwargs)


def _plain(module: Any) -> bool:
    """One vanilla adapter (no DoRA or other variant), not merged, adapters on."""
    names = list(module.active_adapters)
    return (len(names) == 1 and names[0] in module.lora_A and not module.merged and not module.disable_adapters
            and names[0] not in getattr(module, "lora_variant", {}))


def share_lora_inputs(model: nn.Module) -> int:
    """Route every plain LoRA Linear of a peft ``model`` through lora_linear; returns how many."""
    from peft.tuners.lora.layer import Linear as PeftLinear

    count = 0
    for module in model.modules():
        if not hasattr(module, "lora_A") or not hasattr(module, "base_layer"):
            continue
        is_linear = isinstance(module, PeftLinear)
        is_4bit = type(module).__name__ == "Linear4bit" and type(module).__module__.startswith("peft.")
        if not (is_linear or is_4bit) or not _plain(module):
            continue
        module._hetero_cast_first = is_4bit
        module.forward = types.MethodType(_peft_forward, module)
        count += 1
    return count
