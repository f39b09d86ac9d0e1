"""Rebalancing a running pipeline (runtime.rebalance): when it moves, and that a move leaves the math alone.

The watcher (planner/replan/rebalance.py) is checked on measured-time series made here: noise never moves anything,
a device slow from the start (priced by the plan) never moves, a sustained slowdown moves layers off the
slow device, and a move that cannot pay for itself before the run ends is not made. The move itself
(runtime/run/moves.py) is checked on real stage processes against the plain transformers+peft reference:
moving layers twice mid-run gives the reference's losses and LoRA weights.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from plans import make_plan
from reference import assert_close_to_scale

from hetero.plan import Plan
from hetero.planner.replan.rebalance import Replanner, Watch
from hetero.runtime.stage.adapter import load_adapter_state
from hetero.specs import ModelSpec, TrainSpec

SEQ_LEN = 32
TRAIN = TrainSpec(micro_batch_size=2, num_micro_batches=4, steps=5, lr=2e-3, scheduler="cosine", warmup_steps=1,
                  max_grad_norm=0.3, seed=3, shuffle=True)
RTOL = 1e-4


@pytest.fixture(scope="module")
def w1_like_plan(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    """A compiled 2-stage plan of the tiny model on two local CPU devices (4 decoder layers)."""
    from hetero.cli import main

    out = tmp_path_factory.mktemp("rebalance-plan") / "plan"
    assert main(["compile", "model=tiny", "hardware=local", "planner.num_stages=2", "data.packing=false",
                 f"output={out}"]) == 0
    return Plan.load(out / "plan.json")


def _series(plan: Plan, steps: int, slow_from: int | None, factor: float, noise: float, seed: int,
            slow_stage: int = 0) -> list[list[float]]:
    """Per step, per stage: the device's speed against the plan's pricing, with noise (x ``factor`` on one)."""
    rng = random.Random(seed)
    out = []
    for step in range(steps):
        row = [rng.uniform(1 - noise, 1 + noise) for _ in plan.stages]
        if slow_from is not None and step >= slow_from:
            row[slow_stage] *= factor
        out.append(row)
    return out


def _watch(plan: Plan, series: list[list[float]], move_cost_s: float = 0.0) -> list[tuple[int, object]]:
    """Run a Watch over the series as a run would: each step's measured F + B is the priced compute of the
    split the stages hold then, times the devices' speeds; it follows its own moves. The (step, proposal) made."""
    spans = tuple((s.first_node, s.last_node) for s in plan.stages)
    watch = Watch(Replanner(plan), spans, move_cost_s=move_cost_s)
    moves = []
    for step, speeds in enumerate(series):
        priced = watch.replanner.compute_s(watch.spans, watch.recompute)
        proposal = watch.observe([c * f for c, f in zip(priced, speeds, strict=True)], steps_left=len(series) - step - 2)
        if proposal is not None:
            moves.append((step, proposal))
            watch.moved(proposal)
    return moves


def test_noise_never_moves_anything(w1_like_plan: Plan) -> None:
    # +-25 % per stage per step, independently: far noisier than a quiet run, and nothing moves in 40 runs.
    for seed in range(40):
        assert _watch(w1_like_plan, _series(w1_like_plan, 36, None, 1.0, 0.25, seed)) == []


def test_a_device_slow_from_the_start_is_priced_and_never_moves(w1_like_plan: Plan) -> None:
    for seed in range(10):
        assert _watch(w1_like_plan, _series(w1_like_plan, 36, 0, 3.3, 0.1, seed)) == []


