"""Interleaved programs train exactly like one process: stage processes' executors serving several chunks.

Each device runs runtime/stage/chunks.py's ChunkedExecutor over its chunks (one Stage each, built from
a hand-built plan's virtual stages), on real Transports on loopback, one thread per device, with this
thread as the coordinator. The per-step losses and the final LoRA weights must equal the plain
transformers+peft reference (tests/reference.py) within 1e-5, with clipping and the LR schedule acting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from metrics_rows import read_metrics, step_lines
from plans import drive, interleave, make_plan
from reference import assert_close_to_scale

from hetero.plan import Plan, compute_input_hash
from hetero.planner.schedule.schedules import interleaved_one_f_one_b
from hetero.runtime.cli import main_run
from hetero.runtime.run.data import StepBatches
from hetero.runtime.stage.adapter import load_adapter_state
from hetero.runtime.stage.chunks import ChunkedExecutor
from hetero.runtime.stage.model import build_stage
from hetero.runtime.stage.state import restore_stage, stage_payload
from hetero.runtime.wire.transport import Transport
from hetero.security import COORDINATOR, stage_name
from hetero.specs import ModelSpec, TrainSpec

SEQ_LEN = 32
TRAIN = TrainSpec(micro_batch_size=2, num_micro_batches=4, steps=3, lr=2e-3, scheduler="cosine", warmup_steps=1,
                  max_grad_norm=0.3, seed=3, shuffle=True)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def setup(references: Callable[..., dict], tiny_model_dir: Path) -> dict:
    return references(tiny_model_dir, TRAIN, SEQ_LEN)


def run_devices(plan: Plan, num_devices: int, chunks: int, steps: int, start: int = 0,
                prepare: Callable[[list[ChunkedExecutor]], None] | None = None,
                ) -> tuple[list[float], list[float], list[ChunkedExecutor]]:
    """Build the plan's p x v virtual stages as ``num_devices`` devices of ``chunks`` chunks, ``prepare`` them (a
    restore), and train steps ``start``..``steps``; (losses, clip coefficients, the devices)."""
    virtual = [build_stage(plan, j, CPU) for j in range(num_devices * chunks)]
    programs = interleaved_one_f_one_b(num_devices, plan.train.num_micro_batches, chunks)
    names = [stage_name(d) for d in range(num_devices)]
    coord = Transport(COORDINATOR, "tcp://127.0.0.1:0", plan.input_hash, recv_timeout_s=120)
    wires = [Transport(name, "tcp://127.0.0.1:0", plan.input_hash, recv_timeout_s=120) for name in names]
    try:
        for d, w in enumerate(wires):
            coord.connect(names[d], w.endpoint)
            w.connect(COORDINATOR, coord.endpoint)
            for e in {(d - 1) % num_devices, (d + 1) % num_devices} - {d}:  # the ring: the last hands on to the first
                w.connect(names[e], wires[e].endpoint)
        devices = [ChunkedExecutor([virtual[c * num_devices + d] for c in range(chunks)], programs[d], wires[d],
                                   plan.train, d, num_devices) for d in range(num_devices)]
        if prepare is not None:
            prepare(devices)
        batches = StepBatches(plan.data, plan.model.pretrained, SEQ_LEN, plan.train.micro_batch_size,
                              plan.train.num_micro_batches, plan.train.seed, plan.train.shuffle)
        losses, coefs = drive(devices, wires, coord, batches, steps, plan.train.max_grad_norm, start)
    finally:
        for w in [*wires, coord]:
            w.close()
    return losses, coefs, devices


@pytest.mark.parametrize(("num_devices", "chunks", "split"), [(2, 2, [2, 1, 1, 2]), (2, 3, [1, 1, 1, 1, 1, 1])])
def test_interleaved_devices_train_like_one_process(num_devices: int, chunks: int, split: list[int], setup: dict,
                                                    tiny_model_dir: Path, tiny_spec: ModelSpec) -> None:
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, split, train=TRAIN, lora=setup["lora"], seq_len=SEQ_LEN)
    losses, coefs, devices = run_devices(plan, num_devices, chunks, TRAIN.steps)
    assert min(coefs) < 0.99, "the test only means something if clipping acts"
    assert losses == pytest.approx(setup["losses"], rel=1e-5)
    trained = {key: value for d in devices for ex in d.executors for key, value in ex.stage.lora_state().items()}
    assert set(trained) == set(setup["state"])
    for key, want in setup["state"].items():
        assert_close_to_scale(key, trained[key], want, 1e-5)


def test_the_planned_activation_peak_is_what_the_devices_hold(setup: dict, tiny_model_dir: Path,
                                                              tiny_spec: ModelSpec) -> None:
    """planner/search/interleave.py prices a device's activation memory by walking its program (peak_activations):
    each chunk's forward outputs are held until its backward. The executors of a real run hold exactly that:
    per device, the peak over the run of the chunks' held outputs, each weighted by its chunk's size (unequal
    chunks, so a count alone would not do), equals the walk's."""
    from hetero.planner.search.interleave import peak_activations

    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [2, 1, 1, 2], train=TRAIN, lora=setup["lora"],
                     seq_len=SEQ_LEN)
    weights = [[2.0, 1.0], [1.0, 2.0]]  # device d's chunk c: layers of virtual stage c x 2 + d
    peaks = [0.0, 0.0]

    def watch(devices: list[ChunkedExecutor]) -> None:
        for d, device in enumerate(devices):
            for ex in device.executors:
                for name in ("_forward", "_backward"):
                    run = getattr(ex, name)

                    def counted(step: int, mb: int, run=run, d=d, device=device) -> None:
                        run(step, mb)
                        held = sum(w * len(e._outputs) for w, e in zip(weights[d], device.executors, strict=True))
                        peaks[d] = max(peaks[d], held)

                    setattr(ex, name, counted)
                    ex._handlers = {op: counted if h == run else h for op, h in ex._handlers.items()}

    run_devices(plan, 2, 2, 1, prepare=watch)
    programs = interleaved_one_f_one_b(2, TRAIN.num_micro_batches, 2)
    assert peaks == [peak_activations(programs[d], weights[d]) for d in range(2)]
    assert peaks[0] > 0 and peaks[0] != peaks[1]


