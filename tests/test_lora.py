"""runtime/stage/lora.py: the fused LoRA linear computes what peft computes, and is the path fp32 stages take."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

import hetero.runtime.stage.lora as lora


class _Two(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.q_proj = nn.Linear(48, 40, bias=bias)
        self.down_proj = nn.Linear(40, 48, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.nn.functional.silu(self.q_proj(x)))


def _model(bias: bool, dropout: float, share: bool) -> nn.Module:
    torch.manual_seed(0)
    model = get_peft_model(_Two(bias), LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                  target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # non-zero B: every path of the adapter carries gradient
                p.normal_(0, 0.1)
    if share:
        assert lora.share_lora_inputs(model) == 2
    return model.train()


def _run(model: nn.Module, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(seed)
    x = torch.randn(3, 5, 48, requires_grad=True)
    out = model(x)
    out.square().mean().backward()
    assert x.grad is not None
    return out.detach(), x.grad, [p.grad for p in model.parameters() if p.requires_grad]  # type: ignore[misc]


@pytest.mark.parametrize("bias", [False, True])
def test_fused_linear_equals_peft(bias: bool) -> None:
    """fp32, no dropout: output, input gradient and every LoRA gradient equal plain peft's (to rounding)."""
    ref, ours = _run(_model(bias, 0.0, share=False)), _run(_model(bias, 0.0, share=True))
    assert torch.allclose(ref[0], ours[0], rtol=1e-5, atol=1e-6)
    assert torch.allclose(ref[1], ours[1], rtol=1e-5, atol=1e-7)
    assert len(ref[2]) == len(ours[2]) == 4
    for a, b in zip(ref[2], ours[2], strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6 * float(a.abs().max()))


def test_fp32_takes_the_fused_path_and_bf16_base_does_not() -> None:
    """The grad_fn tells which kernel ran: fused for an fp32 base, the separate delta otherwise."""
    model = _model(False, 0.0, share=True)
    out = model.base_model.model.q_proj(torch.randn(2, 48))
    assert type(out.grad_fn).__name__ == "_LoraLinearBackward"
    model.base_model.model.q_proj.base_layer.to(torch.bfloat16)  # adapters stay fp32: dtypes differ
    out = model.base_model.model.q_proj(torch.randn(2, 48, dtype=torch.bfloat16))
    assert "_LoraLinear" not in type(out.grad_fn).__name__


def test_fused_dropout_draws_the_unfused_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    """lora.dropout > 0: the fused kernel draws the same mask as the separate-delta path (same RNG use),
    so both give the same training, and a rerun is bit-identical."""
    fused = _run(_model(True, 0.3, share=True))
    again = _run(_model(True, 0.3, share=True))
    assert torch.equal(fused[0], again[0]) and torch.equal(fused[1], again[1])
    monkeypatch.setattr(lora, "_fusable", lambda module, x: False)
    plain = _run(_model(True, 0.3, share=True))
    assert torch.allclose(fused[0], plain[0], rtol=1e-5, atol=1e-6)
    assert torch.allclose(fused[1], plain[1], rtol=1e-5, atol=1e-7)
    for a, b in zip(fused[2], plain[2], strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6 * float(a.abs().max()))
