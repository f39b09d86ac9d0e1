"""The independent reference trainer: plain transformers + peft on one process, no hetero runtime code.

The runtime's equivalence test trains the same model on the same data (``StepBatches``, the only
hetero piece used here, so both see identical tokens in identical order) and compares per-step
losses and the final LoRA weights with ``train_reference``. Everything else here is the textbook
loop: fp32 model, peft LoRA, per-micro-batch backward of ``loss_sum / num_label_tokens``, gradient
clipping, ``torch.optim.AdamW`` and ``transformers.get_scheduler``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM, get_scheduler

from hetero.runtime.run.data import StepBatch, StepBatches
from hetero.specs import LoraSpec, TrainSpec

HF_SCHEDULER = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def lora_config(lora: LoraSpec) -> LoraConfig:
    """The peft LoraConfig for a hetero LoraSpec."""
    return LoraConfig(
        r=lora.r,
        lora_alpha=int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha,  # type: ignore[arg-type]
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def build_reference_model(model_dir: Path, lora: LoraSpec, init_adapter: Path | None, seed: int = 0,
                          dtype: torch.dtype = torch.float32) -> PeftModel:
    """fp32 (or ``dtype``: float64 for the exactness checks) base model with trainable LoRA: fresh (seeded) or loaded
    from ``init_adapter``. Every tensor is in ``dtype``: transformers' fp32-kept modules too, as a stage keeps them."""
    torch.manual_seed(seed)
    # torch's grouped GEMM takes no float64: a float64 mixture of experts runs transformers' eager experts (the
    # stage its sorted ones, runtime/stage/experts.py).
    experts = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, **experts).to(dtype)
    if init_adapter is None:
        model = get_peft_model(base, lora_config(lora))
    else:
        # Pass the config explicitly so dropout etc. follow `lora`, weights follow the adapter.
        model = PeftModel.from_pretrained(base, str(init_adapter), is_trainable=True, config=lora_config(lora))
    model.train()
    return model


def accumulate_step(model: torch.nn.Module, batch: StepBatch) -> float:
    """Forward/backward every micro-batch of ``batch`` (grads accumulate); returns the step's mean loss."""
    total = 0.0
    for ids, labels in zip(batch.input_ids, batch.labels, strict=True):
        logits = model(input_ids=ids).logits
        # HF causal-LM convention: position t predicts token t+1.
        loss_sum = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32)),
            labels[:, 1:].reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        (loss_sum / batch.num_label_tokens).backward()
        total += loss_sum.item()
    return total / batch.num_label_tokens


def unpacked(batches: StepBatches, batch: StepBatch) -> StepBatch:
    """A packed step's records one per row, padded on the right, in micro-batches of the same size: what a trainer
    without packing computes on the same records (the label count must come out the same)."""
    b, s = batches.micro_batch_size, batches.seq_len
    rows = len(batch.record_ids)
    m = -(-rows // b)
    input_ids = torch.full((m * b, s), batches.pad_id, dtype=torch.long)
    labels = torch.full((m * b, s), -100, dtype=torch.long)
    for row, index in enumerate(batch.record_ids):
        ids, labs = batches.encode(index)
        n = min(len(ids), s)
        input_ids[row, :n], labels[row, :n] = torch.tensor(ids[:n]), torch.tensor(labs[:n])
    count = int((labels[:, 1:] != -100).sum())
    assert count == batch.num_label_tokens, f"unpacked the step has {count} label tokens, packed {batch.num_label_tokens}"
    return StepBatch(input_ids.view(m, b, s), labels.view(m, b, s), count, list(batch.record_ids))


def step_unpacked(batches: StepBatches, step: int) -> StepBatch:
    """Step ``step``'s records as one-record rows (packed or not)."""
    batch = batches.step(step)
    return batch if batch.position_ids is None else unpacked(batches, batch)


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The LoRA parameters (everything else is frozen by peft)."""
    return [p for p in model.parameters() if p.requires_grad]


def train_reference(
    model_dir: Path,
    lora: LoraSpec,
    init_adapter: Path | None,
    batches: StepBatches,
    train: TrainSpec,
    steps: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train ``steps`` optimizer steps; returns per-step losses and the final LoRA state (PEFT keys; float32, or
    float64 where ``dtype`` is)."""
    model = build_reference_model(model_dir, lora, init_adapter, train.seed, dtype)
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay)
    scheduler = get_scheduler(
        HF_SCHEDULER[train.scheduler], optimizer, num_warmup_steps=train.warmup_steps, num_training_steps=train.steps
    )
    losses = []
    for step in range(steps):
        losses.append(accumulate_step(model, step_unpacked(batches, step)))
        if train.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, train.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    wide = torch.promote_types(dtype, torch.float32)
    state = {k: v.detach().to(wide).clone() for k, v in get_peft_model_state_dict(model).items()}
    return losses, state


def make_init_adapter(model_dir: Path, lora: LoraSpec, out_dir: Path, seed: int) -> Path:
    """Save a fresh PEFT adapter whose lora_B is non-zero, so every LoRA path carries gradient from step 0."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(base, lora_config(lora))
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    out_dir = Path(out_dir)
    model.save_pretrained(str(out_dir))  # peft's own writer, independent of hetero.runtime.stage.adapter
    return out_dir


def reference_run(model_dir: Path, root: Path, train: TrainSpec, seq_len: int,
                  targets: list[str] | None = None, packing: bool = True, dtype: torch.dtype = torch.float32) -> dict:
    """A fresh adapter (non-zero lora_B, r=4, dropout 0) and the reference's losses and final LoRA state
    over ``train.steps`` steps of the demo data (the steps' records as ``packing`` picks them, each trained in a
    row of its own): what the runtime equivalence tests compare against.
    ``lora`` in the result starts from that adapter (``init_from``)."""
    from dataclasses import replace

    from hetero.specs import DataSpec

    lora = LoraSpec(r=4, alpha=8.0, dropout=0.0)
    if targets is not None:
        lora = replace(lora, target_modules=list(targets))
    adapter = make_init_adapter(model_dir, lora, root / "init_adapter", seed=7)
    batches = StepBatches(DataSpec(packing=packing), model_dir, seq_len, train.micro_batch_size, train.num_micro_batches,
                          train.seed, train.shuffle)
    losses, state = train_reference(model_dir, lora, adapter, batches, train, train.steps, dtype)
    return {"root": root, "lora": replace(lora, init_from=str(adapter)), "losses": losses, "state": state}


def assert_close_to_scale(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    """|got - want| <= rtol x the largest |want| (a tensor-scale bound: AdamW lifts rounding on tiny entries)."""
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= rtol * max(scale, 1e-12), f"{name}: max abs error {err:.3g} vs scale {scale:.3g}"