def test_a_device_of_chunks_checkpoints_and_resumes_exactly(setup: dict, tiny_model_dir: Path,
                                                            tiny_spec: ModelSpec) -> None:
    """A device's payload holds every chunk's LoRA weights and AdamW moments; restored into freshly built chunks,
    the run goes on to the reference's last loss and weights."""
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [2, 1, 1, 2], train=TRAIN, lora=setup["lora"],
                     seq_len=SEQ_LEN)
    _, _, first = run_devices(plan, 2, 2, TRAIN.steps - 1)
    payloads = [stage_payload(d, plan.input_hash) for d in first]
    assert [meta["stage"] for _, meta in payloads] == [0, 1] and all(m["step"] == TRAIN.steps - 1 for _, m in payloads)
    assert all(len(meta["keys"]) == len({k for ex in d.executors for k in ex.stage.lora_state()})
               for (_, meta), d in zip(payloads, first, strict=True))

    def restore(devices: list[ChunkedExecutor]) -> None:
        for d, (tensors, meta) in zip(devices, payloads, strict=True):
            restore_stage(d, tensors, meta)

    losses, _, rest = run_devices(plan, 2, 2, TRAIN.steps, start=TRAIN.steps - 1, prepare=restore)
    assert losses == pytest.approx(setup["losses"][-1:], rel=1e-5)
    trained = {key: value for d in rest for ex in d.executors for key, value in ex.stage.lora_state().items()}
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


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_hetero_run_of_an_interleaved_plan_trains_like_one_process(recompute: str, setup: dict, tiny_model_dir: Path,
                                                                   tiny_spec: ModelSpec) -> None:
    """`hetero run` of a plan whose 2 stage processes hold 2 chunks each (the last hands on to the first): the
    losses and the saved adapter file are the reference's, and a checkpoint holds every chunk's LoRA weights.
    ``full``: every chunk's decoder layers recompute their forward in the backward (the plan's chunk lists)."""
    plan = interleave(make_plan(tiny_model_dir, tiny_spec.architecture, [2, 1, 1, 2], train=TRAIN, lora=setup["lora"],
                                seq_len=SEQ_LEN, recompute=recompute), 2)
    assert all(bool(c.recompute_layers) == (recompute == "full") for s in plan.stages for c in s.chunks)
    run_dir = setup["root"] / f"run-interleaved-{recompute}"
    run_dir.mkdir()
    plan_file = setup["root"] / f"plan-interleaved-{recompute}.json"
    plan.save(plan_file)
    assert Plan.load(plan_file).stages == plan.stages
    assert main_run([str(plan_file), "--run-dir", str(run_dir), "--no-progress",
                     "checkpoint_every=2"]) == 0
    metrics = step_lines(read_metrics(run_dir / "metrics.jsonl"))
    assert [m["loss"] for m in metrics] == pytest.approx(setup["losses"], rel=1e-5)
    assert min(m["clip_coef"] for m in metrics) < 0.99
    trained = load_adapter_state(run_dir / "adapter", setup["lora"])
    assert set(trained) == set(setup["state"])
    for key, want in setup["state"].items():
        assert_close_to_scale(key, trained[key], want, 1e-5)
    assert (run_dir / "checkpoints" / "step-000002" / "COMPLETE").is_file()


