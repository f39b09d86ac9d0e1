"""A mixture of experts' weights in NF4: each expert's matrices as bitsandbytes Linear4bit.

transformers keeps a MoE layer's experts as two 3-D tensors (``gate_up_proj`` [E, 2I, H], ``down_proj``
[E, H, I]) that bitsandbytes' Linear4bit cannot hold. ``NF4Experts`` takes their place: one Linear4bit per
expert matrix, so only the experts a token is routed to compute and each dequantizes its weight when used. The
experts are frozen; LoRA trains the attention (hetero/families.py).

It computes as transformers' experts of ``model.experts_implementation`` do:
- grouped (the default): one routing pass sorts the (token, slot) pairs by expert and reads the per-expert
  counts to the host once per layer; each expert then runs on its contiguous rows (no grouped matmul exists for
  NF4 weights, so the fewest kernels are one dequantize and two matmuls per used expert), and the weighted rows
  go back to their (token, slot) places, each once (no atomic adds), to be summed per token (``run_sorted``);
- eager: transformers' per-expert loop (a ``torch.where`` and a host sync per expert), the reference.

Dense (bf16/fp16/fp32) experts run transformers' ``grouped_mm`` where the device has torch's grouped GEMM for
the dtype (CPU; NVIDIA from Ampere on, in bf16: ``grouped_fast``). Elsewhere (older GPUs, fp16, ROCm, MPS)
transformers would fall back to a custom op that computes the frozen experts' weight gradients and reads the
offsets to the host per matmul; the stage runs ``run_sorted`` over the dense weights instead (``hetero_grouped``,
registered with transformers' experts functions): one host read per layer, no weight gradients.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch
from torch import nn


class NF4Experts(nn.Module):
    """Every expert of one MoE layer, each matrix an NF4 Linear4bit; computes as transformers' experts."""

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module], act_fn: Callable[[torch.Tensor], torch.Tensor],
                 grouped: bool = True, gate: Callable[[torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        self.num_experts = len(gate_up)
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)
        self.act_fn = act_fn
        self.grouped = grouped
        self.gate = gate  # the family's own gate of the gate/up output (gpt-oss's clamped SwiGLU); None: SwiGLU

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up[e](x)
        if self.gate is not None:
            return self.down[e](self.gate(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
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
        return run_sorted(hidden_states, top_k_index, top_k_weights, self.num_experts, self._expert)

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


def run_sorted(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
               num_experts: int, expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Experts over sorted rows: the (token, slot) pairs sorted by expert once, the expert counts read to the host
    once, ``expert(e, rows)`` on each used expert's contiguous rows, the weighted rows put back in their pairs'
    places (each once) and summed per token. A slot routed to ``num_experts`` (nowhere) sorts last and adds 0."""
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    with torch.no_grad():
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts].tolist()  # the one host read
    rows = order[:sum(counts)]
    x = hidden_states[rows // k]
    pieces, start = [], 0
    for e, n in enumerate(counts):
        if n:
            pieces.append(expert(e, x[start:start + n]))
            start += n
    out = hidden_states.new_zeros(tokens * k, hidden_states.size(-1))
    if pieces:
        y = torch.cat(pieces) * top_k_weights.reshape(-1)[rows, None]
        out = out.index_copy(0, rows, y.to(out.dtype))
    return out.view(tokens, k, -1).sum(dim=1)


def _dense_expert(experts: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` of transformers' fused experts on its rows ``x``: its (biased, transposed) projections and gate
    as the module defines them (gpt-oss's clamped SwiGLU included)."""
    def project(weight: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
        y = rows @ weight[e] if experts.is_transposed else nn.functional.linear(rows, weight[e])
        return y if bias is None else y + bias[e]

    gated = experts.has_gate
    up = project(experts.gate_up_proj if gated else experts.up_proj,
                 (experts.gate_up_proj_bias if gated else experts.up_proj_bias) if experts.has_bias else None, x)
    hidden = experts._apply_gate(up) if gated else experts.act_fn(up)
    return project(experts.down_proj, experts.down_proj_bias if experts.has_bias else None, hidden)


def sorted_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward as ``hetero_grouped``: ``run_sorted`` over the module's dense weights."""
    return run_sorted(hidden_states, top_k_index, top_k_weights, self.num_experts,
                      lambda e, x: _dense_expert(self, e, x))


SORTED = "hetero_grouped"


def register_sorted() -> None:
    """Register ``hetero_grouped`` with transformers' experts functions (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if SORTED not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(SORTED, sorted_experts_forward)


def grouped_fast(device: torch.device | None, dtype: torch.dtype | None) -> bool:
    """Whether torch's grouped GEMM runs transformers' ``grouped_mm`` experts here without its slow fallback: on
    CPU, and on NVIDIA GPUs from Ampere (8.0) on in bf16 (ROCm, MPS and older GPUs: run_sorted). Never in float64,
    which it does not take."""
    if not hasattr(torch.nn.functional, "grouped_mm") and not hasattr(torch, "_grouped_mm") or dtype == torch.float64:
        return False
    if device is None or device.type == "cpu":
        return True
    if device.type != "cuda" or torch.version.hip is not None or dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def quantize_experts(layer: nn.Module, module: str,
                     nf4: Callable[[torch.Tensor, torch.Tensor | None], nn.Module], transposed: bool = False) -> bool:
    """Replace the experts at ``module`` (a dotted path inside the decoder layer) with NF4Experts built by ``nf4``
    (a 2-D weight [out, in] and its bias -> its Linear4bit; ``transposed``: transformers keeps them [in, out],
    gpt-oss and Llama 4), computing as the experts' config says (grouped unless eager) with the family's own gate;
    False when the layer has none there (a dense layer of a MoE model)."""
    parent_name, _, name = module.rpartition(".")
    parent = layer.get_submodule(parent_name) if parent_name else layer
    experts = getattr(parent, name, None)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.dim() != 3:
        return False
    grouped = getattr(getattr(experts, "config", None), "_experts_implementation", "grouped_mm") != "eager"

    def matrices(fused: torch.Tensor, bias: torch.Tensor | None) -> list[nn.Module]:
        return [nf4(w.t().contiguous() if transposed else w, None if bias is None else bias.data[e])
                for e, w in enumerate(fused.data)]

    biases = [getattr(experts, f"{n}_bias", None) for n in ("gate_up_proj", "down_proj")]
    setattr(parent, name, NF4Experts(matrices(gate_up, biases[0]), matrices(down, biases[1]),
                                     getattr(experts, "act_fn", None), grouped, _own_gate(experts)))
    return True


def _own_gate(experts: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The gate a family's experts class defines for itself (gpt-oss: interleaved gate/up, clamped, (up + 1) times a
    sigmoid-gated gate), bound to a copy of its settings (not its weights, which NF4 replaces); None for
    transformers' default SwiGLU gate."""
    from transformers.integrations.moe import _default_apply_gate

    own = getattr(type(experts), "_apply_gate", None)
    if own is None or own is _default_apply_gate:
        return None
    settings = {k: v for k, v in vars(experts).items() if not k.startswith("_") and not isinstance(v, torch.Tensor)}
    # Weightless submodules too (an activation): the fused weights are what NF4 replaces
    settings.update({k: m for k, m in experts.named_children() if not any(True for _ in m.parameters())})
    return functools.partial(own, types.SimpleNamespace(**settings))