def test_a_sustained_slowdown_moves_layers_off_the_slow_device(w1_like_plan: Plan) -> None:
    series = _series(w1_like_plan, 36, 6, 3.3, 0.1, seed=1)
    moves = _watch(w1_like_plan, series)
    assert len(moves) == 1
    step, proposal = moves[0]
    # 1 warm-up step, 3 calibrating, then 4 sustained slow steps from step 6: decided after step 9.
    assert step == 9
    counts = Replanner(w1_like_plan).counts
    old, new = counts(proposal.old.spans), counts(proposal.new.spans)  # type: ignore[attr-defined]
    assert new[0] < old[0] and sum(new) == sum(old)
    assert proposal.cause == 0 and proposal.change[0] == pytest.approx(3.3, rel=0.15)  # type: ignore[attr-defined]
    assert proposal.gain > 1.15  # type: ignore[attr-defined]
    # The new split is the best one by brute force over every split, with the measured speeds.
    replanner = Replanner(w1_like_plan)
    factors = list(proposal.factors)  # type: ignore[attr-defined]
    layers = len(w1_like_plan.graph.decoder_indices())
    from hetero.planner.model.objective import split_spans

    times = []
    for first in range(1, layers):
        spans = tuple(split_spans(len(w1_like_plan.graph.nodes), [first, layers - first],
                                  w1_like_plan.graph.decoder_indices()))
        option = replanner.option(spans, None, factors)
        if option is not None:
            times.append(option.step_s)
    assert proposal.new.step_s == pytest.approx(min(times))  # type: ignore[attr-defined]


def test_a_move_that_cannot_pay_for_itself_is_not_made(w1_like_plan: Plan) -> None:
    series = _series(w1_like_plan, 36, 6, 3.3, 0.1, seed=1)
    # A move that costs a minute never pays back on a step of milliseconds.
    assert _watch(w1_like_plan, series, move_cost_s=60.0) == []
    # Nor does one decided when no step would be left after it, however cheap.
    assert _watch(w1_like_plan, series[:11], move_cost_s=0.01) == []
    assert len(_watch(w1_like_plan, series[:12], move_cost_s=0.01)) == 1


