"""The optimizer step's arithmetic on the coordinator: the global gradient norm, ``clip_grad_norm_``'s
coefficient, and with pipeline replicas the sum of every replica's LoRA gradients.

Sums run in a fixed order (stage order, replica order), never arrival order: the same run gives the
same bits. The messages that carry these numbers are the coordinator's (runtime/run/coordinator.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from hetero.plan import Plan
from hetero.runtime.base.processes import StageFailedError

if TYPE_CHECKING:
    import torch


def clip_coef(max_norm: float, grad_norm: float) -> float:
    """clip_grad_norm_'s rule: scale by max_norm / (norm + 1e-6), never above 1 (max_norm 0: no clipping)."""
    return min(1.0, max_norm / (grad_norm + 1e-6)) if max_norm > 0 else 1.0


def norm_from_sumsq(sumsq: dict[int, float]) -> float:
    """The global gradient norm from each stage's squared norm, summed in stage order."""
    return math.sqrt(sum(sumsq[k] for k in sorted(sumsq)))


def norm_of(totals: dict[str, torch.Tensor]) -> float:
    """The global gradient norm of the summed gradients, in float64, in key order."""
    return math.sqrt(sum(float(totals[key].double().pow(2).sum()) for key in sorted(totals)))


def sum_replica_grads(plan: Plan, grads: dict[int, dict[str, torch.Tensor]], step: int) -> dict[str, torch.Tensor]:
    """Per LoRA key, the sum of every replica's gradient, added in replica order (the same bits every run).

    Every replica holds the whole model, so each key arrives once from each replica, with one shape;
    anything else is a stage that trains something else (a one-line error, nothing is applied)."""
    totals: dict[str, torch.Tensor] = {}
    for r, rep in enumerate(plan.pipelines):
        seen: set[str] = set()
        for k in rep.stages:
            for key, t in grads[k].items():
                if key in seen:
                    raise StageFailedError(f"step {step}: two stages of replica {r} sent gradients for {key}")
                seen.add(key)
                if r == 0:
                    totals[key] = t.clone()
                elif key not in totals or totals[key].shape != t.shape:
                    raise StageFailedError(f"step {step}: stage {k} (replica {r}) sent gradient {key} "
                                           f"{tuple(t.shape)}, which replica 0 does not train with that shape: "
                                           "the hosts run different plans or models")
                else:
                    totals[key] += t
        if seen != set(totals):
            missing = sorted(set(totals) - seen)
            raise StageFailedError(f"step {step}: replica {r} sent no gradient for {missing[0]}: the hosts run "
                                   "different plans or models")
    return totals
