"""Checkpoints hold the whole training state: stopping after step 2 and restoring gives the same run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from plans import make_plan, run_in_threads

from hetero.errors import CheckpointError
from hetero.runtime.run.checkpoint import load_stage_checkpoint, lora_from_payload, save_stage_checkpoint
from hetero.runtime.run.data import StepBatches
from hetero.runtime.stage.model import build_stage
from hetero.runtime.stage.state import restore_stage, stage_payload
from hetero.specs import ModelSpec, TrainSpec

CPU = torch.device("cpu")


def test_restored_checkpoint_continues_exactly(tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path) -> None:
    train = TrainSpec(micro_batch_size=2, num_micro_batches=2, steps=4, lr=3e-3, scheduler="linear", warmup_steps=1,
                      max_grad_norm=0.5, shuffle=True, seed=1)
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3], train=train, seq_len=64)
    batches = StepBatches(plan.data, tiny_model_dir, 64, 2, 2, train.seed, train.shuffle)

    whole: list = []
    losses = run_in_threads([build_stage(plan, k, CPU) for k in range(2)], plan, batches, 4, executors_out=whole)

    first: list = []
    run_in_threads([build_stage(plan, k, CPU) for k in range(2)], plan, batches, 2, executors_out=first)
    ckpt = tmp_path / "step-000002"
    for ex in first:
        tensors, meta = stage_payload(ex, plan.input_hash)
        save_stage_checkpoint(ckpt, tensors, meta)

    def restore(k: int, executor) -> None:
        tensors, meta = load_stage_checkpoint(ckpt, k, plan.input_hash)
        assert meta["step"] == 2 and set(lora_from_payload(tensors)) == set(executor.stage.lora_state())
        restore_stage(executor, tensors, meta)

    resumed: list = []
    rest = run_in_threads([build_stage(plan, k, CPU) for k in range(2)], plan, batches, 4, prepare=restore,
                          start_step=2, executors_out=resumed)
    assert rest == pytest.approx(losses[2:], rel=1e-5)
    for a, b in zip(whole, resumed, strict=True):
        assert a.scheduler.get_last_lr() == b.scheduler.get_last_lr()
        for key, value in a.stage.lora_state().items():
            assert torch.allclose(b.stage.lora_state()[key], value, rtol=1e-5, atol=1e-7), key

    with pytest.raises(CheckpointError, match="written by plan"):
        load_stage_checkpoint(ckpt, 0, "0" * 16)
    with pytest.raises(CheckpointError, match="no checkpoint of stage 7"):
        load_stage_checkpoint(ckpt, 7)