def test_a_run_where_no_move_can_pay_says_so_once(w1_like_plan: Plan, capsys) -> None:
    """The run's Mover with moves that cost a minute: a lasting 3.3x slowdown makes no move, and the run says why
    once (not silence), however long the slowdown lasts."""
    from types import SimpleNamespace

    from hetero.runtime.run.moves import Mover

    mover = Mover(w1_like_plan, "auto")
    mover.started({0: 60.0, 1: 60.0})
    priced = Replanner(w1_like_plan).compute_s(tuple((s.first_node, s.last_node) for s in w1_like_plan.stages))
    for step in range(40):
        factor = 3.3 if step >= 6 else 1.0
        done = {k: SimpleNamespace(meta={**REPORT, "step": step, "op_time_s": {
            "F": c / 3 * (factor if k == 0 else 1), "B": 2 * c / 3 * (factor if k == 0 else 1)}})
            for k, c in enumerate(priced)}
        mover.observe(step, done)
        assert mover.pending is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hetero run: runtime.rebalance: stage 0 (")
    assert "runs 3.30x slower than when its split was planned; no move can help: a move would save" in err
    assert "less than twice the 60 s a move costs" in err


def test_a_device_that_recovers_gets_its_layers_back(w1_like_plan: Plan) -> None:
    series = _series(w1_like_plan, 40, 6, 3.3, 0.05, seed=2)
    for row in series[20:]:
        row[0] /= 3.3
    moves = _watch(w1_like_plan, series)
    assert len(moves) == 2
    counts = Replanner(w1_like_plan).counts
    assert counts(moves[1][1].new.spans) == counts(moves[0][1].old.spans)  # type: ignore[attr-defined]


def test_a_move_planned_on_disturbed_steps_is_corrected_once(w1_like_plan: Plan) -> None:
    """While stage 0's device slows down for good, stage 1's is briefly slowed too (a neighbour's burst): the
    move planned on those steps moves too little. Calibrated on its new split, the watcher re-plans once
    and moves on to the split that is best for the real speeds."""
    series = _series(w1_like_plan, 40, 6, 3.3, 0.0, seed=0)
    for row in series[6:10]:
        row[1] *= 1.5
    moves = _watch(w1_like_plan, series)
    assert len(moves) == 2
    replanner = Replanner(w1_like_plan)
    first, second = moves[0][1], moves[1][1]
    assert second.reason.startswith("measured on its new split")  # type: ignore[attr-defined]
    assert second.new.spans == replanner.best([3.3, 1.0]).spans  # type: ignore[attr-defined, union-attr]
    assert first.new.spans != second.new.spans  # type: ignore[attr-defined]


# -- the move on real stage processes -------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup(references: Callable[..., dict], tiny_model_dir: Path) -> dict:
    return references(tiny_model_dir, TRAIN, SEQ_LEN)


@pytest.mark.slow
def test_moving_layers_mid_run_trains_exactly_like_one_process(setup: dict, tiny_model_dir: Path,
                                                                tiny_spec: ModelSpec) -> None:
    """3 stages, 1F1B, recomputation on: after step 1 the split goes [2,2,2] -> [1,3,2], after step 3 to [3,2,1]
    (a checkpoint is due after step 3 as well: that move reuses it); losses and LoRA equal the reference."""
    from hetero.runtime.run.coordinator import Coordinator, RunOptions

    train = replace(TRAIN, checkpoint_every=4)
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [2, 2, 2], train=train, lora=setup["lora"],
                     seq_len=SEQ_LEN, recompute="full")
    run_dir = setup["root"] / "run-moves"
    run_dir.mkdir()
    plan_path = run_dir / "plan.json"
    plan.save(plan_path)
    # runtime.elastic off: its copies in memory come every step when a copy is cheap against the step (under load,
    # sometimes), and a move after one reuses that copy instead of writing the checkpoint this test counts.
    options = RunOptions(run_dir=run_dir, progress=False, rebalance="off", moves={1: [1, 3, 2], 3: [3, 2, 1]},
                         elastic="off")
    Coordinator(plan, plan_path, options).run()

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "event" not in r]
    events = [r for r in rows if "event" in r]
    assert [r["step"] for r in steps] == list(range(1, TRAIN.steps + 1))
    assert [r["split"] for r in steps] == [[2, 2, 2], [2, 2, 2], [1, 3, 2], [1, 3, 2], [3, 2, 1]]
    assert [(e["after_step"], e["old_split"], e["new_split"]) for e in events] == [
        (2, [2, 2, 2], [1, 3, 2]), (4, [1, 3, 2], [3, 2, 1])]  # after 2 and 4 steps
    for r, want in zip(steps, setup["losses"], strict=True):
        assert r["loss"] == pytest.approx(want, rel=RTOL), f"step {r['step']}: loss {r['loss']} vs reference {want}"
    trained = load_adapter_state(run_dir / "adapter", setup["lora"])
    assert set(trained) == set(setup["state"])
    for key, want in setup["state"].items():
        assert_close_to_scale(key, trained[key], want, RTOL)
    # A move is also a checkpoint (the first, at a step none was due, wrote one: a move that fails half-way loses
    # nothing); the second reused the checkpoint due at the same step.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000002", "step-000004", "step-000005"]
    assert torch.is_tensor(next(iter(trained.values())))


