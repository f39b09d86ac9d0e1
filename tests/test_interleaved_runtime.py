"""Interleaved programs train exactly like one process: stage processes' executors serving several chunks.

Each device runs runtime/stage/chunks.py's ChunkedExecutor over its chunks (one Stage each, built from
a hand-built plan's virtual stages), on real Transports on loopback, one thread per device, with this
thread as the coordinator. The per-step losses and the final LoRA weights must equal the plain
transformers+peft reference (tests/reference.py) within 1e-5, with clipping and the LR schedule acting.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch
from reference import assert_close_to_scale, reference_run
from test_runtime_plans import make_plan

from hetero.planner.schedules import interleaved_one_f_one_b
from hetero.runtime.run.data import StepBatches
from hetero.runtime.stage.chunks import ChunkedExecutor
from hetero.runtime.stage.model import build_stage
from hetero.runtime.wire.transport import Transport
from hetero.security import COORDINATOR, stage_name
from hetero.specs import ModelSpec, TrainSpec

SEQ_LEN = 32
TRAIN = TrainSpec(micro_batch_size=2, num_micro_batches=4, steps=3, lr=2e-3, scheduler="cosine", warmup_steps=1,
                  max_grad_norm=0.3, seed=3, shuffle=True)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return reference_run(tiny_model_dir, tmp_path_factory.mktemp("interleaved"), TRAIN, SEQ_LEN)


def train_interleaved(devices: list[ChunkedExecutor], wires: list[Transport], coord: Transport,
                      batches: StepBatches, steps: int) -> tuple[list[float], list[float]]:
    """Train the devices for ``steps`` steps as the coordinator does; (per-step losses, clip coefficients)."""
    errors: list[BaseException] = []
    names = [stage_name(d) for d in range(len(devices))]

    def work(d: int) -> None:
        try:
            for step in range(steps):
                stats = devices[d].run_step(step)
                wires[d].send(COORDINATOR, "stepdone", step=step, meta=stats.to_meta())
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(d,), daemon=True) for d in range(len(devices))]
    for t in threads:
        t.start()
    losses, coefs = [], []
    try:
        for step in range(steps):
            batch = batches.step(step)
            inputs = {"input_ids": batch.input_ids}
            if batch.position_ids is not None:
                inputs["position_ids"] = batch.position_ids
            coord.send(names[0], "batch", step=step, tensors=inputs)  # device 0 holds chunk 0
            coord.send(names[-1], "labels", step=step, tensors={"labels": batch.labels},
                       meta={"num_label_tokens": batch.num_label_tokens})  # the last device holds the last chunk
            sumsq = sum(coord.recv("gradnorm", step=step, timeout_s=120).meta["sumsq"] for _ in devices)
            coef = min(1.0, TRAIN.max_grad_norm / (math.sqrt(sumsq) + 1e-6))
            coefs.append(coef)
            for name in names:
                coord.send(name, "clip", step=step, meta={"coef": coef})
            done = [coord.recv("stepdone", step=step, timeout_s=120) for _ in devices]
            last = next(m for m in done if m.sender == names[-1])
            losses.append(last.meta["loss_sum"] / batch.num_label_tokens)
    finally:
        for t in threads:
            t.join(timeout=30 if not errors else 1)
    if errors:
        raise errors[0]
    return losses, coefs


@pytest.mark.parametrize(("num_devices", "chunks", "split"), [(2, 2, [2, 1, 1, 2]), (2, 3, [1, 1, 1, 1, 1, 1])])
def test_interleaved_devices_train_like_one_process(num_devices: int, chunks: int, split: list[int], setup: dict,
                                                    tiny_model_dir: Path, tiny_spec: ModelSpec) -> None:
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, split, train=TRAIN, lora=setup["lora"], seq_len=SEQ_LEN)
    virtual = [build_stage(plan, j, CPU) for j in range(num_devices * chunks)]
    programs = interleaved_one_f_one_b(num_devices, TRAIN.num_micro_batches, chunks)
    names = [stage_name(d) for d in range(num_devices)]
    coord = Transport(COORDINATOR, "tcp://127.0.0.1:0", plan.input_hash, recv_timeout_s=120)
    wires = [Transport(name, "tcp://127.0.0.1:0", plan.input_hash, recv_timeout_s=120) for name in names]
    try:
        for d, w in enumerate(wires):
            coord.connect(names[d], w.endpoint)
            w.connect(COORDINATOR, coord.endpoint)
            for e in {(d - 1) % num_devices, (d + 1) % num_devices} - {d}:  # the ring: the last hands on to the first
                w.connect(names[e], wires[e].endpoint)
        devices = [ChunkedExecutor([virtual[c * num_devices + d] for c in range(chunks)], programs[d], wires[d], TRAIN,
                                   d, num_devices) for d in range(num_devices)]
        batches = StepBatches(plan.data, tiny_model_dir, SEQ_LEN, TRAIN.micro_batch_size, TRAIN.num_micro_batches,
                              TRAIN.seed, TRAIN.shuffle)
        losses, coefs = train_interleaved(devices, wires, coord, batches, TRAIN.steps)
    finally:
        for w in [*wires, coord]:
            w.close()
    assert min(coefs) < 0.99, "the test only means something if clipping acts"
    assert losses == pytest.approx(setup["losses"], rel=1e-5)
    trained = {key: value for stage in virtual for key, value in stage.lora_state().items()}
    assert set(trained) == set(setup["state"])
    for key, want in setup["state"].items():
        assert_close_to_scale(key, trained[key], want, 1e-5)


def test_an_act_is_received_by_the_chunk_it_names() -> None:
    """Two chunks' activations of one micro-batch from one peer: each receive takes its chunk's, in either order
    (a message without a chunk is chunk 0's, so the other schedules' wire is unchanged)."""
    from hetero.protocol import Act

    with Transport("stage1", "tcp://127.0.0.1:0", "plan", recv_timeout_s=10) as rx, \
            Transport("stage0", None, "plan") as tx:
        tx.connect("stage1", rx.endpoint)
        for chunk, value in ((1, 1.0), (None, 0.0)):
            tx.send("stage1", Act(chunk=chunk), step=0, mb=2, tensors={"h": torch.full((1, 2, 4), value)})
        assert float(rx.recv("act", step=0, mb=2, sender="stage0", chunk=0).tensors["h"][0, 0, 0]) == 0.0
        got = rx.recv("act", step=0, mb=2, sender="stage0", chunk=1)
        assert got.meta["chunk"] == 1 and float(got.tensors["h"][0, 0, 0]) == 1.0
        tx.set_linger(0)