@pytest.mark.slow
def test_an_interleaved_run_through_compressed_links_follows_the_reference(setup: dict, tiny_model_dir: Path,
                                                                           tiny_spec: ModelSpec) -> None:
    """`hetero run` of 2 devices x 2 chunks whose ring link is compressed: device 1's hand-offs in int4 (to device
    0: its first chunk's activations to device 0's second chunk, and device 0's gradients back), device 0's to
    device 1 plain. The receiving stages accept nothing but compressed parts on that link (runtime/wire/rules.py),
    so the run finishing means every hand-off over it crossed compressed; the losses stay within 3 % of
    transformers+peft's and the adapter moves as the reference's does, as for a pipeline of one chunk per device
    (tests/e2e/test_compressed_links.py)."""
    plan = interleave(make_plan(tiny_model_dir, tiny_spec.architecture, [2, 1, 1, 2], train=TRAIN, lora=setup["lora"],
                                seq_len=SEQ_LEN), 2)
    plan = replace(plan, stages=[replace(s, compress_out=scheme) for s, scheme in zip(plan.stages, ["none", "int4"],
                                                                                          strict=True)])
    plan = replace(plan, input_hash=compute_input_hash(plan))
    plan_file = setup["root"] / "plan-interleaved-compressed.json"
    plan.save(plan_file)
    assert [s.compress_out for s in Plan.load(plan_file).stages] == ["none", "int4"]
    run_dir = setup["root"] / "run-interleaved-compressed"
    run_dir.mkdir()
    assert main_run([str(plan_file), "--run-dir", str(run_dir), "--no-progress"]) == 0
    losses = [m["loss"] for m in step_lines(read_metrics(run_dir / "metrics.jsonl"))]
    assert losses == pytest.approx(setup["losses"], rel=0.03), (losses, setup["losses"])
    assert losses != pytest.approx(setup["losses"], rel=1e-6)  # the codecs were on the wire
    trained = load_adapter_state(run_dir / "adapter", setup["lora"])
    initial = load_adapter_state(Path(setup["lora"].init_from))
    for key, want in setup["state"].items():
        ref, got = (want - initial[key]).flatten(), (trained[key] - initial[key]).flatten()
        assert float(torch.nn.functional.cosine_similarity(ref, got, dim=0)) > 0.9, key
    # The run's profile does not take either device's message times (encode and decode included) as a plain
    # message's: device 0's neither, whose later chunk decodes device 1's int4 activations over the ring.
    from hetero.profile import Profile

    profile = Profile.load(run_dir)
    for dev in profile.devices:
        said = "(this run's hand-offs were compressed)"
        assert said in dev.sources["message_send"] and said in dev.sources["message_recv"], dev.sources


