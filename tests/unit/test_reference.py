"""The reference trainer itself: it learns, its loss is HF's, and accumulation equals one big batch."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from reference import accumulate_step, build_reference_model, make_init_adapter, train_reference

from hetero.runtime.run.data import StepBatches
from hetero.specs import DataSpec, ModelSpec, TrainSpec


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # The CI box has 2 shared cores: a second intra-op thread only adds contention for these sizes.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _batches(model_dir: Path, m: int, b: int, seq_len: int = 128) -> StepBatches:
    return StepBatches(DataSpec(), model_dir, seq_len, b, m, seed=0, shuffle=True)


def _hf_loss(model: torch.nn.Module, batches: StepBatches, steps: range) -> float:
    """Mean token loss over the given steps' batches, scored by HF's own ``labels=`` loss."""
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in steps:
            for ids, labels in zip(batches.step(i).input_ids, batches.step(i).labels, strict=True):
                n = int((labels[:, 1:] != -100).sum())
                total += float(model(input_ids=ids, labels=labels).loss) * n
                tokens += n
    model.train()
    return total / tokens


def test_losses_fall_on_demo_data(tiny_model_dir: Path, tiny_spec: ModelSpec) -> None:
    batches = _batches(tiny_model_dir, m=2, b=4)
    train = TrainSpec(micro_batch_size=4, num_micro_batches=2, steps=10, lr=1e-2, max_grad_norm=1.0)
    losses, state = train_reference(tiny_model_dir, tiny_spec.lora, None, batches, train, steps=10)
    assert len(losses) == 10 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(tiny_spec.architecture["vocab_size"]), abs=0.2)  # random init
    assert sum(losses[-5:]) / 5 < losses[0] - 0.03
    # The same batches scored before and after training (HF's own loss): a clear, noise-free drop.
    model = build_reference_model(tiny_model_dir, tiny_spec.lora, None)
    before = _hf_loss(model, batches, range(4))
    set_peft_model_state_dict(model, state)
    after = _hf_loss(model, batches, range(4))
    assert after < before - 0.05


def test_loss_is_hf_causal_lm_loss(tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path) -> None:
    adapter = make_init_adapter(tiny_model_dir, tiny_spec.lora, tmp_path / "init", seed=3)
    model = build_reference_model(tiny_model_dir, tiny_spec.lora, adapter)
    lora_b = [v for k, v in get_peft_model_state_dict(model).items() if "lora_B" in k]
    assert lora_b and all(bool(v.abs().sum() > 0) for v in lora_b)  # every B is non-zero
    batches = _batches(tiny_model_dir, m=1, b=4)
    batch = batches.step(0)
    ours = accumulate_step(model, batch)
    hf = model(input_ids=batch.input_ids[0], labels=batch.labels[0]).loss  # mean over shifted labels
    assert ours == pytest.approx(float(hf), rel=1e-6)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None for g in grads) and all(bool(g.abs().sum() > 0) for g in grads)


def test_accumulation_equals_one_big_batch(tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path) -> None:
    adapter = make_init_adapter(tiny_model_dir, tiny_spec.lora, tmp_path / "init", seed=5)
    small, big = _batches(tiny_model_dir, m=4, b=2, seq_len=64), _batches(tiny_model_dir, m=1, b=8, seq_len=64)
    for i in range(2):  # same tokens, just split differently
        a, b = small.step(i), big.step(i)
        assert torch.equal(a.input_ids.reshape(8, -1), b.input_ids.reshape(8, -1))
        assert a.num_label_tokens == b.num_label_tokens

    grads = []
    for batches in (small, big):
        model = build_reference_model(tiny_model_dir, tiny_spec.lora, adapter)
        loss = accumulate_step(model, batches.step(0))
        grads.append((loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    (loss_s, g_s), (loss_b, g_b) = grads
    assert loss_s == pytest.approx(loss_b, rel=1e-6)
    for name in g_s:
        torch.testing.assert_close(g_s[name], g_b[name], rtol=1e-4, atol=1e-7)

    train = TrainSpec(micro_batch_size=2, num_micro_batches=4, steps=2, lr=1e-3, max_grad_norm=1.0)
    losses_s, state_s = train_reference(tiny_model_dir, tiny_spec.lora, adapter, small, train, steps=2)
    losses_b, state_b = train_reference(tiny_model_dir, tiny_spec.lora, adapter, big, train, steps=2)
    assert losses_s == pytest.approx(losses_b, rel=1e-5)
    _, state_0 = train_reference(tiny_model_dir, tiny_spec.lora, adapter, big, train, steps=0)
    moved = max(float((state_s[k] - state_0[k]).abs().max()) for k in state_s)
    assert moved > 1e-3  # training moved the weights far more than the tolerance below
    for key in state_s:
        torch.testing.assert_close(state_s[key], state_b[key], rtol=0, atol=1e-5)
