"""Verdict lines that say where a plan's datasheet costs leave out what runs: issuing a layer's operators.

A decoder layer is a few hundred operator calls. Where its arithmetic is small (a small model, a short micro-batch, a
fast device), calling them takes longer than the arithmetic the roofline prices, and the plan's step is predicted too
fast. The cost model has no such term (the solver ranks placements by arithmetic); these lines say so, with the
factor to expect, and `hetero profile` measures it.
"""

from __future__ import annotations

from typing import Any

from hetero.plan import StagePlan
from hetero.planner.model.cost_model import CostModel
from hetero.planner.model.profile_cost import ProfileCostModel
from hetero.planner.schedule.step_form import linear_step
from hetero.specs import EvalSpec, TrainSpec

# What a GPU stage takes, at least, to issue one decoder layer's forward and backward for a micro-batch from Python:
# about 430 operator calls (a Llama layer with LoRA on its 7 projections, counted at torch's dispatcher), measured on
# an H200 host on 2026-11-28 (docs/gpu.md): 5.5-6.7 ms per layer under transformers+peft (a synced micro-batch over
# 12 layers, arithmetic included, about 1 ms of it), 6.9 ms under a hetero stage. Datasheet arithmetic below this
# is not what runs.
ISSUE_FLOOR_S = 0.006
# A CPU stage computes its operators one after another on the calling thread, so calling them adds to the arithmetic.
# Measured on the 2-vCPU Xeon sandbox on 2026-11-29: the tiny test Llama's decoder layer (hidden 64, LoRA) ran its 307
# operators forward and backward at 512 tokens in 6.75 ms, about 22 us each (a bare in-place add took 3.9 us), of
# which its datasheet arithmetic (cpu.yaml at planner.efficiency 0.4) is about 3 ms: the calls cost the other 3.75 ms.
# Faster cores call faster.
CPU_CALLS_S = 0.00375


def issue_bound_lines(stages: list[StagePlan], cost_model: CostModel) -> list[str]:
    """The verdict's warning where datasheet costs put a stage's decoder layers under what issuing them takes."""
    if isinstance(cost_model, ProfileCostModel):  # measured layers include what issuing them cost
        return []
    out = []
    for s in stages:
        layers = sum(1 for name in s.node_names + [n for c in s.chunks for n in c.node_names]
                     if name.startswith("layers."))
        if layers == 0:
            continue
        per_layer = s.compute_s() / layers  # every chunk's
        if per_layer <= 0:  # a fleet file's made-up device of no time at all: nothing to compare with
            continue
        if s.backend == "cpu":  # the calls add to the arithmetic
            factor, took = (per_layer + CPU_CALLS_S) / per_layer, (
                "the ~4 ms a 2-vCPU Xeon took beyond its datasheet arithmetic to call a tiny decoder layer's ~300 "
                "operators one after another (docs/profiling.md)")
            more = "or more on such a CPU"
        else:  # issued ahead of a GPU's kernels: the larger of the two
            factor, took = ISSUE_FLOOR_S / per_layer, ("the ~6 ms a GPU host took to issue its ~430 operators from "
                                                       "Python (an H200's, docs/gpu.md)")
            more = "or more"
        if factor < 2:  # at least twice off: within that, the pipeline's overlap may hide it
            continue
        under = "beside" if s.backend == "cpu" else "under"
        out.append(f"Stage {s.index} ({s.device}): the datasheet prices a decoder layer's forward and backward at "
                   f"{per_layer * 1e3:.2g} ms per micro-batch, {under} {took}: expect this stage {factor:.0f}x "
                   f"slower than predicted {more}; `hetero profile` measures it (larger micro-batches amortize it).")
    return out


def stage_eval_lines(evaluation: EvalSpec, stages: list[StagePlan], replicas: list[Any], train: TrainSpec,
                      step_s: float) -> list[str]:
    """What evaluating on the training stages costs (eval.every without eval.device): each round forwards one step's
    micro-batches of the first pipeline, fill then one per slowest forward (runtime/run/stage_eval.py)."""
    if evaluation.every <= 0 or evaluation.device is not None:
        return []
    first = [stages[k] for k in replicas[0].stages] if replicas else stages
    m = replicas[0].num_micro_batches if replicas else train.num_micro_batches
    rounds = -(-evaluation.max_batches // m)
    one = linear_step(sum(s.fwd_time_s + s.send_time_s for s in first), m, max(s.fwd_time_s for s in first))
    share = rounds * one / (evaluation.every * step_s) if step_s > 0 else 0.0
    return [f"Evaluation on the training stages every {evaluation.every} step(s): {rounds} forward round(s) of {m} "
            f"micro-batch(es), predicted {rounds * one:.3g} s each time ({share:.1%} of training time); eval.device "
            "moves it to a device kept out of training."]
