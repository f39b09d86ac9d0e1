"""The strongest runtime test: a 3-stage pipeline of CPU processes trains exactly like one process.

Tiny Llama, fp32, dropout 0, the same data order and the same initial adapter (non-zero lora_B):
per-step losses and final LoRA weights must equal the plain transformers+peft reference
(tests/reference.py) — with gradient accumulation over 4 micro-batches, clipping that is active,
warmup + cosine decay — under 1F1B and under GPipe.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from metrics_rows import read_metrics, step_lines
from plans import RTOL, SEQ_LEN, TRAIN, make_plan
from reference import assert_close_to_scale

from hetero.runtime.cli import main_run
from hetero.runtime.stage.adapter import load_adapter_state
from hetero.specs import ModelSpec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(references: Callable[..., dict], tiny_model_dir: Path) -> dict:
    """The initial adapter and the reference run, computed once for the module."""
    return references(tiny_model_dir, TRAIN, SEQ_LEN)


def _assert_close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert_close_to_scale(name, got, want, RTOL)


@pytest.fixture(scope="module")
def padded(references: Callable[..., dict], setup: dict, tiny_model_dir: Path) -> dict:
    """The reference over the steps data.packing=false gives (one record per row, in the epoch's order)."""
    return references(tiny_model_dir, TRAIN, SEQ_LEN, packing=False)


# Each schedule once and each recompute mode once: recomputation happens inside a layer's backward, the same
# under either schedule, so two runs cover what four did and keep CI's time (test_stage checks it on NF4 too).
# data.packing=false (one record per row, no positions on the wire) runs with GPipe.
@pytest.mark.parametrize(("schedule", "recompute", "packing"), [("1f1b", "full", True), ("gpipe", "none", False)])
def test_pipeline_equals_single_process_reference(schedule: str, recompute: str, packing: bool, setup: dict,
                                                  request: pytest.FixtureRequest, tiny_model_dir: Path,
                                                  tiny_spec: ModelSpec) -> None:
    # recompute=full: every decoder layer keeps only its input and re-runs its forward in backward.
    if not packing:
        setup = request.getfixturevalue("padded")
    train = replace(TRAIN, schedule=schedule)
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [2, 2, 2], train=train, lora=setup["lora"],
                     seq_len=SEQ_LEN, recompute=recompute, packing=packing)
    assert all(len(s.recompute_layers) == (2 if recompute == "full" else 0) for s in plan.stages)
    name = f"{schedule}-{recompute}"
    run_dir = setup["root"] / f"run-{name}"
    run_dir.mkdir()
    plan.save(run_dir.parent / f"plan-{name}.json")
    assert main_run([str(run_dir.parent / f"plan-{name}.json"), "--run-dir", str(run_dir), "--no-progress",
                     "checkpoint_every=2"]) == 0

    metrics = step_lines(read_metrics(run_dir / "metrics.jsonl"))
    assert [m["step"] for m in metrics] == list(range(1, TRAIN.steps + 1))
    # The test only means something if clipping and the schedule really act.
    assert min(m["clip_coef"] for m in metrics) < 0.99
    assert len({round(m["lr"], 12) for m in metrics}) >= 3
    for m, want in zip(metrics, setup["losses"], strict=True):
        assert m["loss"] == pytest.approx(want, rel=RTOL), f"step {m['step']}: loss {m['loss']} vs reference {want}"

    trained = load_adapter_state(run_dir / "adapter", setup["lora"])
    want_state = setup["state"]
    assert set(trained) == set(want_state)
    moved = 0
    initial = load_adapter_state(Path(setup["lora"].init_from))
    for key, want in want_state.items():
        _assert_close(key, trained[key], want)
        moved += int(not torch.equal(initial[key], want))
    assert moved == len(want_state), "every LoRA matrix must have been updated by training"

    # Each stage checkpointed its share of the same weights in whole-model key space.
    for step in (2, TRAIN.steps):
        assert (run_dir / "checkpoints" / f"step-{step:06d}" / "COMPLETE").is_file()
    setup[f"run-{schedule}"] = run_dir
    report = json.loads((run_dir / "report.json").read_text())
    assert len(report["stages"]) == 3 and report["measured_step_time_s"] > 0


def test_resume_on_another_split_continues_the_same_run(setup: dict, tiny_model_dir: Path,
                                                        tiny_spec: ModelSpec) -> None:
    """Checkpoints are in whole-model keys: a 2-stage plan resumes the 3-stage run's step-2 checkpoint
    and ends exactly where the uninterrupted reference does."""
    if "run-1f1b" not in setup:
        pytest.skip("needs the 1f1b run above")
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [4, 2], train=TRAIN, lora=setup["lora"], seq_len=SEQ_LEN)
    plan.save(setup["root"] / "plan-resume.json")
    run_dir = setup["root"] / "run-resume"
    ckpt = setup["run-1f1b"] / "checkpoints" / "step-000002"
    assert main_run([str(setup["root"] / "plan-resume.json"), "--run-dir", str(run_dir), "--no-progress",
                     "--resume", str(ckpt)]) == 0
    metrics = step_lines(read_metrics(run_dir / "metrics.jsonl"))
    assert [m["step"] for m in metrics] == [3, 4]
    assert [m["loss"] for m in metrics] == pytest.approx(setup["losses"][2:], rel=RTOL)
    trained = load_adapter_state(run_dir / "adapter")
    for key, want in setup["state"].items():
        _assert_close(key, trained[key], want)
