"""Data x pipeline replicas train exactly like one process over the whole global batch.

Two replicas of the tiny Llama, each a 2-stage pipeline with its own split, on 4 CPU stage processes,
share each step's 8 micro-batches unevenly (3 and 5); at every optimizer step their LoRA gradients
are summed through the coordinator before the global clip. Per-step losses and every LoRA tensor
must equal the plain transformers+peft reference (tests/reference.py) to 1e-4; the run's
checkpoint, in whole-model keys, resumes on a one-replica plan and continues the same curve.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from metrics_rows import read_metrics, step_lines
from plans import make_plan
from reference import assert_close_to_scale

from hetero.errors import PlanError
from hetero.plan import Plan
from hetero.runtime.cli import main_run
from hetero.runtime.stage.adapter import load_adapter_state
from hetero.specs import ModelSpec, TrainSpec

pytestmark = pytest.mark.slow

SEQ_LEN = 32
TRAIN = TrainSpec(micro_batch_size=2, num_micro_batches=8, steps=4, lr=2e-3, scheduler="cosine", warmup_steps=1,
                  max_grad_norm=0.3, seed=3, shuffle=True)
RTOL = 1e-4


@pytest.fixture(scope="module")
def setup(references: Callable[..., dict], tiny_model_dir: Path) -> dict:
    """The initial adapter and the reference run, computed once for the module."""
    return references(tiny_model_dir, TRAIN, SEQ_LEN)


def _assert_close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert_close_to_scale(name, got, want, RTOL)


def _metrics(run_dir: Path) -> list[dict]:
    return step_lines(read_metrics(run_dir / "metrics.jsonl"))


def test_two_replicas_with_uneven_shares_equal_the_reference(setup: dict, tiny_model_dir: Path,
                                                             tiny_spec: ModelSpec) -> None:
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [[3, 3], [2, 4]], train=TRAIN,  # type: ignore[list-item]
                     lora=setup["lora"], seq_len=SEQ_LEN, shares=[3, 5])
    assert [(r.stages, r.num_micro_batches, r.first_micro_batch) for r in plan.pipelines] == [
        ([0, 1], 3, 0), ([2, 3], 5, 3)]
    path = setup["root"] / "plan-replicas.json"
    plan.save(path)
    assert Plan.load(path).replicas == plan.replicas
    run_dir = setup["root"] / "run-replicas"
    assert main_run([str(path), "--run-dir", str(run_dir), "--no-progress", "checkpoint_every=2"]) == 0

    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, TRAIN.steps + 1))
    assert min(m["clip_coef"] for m in metrics) < 0.99  # the global clip acts on the summed gradients
    for m, want in zip(metrics, setup["losses"], strict=True):
        assert m["loss"] == pytest.approx(want, rel=RTOL), f"step {m['step']}: loss {m['loss']} vs reference {want}"
    assert len(metrics[0]["stage_busy"]) == 4

    trained = load_adapter_state(run_dir / "adapter", setup["lora"])
    assert set(trained) == set(setup["state"])
    initial = load_adapter_state(Path(setup["lora"].init_from))
    for key, want in setup["state"].items():
        assert not torch.equal(initial[key], want)
        _assert_close(key, trained[key], want)
    # The checkpoint is the first replica's stages, in whole-model keys (any split can resume it).
    ckpt = run_dir / "checkpoints" / "step-000002"
    assert sorted(p.name for p in ckpt.glob("stage*.json")) == ["stage0.json", "stage1.json"]
    setup["run"] = run_dir


def test_two_replica_checkpoint_resumes_on_one_pipeline(setup: dict, tiny_model_dir: Path,
                                                        tiny_spec: ModelSpec) -> None:
    if "run" not in setup:
        pytest.skip("needs the replica run above")
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [4, 2], train=TRAIN, lora=setup["lora"], seq_len=SEQ_LEN)
    path = setup["root"] / "plan-one.json"
    plan.save(path)
    run_dir = setup["root"] / "run-one"
    assert main_run([str(path), "--run-dir", str(run_dir), "--no-progress", "--resume",
                     str(setup["run"] / "checkpoints" / "step-000002")]) == 0
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == [3, 4]
    assert [m["loss"] for m in metrics] == pytest.approx(setup["losses"][2:], rel=RTOL)
    trained = load_adapter_state(run_dir / "adapter")
    for key, want in setup["state"].items():
        _assert_close(key, trained[key], want)


def test_plan_rejects_replicas_that_do_not_partition_the_batch(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                               tmp_path: Path) -> None:
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [[6], [3, 3]], train=TRAIN,  # type: ignore[list-item]
                     shares=[4, 4])
    plan = replace(plan, replicas=[plan.replicas[0], replace(plan.replicas[1], num_micro_batches=3)])
    plan.save(tmp_path / "plan.json")
    with pytest.raises(PlanError, match="micro-batches sum to 7, train.num_micro_batches is 8"):
        Plan.from_dict(json.loads((tmp_path / "plan.json").read_text()))
    plan = replace(plan, replicas=[plan.replicas[0], replace(plan.replicas[1], num_micro_batches=4)],
                   stages=[replace(s, first_node=1) if s.index == 2 else s for s in plan.stages])
    plan.save(tmp_path / "plan.json")
    with pytest.raises(PlanError, match=r"stages\[2\] covers nodes 1\.\."):
        Plan.from_dict(json.loads((tmp_path / "plan.json").read_text()))
