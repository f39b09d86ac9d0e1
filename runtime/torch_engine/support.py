"""What `--engine torch` cannot run yet, as one line naming the plan's option and `--engine hetero` (torch-free).

The torch engine is torch.distributed: one backend for every process (gloo on CPU, NCCL on CUDA), one torch
on every host, processes started by torch's launcher (one per host). Plans that need more are hetero's
engine's reason to exist, and are refused before anything starts.
"""

from __future__ import annotations

from hetero.errors import PlanError
from hetero.plan import Plan
from hetero.planner.schedule.step_form import FORMS

# ROCm's torch names AMD cards "cuda" devices and serves the "nccl" backend with RCCL.
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "rocm": "nccl"}


class EngineUnsupportedError(PlanError):
    """A plan (or run option) the torch engine does not run: use hetero's engine."""


def _refuse(what: str) -> EngineUnsupportedError:
    return EngineUnsupportedError(f"--engine torch cannot run this plan: {what}; run it with `--engine hetero` "
                                  "(the default), which runs every plan")


def check_supported(plan: Plan, host: str | None) -> str:
    """The torch.distributed backend for ``plan`` (gloo or nccl); raises EngineUnsupportedError naming what is not.

    ``host``: where `hetero run` starts it (None: stage 0's host), which must be stage 0's when it spans hosts."""
    kinds = sorted({s.backend for s in plan.stages})
    if set(kinds) == {"cuda", "rocm"}:
        raise _refuse("it mixes NVIDIA (cuda) and AMD (rocm) cards, and one torch build with one collective library "
                      "(NCCL or RCCL) serves one vendor")
    if len(kinds) > 1:
        raise _refuse(f"its stages run on different device kinds ({', '.join(kinds)}), and one torch.distributed "
                      "backend serves one kind")
    if kinds[0] not in BACKENDS:
        raise _refuse(f"its stages run on '{kinds[0]}' devices; torch.distributed pipelines here on "
                      f"{', '.join(BACKENDS)}")
    first = plan.stages[0].host
    if host is not None and host != first and any(s.host != first for s in plan.stages):
        raise _refuse(f"on several hosts it starts on stage 0's host, '{first}' (rank 0, the rendezvous and the run's "
                      f"records live there), not on '{host}'")
    squeezed = next((s.compress_out for s in plan.stages if s.compress_out != "none"), None)
    if squeezed is not None:
        raise _refuse(f"planner.compression={squeezed} (torch's pipeline stages hand tensors to each other as they "
                      "are)")
    if any(s.chunks for s in plan.stages):
        raise _refuse("its devices hold chunks of layers (planner.interleave), and this engine builds one module per "
                      "rank (or recompile with planner.interleave=off)")
    form = FORMS.get(plan.train.schedule)
    if form is None or not form.torch_class:
        ran = ", ".join(name for name, f in FORMS.items() if f.torch_class)
        raise _refuse(f"train.schedule={plan.train.schedule} (this engine runs {ran})")
    sizes = sorted({len(rep.stages) for rep in plan.pipelines})
    if len(sizes) > 1:
        raise _refuse(f"its replicas have {' and '.join(map(str, sizes))} stages, and a DeviceMesh is a grid")
    first = [plan.stages[k].node_names for k in plan.pipelines[0].stages]
    for r, rep in enumerate(plan.pipelines[1:], start=1):
        if [plan.stages[k].node_names for k in rep.stages] != first:
            raise _refuse(f"replica {r} splits the layers otherwise than replica 0, and the mesh's data-parallel "
                          "dimension all-reduces the LoRA gradients of stage p of every replica (recompile with "
                          "replicas of one split)")
    short = [r for r, rep in enumerate(plan.pipelines) if rep.num_micro_batches < len(rep.stages)]
    if form.torch_needs_full_fill and short:
        rep = plan.pipelines[short[0]]
        raise _refuse(f"replica {short[0]} has {rep.num_micro_batches} micro-batch(es) for {len(rep.stages)} stages, "
                      f"and torch's {form.torch_class} needs at least one per stage (raise train.num_micro_batches)")
    if plan.data.packing:
        raise _refuse("data.packing=true (every stage needs each packed record's positions, which torch's "
                      "PipelineStage does not carry); recompile with data.packing=false for this engine")
    if plan.eval.every > 0:
        raise _refuse(f"eval.every={plan.eval.every} (held-out evaluation during the run; pass eval.every=0)")
    return BACKENDS[kinds[0]]
