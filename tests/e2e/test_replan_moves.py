"""Rebalancing by a re-plan (runtime/run/replan_moves.py): plans whose layers cannot move in place (interleaved
chunks, data x pipeline replicas) watched per device, re-planned at the measured speeds when a device's speed
changed for good and the re-plan pays (replicas by the solver at the measured speeds), and said once when no move
can help.

The decisions are checked on a compiled interleaved plan of the tiny model, fed measured-time series made here;
the move itself (the run going on under the re-plan, exactly) is tests/e2e/test_interleaved_runtime.py's
``test_a_rebalancing_re_plan_of_an_interleaved_run_trains_like_one_process``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from metrics_rows import read_metrics, step_lines
from plans import make_plan
from reference import assert_close_to_scale

from hetero.plan import Plan
from hetero.planner.replan.recovery import Pricing, step_at_speeds
from hetero.planner.schedule.simulator import simulate_plan
from hetero.runtime.run.moves import MAX_MOVES, Mover
from hetero.runtime.stage.adapter import load_adapter_state
from hetero.specs import ModelSpec, TrainSpec

# A stage's stepdone as the coordinator's side reads it (hetero.protocol.StepDone), its op times given by each test.
REPORT = {"step": 0, "loss_sum": None, "num_label_tokens": None, "grad_sumsq": 0.0, "lr": 1e-4, "busy_s": 0.0,
          "wall_s": 0.0}


def _compiled(tmp: Path, *overrides: str) -> Plan:
    from hetero.cli import main

    assert main(["compile", "model=tiny", "hardware=local", "data.packing=false", "train.steps=200",
                 f"output={tmp}", *overrides]) == 0
    return Plan.load(tmp / "plan.json")


@pytest.fixture(scope="module")
def interleaved(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    plan = _compiled(tmp_path_factory.mktemp("replan") / "plan", "planner.num_stages=2", "planner.interleave=always")
    assert all(s.chunks for s in plan.stages) and len(plan.pipelines) == 1
    return plan


def _feed(mover: Mover, plan: Plan, steps: int, slow: dict[int, float], noise: float = 0.03, seed: int = 0,
          first: int = 0) -> int | None:
    """Steps of measured times as priced (x ``slow[k]`` on stage k from step 5 on, and noise): the step after
    which the mover has a re-plan due, or None."""
    rng = random.Random(seed)
    priced = Pricing(plan).compute_s(plan)
    for step in range(first, first + steps):
        done = {}
        for k, p in enumerate(priced):
            c = p * (slow.get(k, 1.0) if step >= 5 else 1.0) * (1 + rng.uniform(-noise, noise))
            done[k] = SimpleNamespace(meta={**REPORT, "step": step, "op_time_s": {"F": c / 3, "B": 2 * c / 3}})
        mover.observe(step, done)
        if mover.replan is not None:
            return step
    return None


def test_the_plan_at_the_measured_speeds_is_the_plan_where_they_are_priced(interleaved: Plan) -> None:
    assert step_at_speeds(interleaved, {}) == pytest.approx(simulate_plan(interleaved).step_time_s, rel=1e-12)
    slowed = step_at_speeds(interleaved, {interleaved.stages[0].device: 3.0})
    assert slowed > step_at_speeds(interleaved, {interleaved.stages[0].device: 1.5}) > simulate_plan(
        interleaved).step_time_s


@pytest.fixture(scope="module")
def streamed(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    plan = _compiled(tmp_path_factory.mktemp("replan") / "plan", "planner.num_stages=2", "planner.offload=full",
                     "+hardware.hosts.0.ram_gb=1")
    assert all(s.stream_layers for s in plan.stages) and len(plan.pipelines) == 1
    return plan


@pytest.mark.parametrize("shape", ["interleaved", "streamed"])
def test_a_compiled_plans_own_predictions_are_its_datasheet_prices(shape: str, request: pytest.FixtureRequest) -> None:
    """The re-plan prices both plans by the datasheet table; for a plan compiled on datasheet costs that is what it
    stores (a plan compiled with ``profile=`` stores the profile's, which Pricing leaves aside), a streaming stage's
    copies of its layers' weights included."""
    interleaved: Plan = request.getfixturevalue(shape)
    pricing = Pricing(interleaved)
    assert pricing.step_at_speeds(interleaved, {}) == pytest.approx(simulate_plan(interleaved).step_time_s, rel=1e-9)
    m = interleaved.train.num_micro_batches
    assert pricing.compute_s(interleaved) == pytest.approx(
        [m * (s.fwd_time_s + s.bwd_time_s + sum(c.fwd_time_s + c.bwd_time_s for c in s.chunks))
         for s in interleaved.stages], rel=1e-9)
    doubled = replace(interleaved, stages=[replace(s, fwd_time_s=2 * s.fwd_time_s) for s in interleaved.stages])
    assert pricing.compute_s(doubled) == pytest.approx(pricing.compute_s(interleaved), rel=1e-12)


def test_noise_never_re_plans_an_interleaved_run(interleaved: Plan, capsys) -> None:
    for seed in range(3):
        mover = Mover(interleaved, "auto")
        assert mover.replanner is not None and mover.watch is None
        assert _feed(mover, interleaved, 60, {}, noise=0.1, seed=seed) is None
    assert capsys.readouterr().err == ""


def test_a_sustained_slowdown_re_plans_layers_off_the_slow_device(interleaved: Plan, capsys) -> None:
    mover = Mover(interleaved, "auto")
    mover.started({0: 0.5, 1: 0.5}, 2.0)
    # 1 warm-up step, 3 calibrating, then 4 sustained slow steps from step 5: decided after step 8.
    assert _feed(mover, interleaved, 40, {0: 3.0}) == 8
    replan = mover.replan
    assert replan is not None and replan.after_step == 9
    assert mover.replan_due(8) is None and mover.replan_due(9) is replan and mover.replan_due(9) is None
    event = replan.event
    assert event.new_split[0] < event.old_split[0] and sum(event.new_split) == sum(event.old_split)
    assert event.predicted_gain is not None and event.predicted_gain >= 1.15
    assert event.cause.stage == 0 and event.cause.slowdown == pytest.approx(3.0, rel=0.1)
    assert "runs 3." in event.cause.reason and "re-planned" in event.cause.reason
    assert [s.device for s in replan.plan.stages] == [s.device for s in interleaved.stages]
    assert [s.name for s in replan.plan.stages] == [interleaved.stage_id(k) for k in range(len(interleaved.stages))]
    assert replan.plan.verdict[0].startswith("Re-planned during the run at the speeds it measured")
    assert capsys.readouterr().err == ""


def test_a_streaming_plan_is_re_planned_with_its_streamed_layers_and_caps_for_the_new_spans(streamed: Plan,
                                                                                              capsys) -> None:
    """A plan that streams every layer from host RAM (planner.offload=full): a lasting 3x slowdown of device 0 moves
    layers to device 1, and the new plan streams each stage's own layers, under a resident cap planned for them."""
    mover = Mover(streamed, "auto")
    assert mover.replanner is not None and mover.watch is None  # its spans do not move in place
    mover.started({0: 0.5, 1: 0.5}, 2.0)
    assert _feed(mover, streamed, 40, {0: 3.0}) == 8
    replan = mover.replan
    assert replan is not None
    event, new = replan.event, replan.plan
    assert event.new_split[0] < event.old_split[0] and sum(event.new_split) == sum(event.old_split)
    assert event.predicted_gain is not None and event.predicted_gain >= 1.15
    for stage in new.stages:
        assert stage.stream_layers == [n for n in stage.node_names if n.startswith("layers.")]
        assert stage.frozen_resident_cap_bytes > 0
    # Stage 1 streams more layers than before: what it copies per step grows with them.
    assert new.stages[1].streamed_bytes_per_step > streamed.stages[1].streamed_bytes_per_step
    assert capsys.readouterr().err == ""


def test_a_re_plan_that_cannot_pay_is_said_once_and_not_made(interleaved: Plan, capsys) -> None:
    mover = Mover(interleaved, "auto")
    mover.started({0: 0.5, 1: 0.5}, 1e6)  # a restart as long as the run: nothing pays
    assert _feed(mover, interleaved, 60, {0: 3.0}) is None
    err = capsys.readouterr().err
    assert err.count("no move can help") == 1 and err.count("\n") == 1, err
    assert "less than twice the 1e+06 s a restart of the stages costs" in err


def test_a_slowed_replica_is_re_planned_at_the_measured_speeds(tmp_path: Path, capsys) -> None:
    """Two one-stage replicas sharing the step's micro-batches evenly: a lasting 3x slowdown of one re-plans them by
    the solver at the measured speeds, which gives the slowed device less of the step (fewer micro-batches, or fewer
    layers in a pipeline with the other)."""
    plan = _compiled(tmp_path / "plan", "planner.replicas=2", "hardware.num_devices=2")
    assert len(plan.pipelines) == 2 and [r.num_micro_batches for r in plan.pipelines] == [4, 4]
    mover = Mover(plan, "auto")
    mover.started({0: 0.5, 1: 0.5}, 0.5)
    assert _feed(mover, plan, 40, {0: 3.0}) == 8
    assert mover.replan is not None
    new, slow = mover.replan.plan, plan.stages[0].device
    share = {s.device: sum(r.num_micro_batches for r in new.pipelines if k in r.stages)
             * len([i for i in s.nodes() if new.graph.nodes[i].kind == "decoder"]) for k, s in enumerate(new.stages)}
    assert share.get(slow, 0) < max(share.values()), share  # less of the step's work on the slowed device
    event = mover.replan.event
    assert event.predicted_gain is not None and event.predicted_gain >= 1.15
    assert new.verdict[0].startswith("Re-planned during the run at the speeds it measured")
    assert capsys.readouterr().err == ""


def test_off_or_the_cap_keeps_the_plan(interleaved: Plan, capsys) -> None:
    assert Mover(interleaved, "off").replanner is None
    forced = Mover(interleaved, "off", replans={3: {interleaved.stages[0].device: 4.0}})
    assert forced.replanner is not None and forced.replanner.watch is None
    assert _feed(forced, interleaved, 10, {}) == 2 and forced.replan is not None
    capped = Mover(interleaved, "auto", made=MAX_MOVES)
    assert capped.replanner is not None and capped.replanner.watch is None
    assert _feed(capped, interleaved, 40, {0: 3.0}) is None
    assert capsys.readouterr().err.count("the most one run makes") == 1


def test_a_run_near_its_end_is_not_re_planned(interleaved: Plan) -> None:
    plan = replace(interleaved, train=replace(interleaved.train, steps=9))
    mover = Mover(plan, "auto")
    mover.started({0: 0.5, 1: 0.5}, 0.01)
    assert _feed(mover, plan, 9, {0: 3.0}) is None  # decided after step 8 at the earliest: no step would be left


SEQ_LEN = 32
TRAIN = TrainSpec(micro_batch_size=2, num_micro_batches=4, steps=3, lr=2e-3, scheduler="cosine", warmup_steps=1,
                  max_grad_norm=0.3, seed=3, shuffle=True)


def test_a_re_plan_of_replicas_trains_like_one_process(references: Callable[..., dict], tiny_model_dir: Path,
                                                       tiny_spec: ModelSpec) -> None:
    """Two one-stage replicas on stage processes (2 micro-batches each), device 0 measured 4x slower after step 1
    (forced): the solver re-plans at the measured speeds, the run goes on under plan-rebalance-1.json with less of
    the step on device 0, and the losses and saved adapter are transformers+peft's (every micro-batch of a step is
    still trained once, whichever replica trains it)."""
    from hetero.plan import compute_input_hash
    from hetero.runtime.run.elastic import run_elastic
    from hetero.runtime.run.options import RunOptions

    setup = references(tiny_model_dir, TRAIN, SEQ_LEN)
    hand = make_plan(tiny_model_dir, tiny_spec.architecture, [[6], [6]], train=TRAIN,  # type: ignore[list-item]
                     lora=setup["lora"], seq_len=SEQ_LEN, shares=[2, 2])
    # The hand-built graph prices no compute: its decoder layers get ~1 ms a micro-batch, so that compute decides.
    plan = replace(hand, graph=replace(hand.graph, nodes=[
        replace(n, fwd_flops_per_token=6e6, bwd_flops_per_token=1.2e7) if n.kind == "decoder" else n
        for n in hand.graph.nodes]))
    plan = replace(plan, input_hash=compute_input_hash(plan))
    run_dir = setup["root"] / "run-replicas-replan"
    run_dir.mkdir()
    plan.save(run_dir / "plan.json")
    slow = plan.stages[0].device
    final, path, _ = run_elastic(plan, run_dir / "plan.json",
                                 RunOptions(run_dir=run_dir, progress=False, replans={1: {slow: 4.0}}))
    assert path.name == "plan-rebalance-1.json"
    work = {s.device: sum(r.num_micro_batches for r in final.pipelines if k in r.stages)
            * len([i for i in s.nodes() if final.graph.nodes[i].kind == "decoder"]) for k, s in enumerate(final.stages)}
    assert work.get(slow, 0) < 2 * 6, work  # device 0 did 2 micro-batches x 6 layers before
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["after_step"] for r in rows if r.get("event") == "rebalance"] == [1]
    steps = step_lines(rows)
    assert [r["loss"] for r in steps] == pytest.approx(setup["losses"], rel=1e-5)
    trained = load_adapter_state(run_dir / "adapter", setup["lora"])
    assert set(trained) == set(setup["state"])
    for key, want in setup["state"].items():
        assert_close_to_scale(key, trained[key], want, 1e-5)