def test_a_rebalancing_re_plan_of_an_interleaved_run_trains_like_one_process(setup: dict, tiny_model_dir: Path,
                                                                            tiny_spec: ModelSpec, monkeypatch) -> None:
    """An interleaved plan's layers cannot move in place, so rebalancing re-plans them (runtime/run/replan_moves.py):
    after step 1, device 0 measured 4x slower (forced), the run goes on under plan-rebalance-1.json with fewer of
    its layers on device 0, from the state after step 1 (no step trained twice); the losses and the saved adapter
    are the reference's, and the move is one metrics line with its plan, predictions and duration."""
    from hetero.planner import plan as make_planned
    from hetero.planner.model.cost_model import plan_roofline
    from hetero.planner.replan.recovery import named_like
    from hetero.runtime.run.elastic import run_elastic
    from hetero.runtime.run.options import RunOptions
    from hetero.runtime.run.report import write_report
    from hetero.runtime.run.run_compare import versus_plan

    # Planned by the planner (interleave=always on the hand-built plan's 2 devices), so its predicted times are the
    # cost model's, as a compiled plan's are: a re-plan compares the two plans at the measured speeds.
    hand = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3], train=TRAIN, lora=setup["lora"], seq_len=SEQ_LEN)
    options = replace(hand.planner, devices=[s.device for s in hand.stages], split=None, num_stages=None, replicas=1,
                      interleave="always")
    # The hand-built graph prices no compute: its decoder layers get ~1 ms a micro-batch, so that compute, not the
    # per-message costs, decides the split.
    graph = replace(hand.graph, nodes=[replace(n, fwd_flops_per_token=6e6, bwd_flops_per_token=1.2e7)
                                       if n.kind == "decoder" else n for n in hand.graph.nodes])
    plan = named_like(replace(make_planned(hand.model, graph, hand.cluster, hand.train, hand.data, options,
                                           plan_roofline(hand), hand.eval, hand.config, hand.data_stats),
                              security=hand.security), hand)
    assert all(s.chunks for s in plan.stages)
    run_dir = setup["root"] / "run-interleaved-replan"
    run_dir.mkdir()
    plan.save(run_dir / "plan.json")
    slow = plan.stages[0].device
    run = RunOptions(run_dir=run_dir, progress=False, replans={1: {slow: 4.0}})
    final, path, result = run_elastic(plan, run_dir / "plan.json", run)
    assert path == run_dir / "plan-rebalance-1.json" and Plan.load(path).input_hash == final.input_hash
    assert [s.device for s in final.stages] == [s.device for s in plan.stages]
    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = step_lines(rows)
    moves = [r for r in rows if r.get("event") == "rebalance"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [m["after_step"] for m in moves] == [1] and moves[0]["plan"] == "plan-rebalance-1.json"
    move = moves[0]
    assert move["new_split"][0] < move["old_split"][0] and sum(move["new_split"]) == sum(move["old_split"]) == 6
    assert [r["split"] for r in steps] == [move["old_split"], move["new_split"], move["new_split"]]
    assert move["predicted_step_s_after"] < move["predicted_step_s_before"] and move["move_s"] > 0
    assert move["speed_factors"] == [4.0, 1.0]
    # The report (written by `hetero run` with the plan the run ended on) measures the move across both plans.
    report = write_report(final, result.steps, result.build_s, run_dir, result.events)
    assert [(m["plan"], m["steps_before"], m["steps_after"]) for m in report["moves"]] == [
        ("plan-rebalance-1.json", [1, 1], [3, 3])]
    assert report["moves"][0]["measured_gain"] > 0
    # `hetero simulate plan.json --run RUN_DIR`: the first plan's steps, the move, the re-plan's steps replayed with
    # the re-plan's own programs.
    new = "/".join(map(str, move["new_split"]))
    from hetero.planner.schedule import simulator

    replayed, replay = [], simulator.replay_run
    monkeypatch.setattr(simulator, "replay_run", lambda p, t, **kw: replayed.append(p) or replay(p, t, **kw))
    said = "\n".join(versus_plan(plan, run_dir))
    assert [bool(p.stages[0].chunks) for p in replayed] == [True, False]
    assert f"split {'/'.join(map(str, move['old_split']))} -> {new}" in said and f"on split {new}: measured" in said
    assert [m["loss"] for m in steps] == pytest.approx(setup["losses"], rel=1e-5)
    trained = load_adapter_state(run_dir / "adapter", setup["lora"])
    assert set(trained) == set(setup["state"])
    for key, want in setup["state"].items():
        assert_close_to_scale(key, trained[key], want, 1e-5)
