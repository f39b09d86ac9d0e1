"""Pipeline schedules as data: per-stage programs of hetero.program Actions (1F1B, GPipe, interleaved 1F1B).

The generators only: each schedule's step algebra (what it holds, its closed form) is its step form in
planner/schedule/step_form.py, which registers the generators and serves ``programs_for``.

A schedule is a pure function of (num_stages, num_micro_batches). Each forward is wrapped as
``RA F SA`` and each backward as ``RG B SG``, with the receives/sends a stage does not have left
out (stage 0 receives no activation and sends no gradient; the last stage sends no activation and
receives no gradient, because its F computes the loss and its B starts from it). ``STEP`` is last.
"""

from __future__ import annotations

from hetero.errors import ConfigError
from hetero.program import Action, Op


def _forward(stage: int, num_stages: int, mb: int, chunk: int = 0) -> list[Action]:
    """``stage``: the (virtual) stage's index among ``num_stages``; ``chunk``: the device's chunk it is."""
    out = []
    if stage > 0:
        out.append(Action(Op.RA, mb, chunk))
    out.append(Action(Op.F, mb, chunk))
    if stage < num_stages - 1:
        out.append(Action(Op.SA, mb, chunk))
    return out


def _backward(stage: int, num_stages: int, mb: int, chunk: int = 0) -> list[Action]:
    out = []
    if stage < num_stages - 1:
        out.append(Action(Op.RG, mb, chunk))
    out.append(Action(Op.B, mb, chunk))
    if stage > 0:
        out.append(Action(Op.SG, mb, chunk))
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


def interleaved_warmup(device: int, num_devices: int, num_micro_batches: int, chunks: int) -> int:
    """Forward units (a micro-batch through one chunk) device ``device`` runs before its first backward under
    interleaved 1F1B: twice its distance from the last device, plus a round of every device's other chunks
    (as torch.distributed.pipelining's ScheduleInterleaved1F1B; Megatron-LM runs every forward first when
    the micro-batches are as many as the devices, which sends never blocking make unnecessary here)."""
    return min(2 * (num_devices - device - 1) + (chunks - 1) * num_devices, num_micro_batches * chunks)


def _interleaved_unit(k: int, num_devices: int, chunks: int, forward: bool) -> tuple[int, int]:
    """(micro-batch, chunk) of a device's k-th forward or backward unit: micro-batches go in groups of
    ``num_devices`` through chunk 0, then the same group through chunk 1, ...; backwards through the chunks
    in reverse."""
    group = k // (num_devices * chunks)
    chunk = (k // num_devices) % chunks
    return group * num_devices + k % num_devices, chunk if forward else chunks - 1 - chunk


def interleaved_one_f_one_b(num_devices: int, num_micro_batches: int, chunks: int = 2) -> list[list[Action]]:
    """Interleaved 1F1B (Megatron-LM's virtual pipeline): each device holds ``chunks`` chunks of layers,
    chunk c of device d being virtual stage c x num_devices + d, so a micro-batch passes every device
    ``chunks`` times and the fill and drain shrink by that factor, for ``chunks`` times the hand-offs.

    One program per device, its actions naming their chunk. A device runs its warm-up forwards
    (interleaved_warmup), then one forward / one backward, then the cool-down backwards. The
    micro-batches must come in whole groups of ``num_devices`` (as in Megatron-LM)."""
    _check(num_devices, num_micro_batches)
    if chunks < 1:
        raise ConfigError(f"an interleaved schedule needs at least 1 chunk per device, got {chunks}")
    if num_micro_batches % num_devices:
        raise ConfigError(f"interleaved 1F1B runs micro-batches in groups of the pipeline's {num_devices} devices: "
                          f"train.num_micro_batches={num_micro_batches} is not a multiple of {num_devices}")
    total, virtual = num_micro_batches * chunks, num_devices * chunks
    programs: list[list[Action]] = []
    for d in range(num_devices):
        def fwd(k: int, d: int = d) -> list[Action]:
            mb, c = _interleaved_unit(k, num_devices, chunks, True)
            return _forward(c * num_devices + d, virtual, mb, c)

        def bwd(k: int, d: int = d) -> list[Action]:
            mb, c = _interleaved_unit(k, num_devices, chunks, False)
            return _backward(c * num_devices + d, virtual, mb, c)

        warmup = interleaved_warmup(d, num_devices, num_micro_batches, chunks)
        prog = [a for k in range(warmup) for a in fwd(k)]
        for i in range(total - warmup):
            prog += fwd(warmup + i) + bwd(i)
        prog += [a for k in range(total - warmup, total) for a in bwd(k)]
        programs.append(prog + [Action(Op.STEP)])
    return programs
