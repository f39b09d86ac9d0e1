"""Verdict lines that say where a plan's datasheet costs leave out what runs: issuing a layer's operators.

A decoder layer is a few hundred operator calls. Where its arithmetic is small (a small model, a short micro-batch, a
fast device), calling them takes longer than the arithmetic the roofline prices, and the plan's step is predicted too
fast. The cost model has no such term (the solver ranks placements by arithmetic); these lines say so, with the
factor to expect, and `hetero profile` measures it.
"""

from __future__ import annotations

from hetero.plan import StagePlan
from hetero.planner.cost_model import CostModel
from hetero.planner.profile_cost import ProfileCostModel

# What a GPU stage takes, at least, to issue one decoder layer's forward and backward for a micro-batch from Python:
# about 430 operator calls (a Llama layer with LoRA on its 7 projections, counted at torch's dispatcher), measured on
# an H200 host on 2026-11-28 (docs/gpu.md): 5.5-6.7 ms per layer under transformers+peft (a synced micro-batch over
# 12 layers, arithmetic included, about 1 ms of it), 6.9 ms under a hetero stage. Datasheet arithmetic below this
# is not what runs.
ISSUE_FLOOR_S = 0.006
# A CPU stage computes its operators one after another on the calling thread, so their calls add to the arithmetic.
# Measured on the 2-vCPU Xeon sandbox on 2026-11-29: the tiny test Llama's decoder layer (hidden 64, LoRA) runs 307
# operators forward and backward at 512 tokens in 6.75 ms, about 22 us each, arithmetic included (a bare in-place
# add took 3.9 us). Faster cores call faster; a layer priced under half of this is not what runs on such a CPU.
CPU_ISSUE_FLOOR_S = 0.00675


def issue_bound_lines(stages: list[StagePlan], cost_model: CostModel) -> list[str]:
    """The verdict's warning where datasheet costs put a stage's decoder layers under what issuing them takes."""
    if isinstance(cost_model, ProfileCostModel):  # measured layers include what issuing them cost
        return []
    out = []
    for s in stages:
        layers = sum(1 for name in s.node_names if name.startswith("layers."))
        if layers == 0:
            continue
        per_layer = (s.fwd_time_s + s.bwd_time_s) / layers
        floor = CPU_ISSUE_FLOOR_S if s.backend == "cpu" else ISSUE_FLOOR_S
        if per_layer >= floor / 2:  # at least twice off: within that, the pipeline's overlap may hide it
            continue
        took = ("the ~6 ms a GPU host took to issue its ~430 operators from Python (an H200's, docs/gpu.md)"
                if s.backend != "cpu" else "the ~7 ms a 2-vCPU Xeon took to run a tiny decoder layer's ~300 "
                "operators one after another, whatever their arithmetic (docs/profiling.md)")
        more = "or more on such a CPU" if s.backend == "cpu" else "or more"
        out.append(f"Stage {s.index} ({s.device}): the datasheet prices a decoder layer's forward and backward at "
                   f"{per_layer * 1e3:.2g} ms per micro-batch, under {took}: expect this stage {floor / per_layer:.0f}x "
                   f"slower than predicted {more}; `hetero profile` measures it (larger micro-batches amortize it).")
    return out
