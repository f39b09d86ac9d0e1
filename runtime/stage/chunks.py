"""An interleaved device: one stage process serving several chunks of layers (hetero/program.py).

Under an interleaved schedule (planner/schedule/schedules.py interleaved_one_f_one_b) device d of p holds v
chunks; chunk c is virtual stage c x p + d of a pipeline of p x v. Each chunk is a Stage of its own
(its layers, its LoRA weights) run by an Executor of its own (its activations in flight, its AdamW,
which is per element, so one optimizer per chunk steps as one over all of them would). The device's
program names the chunk of each action, and this runner hands the action to that chunk's executor.
A chunk's activations come from the device before (the last device, for device 0's chunks after the
first) and go to the device after (device 0, from the last device); each act and grad names the
chunk it is for, so that a device receiving two chunks' messages from one peer tells them apart.

The optimizer step is the device's: one squared gradient norm (its chunks' sum) to the coordinator,
one clip coefficient back, then every chunk steps; the step's measurements are the device's too.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

from hetero.errors import PlanError
from hetero.program import Action
from hetero.runtime.stage.executor import (
    COMPUTE_OPS,
    Executor,
    StepStats,
    Wire,
    apply_step,
    clip_round_trip,
    grad_sumsq,
    run_program,
)
from hetero.runtime.stage.model import Stage
from hetero.runtime.stage.telemetry import sample as sample_telemetry
from hetero.security import stage_name
from hetero.specs import TrainSpec


class ChunkedExecutor:
    """Executes an interleaved device's program (chunks named per action) over its chunks' executors."""

    def __init__(self, stages: list[Stage], program: list[Action], wire: Wire, train: TrainSpec, device: int,
                 num_devices: int, names: Callable[[int], str] = stage_name,
                 compress: Sequence[str] | None = None) -> None:
        """``stages``: the device's chunks in order (chunk c is virtual stage c x ``num_devices`` + ``device``);
        ``names``: a device's process name; ``compress``: each device's scheme for what it hands to the next
        device (the last device's: to the first, over the ring; runtime/wire/compress.py), "none" throughout
        by default. A chunk decodes what comes from the device before it in that device's scheme."""
        chunks = len(stages)
        if sorted({a.chunk for a in program if a.op != "STEP"}) != list(range(chunks)):
            raise PlanError(f"stage {device}: its program names other chunks than the {chunks} it holds")
        if any(s.streamer is not None for s in stages):
            raise PlanError(f"stage {device}: streamed weights are not served by interleaved chunks yet; recompile "
                            "with planner.interleave=off")
        self.program, self.wire, self.train = program, wire, train
        self.device = device
        last = chunks * num_devices - 1
        schemes = list(compress) if compress is not None else ["none"] * num_devices
        self.executors: list[Executor] = []
        for c, stage in enumerate(stages):
            j = c * num_devices + device
            prev = names((j - 1) % num_devices) if j > 0 else None
            nxt = names((j + 1) % num_devices) if j < last else None
            tags = (c, max(j - 1, 0) // num_devices, min(j + 1, last) // num_devices)
            links = (schemes[(device - 1) % num_devices] if j > 0 else "none", schemes[device] if j < last else "none")
            self.executors.append(Executor(stage, [], wire, train, neighbours=(prev, nxt), chunks=tags,
                                           compression=links))
        self.steps_done = 0

    def run_step(self, step: int) -> StepStats:
        """Execute the device's whole program once (one optimizer step) and return its measurements."""
        executors = self.executors
        for ex in executors:
            ex._reset()
            ex._lr = ex.scheduler.get_last_lr()[0] if ex.scheduler is not None else self.train.lr
        start = time.perf_counter()
        for ex in executors:
            ex._step_inputs(step)  # the batch for chunk 0 of device 0, the labels for the last device's last chunk
        data_wait = time.perf_counter() - start
        clip_wait = [0.0]
        grad_norm = [0.0]

        def run(action: Action) -> None:
            if action.op == "STEP":
                grad_norm[0], clip_wait[0] = self._optimizer_step(step)
            else:
                executors[action.chunk]._handlers[action.op](step, action.mb)

        times, cpu = run_program(self.program, run, self.device, step, executors[0].stage.device.type == "cpu",
                                 Executor.action_observers)
        times["data_wait"] = data_wait
        times["clip_wait"] = clip_wait[0]
        wall = time.perf_counter() - start
        leftover = sum(len(ex._inputs) + len(ex._outputs) + len(ex._grads) + len(ex._mb_positions) for ex in executors)
        if leftover:
            raise RuntimeError(f"stage {self.device}: program left {leftover} tensors unconsumed (bad program)")
        self.steps_done = step + 1
        last = executors[-1]
        deliveries: dict[str, list[float]] = {}
        for ex in executors:
            for kind, seconds in ex._deliveries.items():
                deliveries.setdefault(kind, []).extend(seconds)
        scheduled = next((ex for ex in executors if ex.scheduler is not None), executors[0])  # a chunk with LoRA
        return StepStats(
            step=step, loss_sum=last._loss_sum if last.stage.is_last else None,
            num_label_tokens=last._num_label_tokens, grad_sumsq=grad_norm[0], lr=scheduled._lr,
            busy_s=sum(times[op] for op in COMPUTE_OPS if op in times) - clip_wait[0], wall_s=wall,
            op_time_s=dict(times), op_cpu_s=dict(cpu),
            link_s={kind: statistics.median(v) for kind, v in deliveries.items() if v},
            telemetry=sample_telemetry(executors[0].telemetry))  # after the step's timings: not part of them

    def _optimizer_step(self, step: int) -> tuple[float, float]:
        """The device's clip round trip over its chunks' gradients, then every chunk's AdamW step; (the squared
        norm sent, seconds waited for the coefficient)."""
        sumsq = sum(grad_sumsq(ex.params) for ex in self.executors)
        coef, waited = clip_round_trip(self.wire, sumsq, step, self.device)
        for ex in self.executors:
            apply_step(ex.params, ex.optimizer, ex.scheduler, coef)
            ex._sync()
        return sumsq, waited