def test_a_re_plan_of_a_streaming_pipeline_trains_like_one_process(references: Callable[..., dict],
                                                                  tiny_model_dir: Path, tiny_spec: ModelSpec) -> None:
    """Two stages streaming every layer's frozen weights from host RAM (planned by the planner with
    planner.offload=full), device 0 measured 4x slower after step 1 (forced): the run goes on under
    plan-rebalance-1.json, whose stages stream their new layers under the caps planned for them, and the losses and
    saved adapter are transformers+peft's."""
    from hetero.planner import plan as make_planned
    from hetero.planner.model.cost_model import plan_roofline
    from hetero.planner.replan.recovery import named_like
    from hetero.runtime.run.elastic import run_elastic
    from hetero.runtime.run.options import RunOptions

    setup = references(tiny_model_dir, TRAIN, SEQ_LEN)
    hand = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3], train=TRAIN, lora=setup["lora"], seq_len=SEQ_LEN)
    cluster = replace(hand.cluster, hosts=[replace(h, ram_gb=1.0) for h in hand.cluster.hosts])
    options = replace(hand.planner, devices=[s.device for s in hand.stages], split=[3, 3], num_stages=None, replicas=1,
                      interleave="off", offload="full")
    # The hand-built graph prices neither compute nor memory: each decoder layer gets ~1 ms a micro-batch, and every
    # node its parameters as saved (fp32), of which the projections are the Linear weights that stream.
    from math import prod

    from safetensors import safe_open

    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as h:
        numel = {key: prod(h.get_slice(key).get_shape()) for key in h.keys()}

    def priced(n: Any) -> Any:
        params = sum(numel.get(k, 0) for k in n.param_names)
        n = replace(n, num_params=params, param_bytes=4 * params)
        if n.kind != "decoder":
            return n
        return replace(n, fwd_flops_per_token=6e6, bwd_flops_per_token=1.2e7,
                       linear_params=sum(numel[k] for k in n.param_names if k.endswith("_proj.weight")))

    graph = replace(hand.graph, nodes=[priced(n) for n in hand.graph.nodes])
    plan = named_like(replace(make_planned(hand.model, graph, cluster, hand.train, hand.data, options,
                                           plan_roofline(hand), hand.eval, hand.config, hand.data_stats),
                              security=hand.security), hand)
    assert [len(s.stream_layers) for s in plan.stages] == [3, 3]
    run_dir = setup["root"] / "run-streamed-replan"
    run_dir.mkdir()
    plan.save(run_dir / "plan.json")
    final, path, _ = run_elastic(plan, run_dir / "plan.json",
                                 RunOptions(run_dir=run_dir, progress=False, replans={1: {plan.stages[0].device: 4.0}}))
    assert path.name == "plan-rebalance-1.json"
    assert len(final.stages[0].stream_layers) < 3 and sum(len(s.stream_layers) for s in final.stages) == 6
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["after_step"] for r in rows if r.get("event") == "rebalance"] == [1]
    steps = step_lines(rows)
    assert [len(r["stage_streamed_bytes"]) for r in steps] == [2, 2, 2]
    assert [r["loss"] for r in steps] == pytest.approx(setup["losses"], rel=1e-5)
    trained = load_adapter_state(run_dir / "adapter", setup["lora"])
    assert set(trained) == set(setup["state"])
    for key, want in setup["state"].items():
        assert_close_to_scale(key, trained[key], want, 1e-5)
