"""Pipeline schedules as data: per-stage programs of hetero.program Actions (1F1B, GPipe).

The generators only: each schedule's step algebra (what it holds, its closed form) is its step form in
planner/step_form.py, which registers the generators and serves ``programs_for``.

A schedule is a pure function of (num_stages, num_micro_batches). Each forward is wrapped as
``RA F SA`` and each backward as ``RG B SG``, with the receives/sends a stage does not have left
out (stage 0 receives no activation and sends no gradient; the last stage sends no activation and
receives no gradient, because its F computes the loss and its B starts from it). ``STEP`` is last.
"""

from __future__ import annotations

from hetero.errors import ConfigError
from hetero.program import Action, Op


def _forward(stage: int, num_stages: int, mb: int) -> list[Action]:
    out = []
    if stage > 0:
        out.append(Action(Op.RA, mb))
    out.append(Action(Op.F, mb))
    if stage < num_stages - 1:
        out.append(Action(Op.SA, mb))
    return out


def _backward(stage: int, num_stages: int, mb: int) -> list[Action]:
    out = []
    if stage < num_stages - 1:
        out.append(Action(Op.RG, mb))
    out.append(Action(Op.B, mb))
    if stage > 0:
        out.append(Action(Op.SG, mb))
    return out


def _check(num_stages: int, num_micro_batches: int) -> None:
    if num_stages < 1:
        raise ConfigError(f"a pipeline needs at least 1 stage, got num_stages={num_stages}")
    if num_micro_batches < 1:
        raise ConfigError(f"train.num_micro_batches must be at least 1, got {num_micro_batches}")


def warmup_forwards(stage: int, num_stages: int, num_micro_batches: int) -> int:
    """Forwards stage ``stage`` runs before its first backward under 1F1B (PipeDream-flush)."""
    return min(num_stages - stage - 1, num_micro_batches)


def one_f_one_b(num_stages: int, num_micro_batches: int) -> list[list[Action]]:
    """1F1B (PipeDream-flush): warm-up forwards, then one forward / one backward, then cool-down."""
    _check(num_stages, num_micro_batches)
    m = num_micro_batches
    programs: list[list[Action]] = []
    for k in range(num_stages):
        warmup = warmup_forwards(k, num_stages, m)
        prog: list[Action] = []
        for mb in range(warmup):
            prog += _forward(k, num_stages, mb)
        # Steady state: the forward of micro-batch (warmup + i) then the backward of micro-batch i,
        # so a stage never holds more than warmup + 1 = min(S - k, m) activations.
        for i in range(m - warmup):
            prog += _forward(k, num_stages, warmup + i)
            prog += _backward(k, num_stages, i)
        for mb in range(m - warmup, m):
            prog += _backward(k, num_stages, mb)
        prog.append(Action(Op.STEP))
        programs.append(prog)
    return programs


def gpipe(num_stages: int, num_micro_batches: int) -> list[list[Action]]:
    """GPipe: every forward, then every backward (in micro-batch order), then the optimizer step."""
    _check(num_stages, num_micro_batches)
    programs: list[list[Action]] = []
    for k in range(num_stages):
        prog: list[Action] = []
        for mb in range(num_micro_batches):
            prog += _forward(k, num_stages, mb)
        for mb in range(num_micro_batches):
            prog += _backward(k, num_stages, mb)
        prog.append(Action(Op.STEP))
        programs.append(prog)
    return programs
