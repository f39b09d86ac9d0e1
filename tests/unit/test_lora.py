"""runtime/stage/lora.py: the fused LoRA linear computes what peft computes, and is the path fp32 stages take;
the stage's own LoRA layers (built without peft) are peft's: names, RNG draws, state keys, outputs, gradients."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from torch import nn

import hetero.runtime.stage.lora as lora
from hetero.errors import CheckpointError, PlanError
from hetero.specs import LoraSpec


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
    monkeypatch.setattr(lora, "_fusable", lambda *args: False)
    plain = _run(_model(True, 0.3, share=True))
    assert torch.allclose(fused[0], plain[0], rtol=1e-5, atol=1e-6)
    assert torch.allclose(fused[1], plain[1], rtol=1e-5, atol=1e-7)
    for a, b in zip(fused[2], plain[2], strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6 * float(a.abs().max()))


def _ours(bias: bool, dropout: float, base: nn.Module | None = None) -> nn.Module:
    """_Two with the stage's own LoRA (add_lora), after the same seed as _model, B made non-zero the same way."""
    torch.manual_seed(0)
    root = lora.add_lora(base if base is not None else _Two(bias), LoraSpec(r=4, alpha=8.0, dropout=dropout,
                                                      target_modules=["q_proj", "down_proj"]), seed=3)
    assert root is not None
    with torch.no_grad():
        for name, p in root.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return root.train()


def _copy_lora(src: nn.Module, dst: nn.Module) -> None:
    with torch.no_grad():
        for (n, p), (m, q) in zip(src.named_parameters(), dst.named_parameters(), strict=True):
            assert n == m
            q.copy_(p)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_own_lora_layer_is_peft_lora(dropout: float) -> None:
    """Without peft: peft's parameter names, order, trainability and dtypes, the same draws from the global
    RNG (dropout masks come from it), peft's state keys, and, with peft's weights, the same training step."""
    ref, ours = _model(True, dropout, share=False), _ours(True, dropout)
    after_ref = (_model(True, dropout, share=False), torch.rand(4))[1]
    after_ours = (_ours(True, dropout), torch.rand(4))[1]
    assert torch.equal(after_ref, after_ours)
    assert [(n, p.requires_grad, p.dtype, p.shape) for n, p in ref.named_parameters()] == \
        [(n, p.requires_grad, p.dtype, p.shape) for n, p in ours.named_parameters()]
    assert list(get_peft_model_state_dict(ref)) == list(lora.lora_state(ours))
    assert all(isinstance(m, lora.LoraLinear) for m in (ours.base_model.model.q_proj, ours.base_model.model.down_proj))
    _copy_lora(ref, ours)
    want = _run(ref) if dropout == 0.0 else None
    shared = _model(True, dropout, share=True)
    _copy_lora(ref, shared)
    got, same_path = _run(ours), _run(shared)
    for a, b in zip(got[:2] + tuple(got[2]), same_path[:2] + tuple(same_path[2]), strict=True):
        assert torch.equal(a, b)  # exactly what the stage ran when it was built with peft
    if want is not None:  # peft's own nn.Dropout draws its masks another way (the fused kernels' test, above)
        assert torch.allclose(want[0], got[0], rtol=1e-5, atol=1e-6)
        assert torch.allclose(want[1], got[1], rtol=1e-5, atol=1e-7)
        for a, b in zip(want[2], got[2], strict=True):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6 * float(a.abs().max()))


def test_own_lora_on_nf4_is_what_peft_built() -> None:
    """A bitsandbytes NF4 base (bf16 compute): the same output and gradients as peft's layer on it."""
    from hetero.runtime.stage.weights import quantize_nf4

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleDict({"0": _Two(False).to(torch.bfloat16)})

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model.layers["0"](x)

    def nf4(share: bool | None) -> nn.Module:
        torch.manual_seed(0)
        holder = Holder().requires_grad_(False)
        assert quantize_nf4(holder, torch.bfloat16, torch.device("cpu")) == 2
        if share is None:
            return _ours(False, 0.0, holder)
        model = get_peft_model(holder, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
        if share:
            lora.share_lora_inputs(model)
        return model.train()

    ref, shared, ours = nf4(False), nf4(True), nf4(None)
    _copy_lora(ours, ref)
    _copy_lora(ours, shared)
    x = torch.randn(3, 5, 48, dtype=torch.bfloat16)
    outs = []
    for model in (ref, shared, ours):
        xi = x.clone().requires_grad_()
        y = model(xi)
        y.float().square().mean().backward()
        outs.append((y.detach(), xi.grad, [p.grad for p in model.parameters() if p.requires_grad]))
    assert outs[2][0].dtype == torch.bfloat16
    assert torch.equal(outs[1][0], outs[2][0]) and torch.equal(outs[1][1], outs[2][1])
    assert all(torch.equal(a, b) for a, b in zip(outs[1][2], outs[2][2], strict=True))
    assert torch.allclose(outs[0][0].float(), outs[2][0].float(), rtol=2e-2, atol=2e-2)


def test_lora_state_loads_like_peft() -> None:
    """load_lora_state takes PEFT keys (as set_peft_model_state_dict does), checks them, and returns what it took."""
    ref, ours = _model(False, 0.0, share=False), _ours(False, 0.0)
    state = get_peft_model_state_dict(ref)
    assert lora.load_lora_state(ours, dict(state), "stage 0") == sorted(state)
    assert all(torch.equal(lora.lora_state(ours)[k], v) for k, v in state.items())
    partial = {k: v for k, v in state.items() if "down_proj" not in k}
    with pytest.raises(CheckpointError, match="stage 0: the adapter lacks 2 LoRA tensor"):
        lora.load_lora_state(ours, partial, "stage 0")
    assert lora.load_lora_state(ours, partial, "stage 0", strict=False) == sorted(partial)
    wrong = {k: torch.zeros(2, *v.shape[1:]) if "lora_A" in k else v for k, v in state.items()}
    with pytest.raises(CheckpointError, match="has shape"):
        lora.load_lora_state(ours, wrong, "stage 0")


def test_lora_on_a_non_linear_target_is_a_plan_error() -> None:
    class Emb(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(10, 4)

    with pytest.raises(PlanError, match="'embed_tokens', a Embedding"):
        lora.add_lora(Emb(), LoraSpec(target_modules=["embed_tokens"]), seed=0)
    assert lora.add_lora(Emb(), LoraSpec(target_modules=["q_proj"]), seed=0) is None