@pytest.mark.slow
def test_an_undisturbed_run_never_rebalances(tmp_path: Path) -> None:
    """W1's model on 2 CPU stages x 1 thread with 4 micro-batches (half W1's step: a noisier one, relative to its
    length), rebalance on (the default), two runs of 16 steps: the watcher calibrates and watches every step, and
    nothing moves."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from w1_hetero import compile_hetero, run_plan
    from w1_model import prepare

    steps = 16
    model_dir, data = prepare(tmp_path, steps)
    plan, note = compile_hetero(model_dir, data, steps, tmp_path, num_micro=4)
    assert plan is not None, note
    for attempt in range(2):
        times, note = run_plan(plan, steps, tmp_path)
        assert times is not None, note
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [r for r in rows if "event" in r] == [], f"run {attempt} rebalanced"
        assert {tuple(r["split"]) for r in rows} == {tuple(rows[0]["split"])}


# A stage's stepdone as the coordinator's side reads it (hetero.protocol.StepDone), its op times given by each test.
REPORT = {"step": 0, "loss_sum": None, "num_label_tokens": None, "grad_sumsq": 0.0, "lr": 1e-4, "busy_s": 0.0,
          "wall_s": 0.0}


def test_a_throttling_gpu_is_named_as_the_cause(w1_like_plan: Plan) -> None:
    """The coordinator's side (runtime/run/moves.py) on stepdone reports as the stages send them: the move's
    event names the device, its slowdown and, from the step's NVML telemetry, why."""
    from types import SimpleNamespace

    from hetero.runtime.run.moves import Mover

    mover = Mover(w1_like_plan, "auto")
    mover.started({0: 1e-4, 1: 1e-4})  # builds this fast: a move on the tiny model's milliseconds pays
    priced = Replanner(w1_like_plan).compute_s(tuple((s.first_node, s.last_node) for s in w1_like_plan.stages))
    hot = {"sm_clock_mhz": 1100, "max_sm_clock_mhz": 1980, "temperature_c": 87, "throttle": ["hw_thermal_slowdown"]}
    for step in range(36):
        slow = step >= 6
        done = {k: SimpleNamespace(meta={**REPORT, "step": step,
                                         "op_time_s": {"F": c / 3 * (3.3 if slow and k == 0 else 1),
                                                       "B": 2 * c / 3 * (3.3 if slow and k == 0 else 1)},
                                         **({"telemetry": hot} if slow and k == 0 else {})})
                for k, c in enumerate(priced)}
        mover.observe(step, done)
        if mover.pending is not None:
            break
    assert mover.pending is not None and mover.pending.after_step == 10
    cause = mover.pending.event.cause
    assert cause.stage == 0 and cause.device == w1_like_plan.stages[0].device
    assert cause.throttle == "thermal slowdown at 87 C, SM clock 1100 MHz of 1980"
    assert "3.30x slower" in cause.reason and cause.reason.endswith("(thermal slowdown at 87 C, SM clock "
                                                                    "1100 MHz of 1980)")
    assert mover.pending.event.new_split[0] < mover.pending.event.old_split[0]


def test_moves_back_off_and_stop_at_the_cap(w1_like_plan: Plan, capsys) -> None:
    """A watcher that proposes a move at every step (a device whose speed keeps changing): the run moves after
    waits that double, and after MAX_MOVES it keeps its split to the end, saying so once."""
    from types import SimpleNamespace

    from hetero.runtime.run import moves
    from hetero.runtime.run.metrics_file import MoveCause, RebalanceEvent
    from hetero.runtime.run.moves import Move, Mover

    plan = replace(w1_like_plan, train=replace(w1_like_plan.train, steps=10_000))
    mover = Mover(plan, "auto")
    spans = [[s.first_node, s.last_node] for s in plan.stages]
    mover.watch = SimpleNamespace(observe=lambda *_: "propose", moved=lambda _p: None, declined=None)
    noise = RebalanceEvent(after_step=0, cause=MoveCause(reason="noise"), old_split=[], new_split=[], old_spans=[],
                           new_spans=[])
    mover._proposed = lambda after, proposal: Move(after, spans, [[] for _ in spans], noise, proposal)  # type: ignore[method-assign]
    done = {k: SimpleNamespace(meta={**REPORT, "op_time_s": {"F": 0.1, "B": 0.2}}) for k in range(len(plan.stages))}
    moved_after = []
    for step in range(5000):
        if mover.due(step):
            mover.moved(0.0)
            moved_after.append(step)
        mover.observe(step, done)
        mover.announce(step + 1, lambda _r: None)
    assert len(moved_after) == moves.MAX_MOVES and mover.watch is None
    gaps = [b - a for a, b in itertools.pairwise(moved_after)]
    assert gaps == [moves.MOVE_BACKOFF_STEPS * 2 ** n + 1 for n in range(moves.MAX_MOVES - 1)], gaps
    err = capsys.readouterr().err
    assert err.count("the most one run makes") == 1 and err.count("\n") == 1
