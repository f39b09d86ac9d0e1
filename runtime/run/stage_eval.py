"""Held-out evaluation on the training stages (the default for ``eval.every``; ``eval.device`` names a spare device
instead, runtime/run/eval_client.py): the coordinator's side.

After every ``eval.every`` steps and the last, the coordinator sends the first pipeline a round of held-out rows at
a time (``eval.max_batches`` micro-batches, rounded up to whole rounds of that pipeline's micro-batches), one record
a row, under the step just trained; the stages forward them (runtime/stage/evaluate.py) and the last one answers
``evaldone`` per round. ``eval_loss`` is the summed token cross-entropy over the label tokens, as the spare-device
evaluator and transformers + peft compute it. Training waits for the pass: it is priced as forward-only work of
the first pipeline (``eval_seconds``).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

import torch

from hetero.errors import ConfigError, WireError
from hetero.loss import IGNORE_INDEX
from hetero.plan import Plan
from hetero.protocol import EvalDone, Labels
from hetero.runtime.base.payloads import stage_eval_due
from hetero.runtime.run.metrics_file import EvalLine
from hetero.runtime.wire.frames import record_of


def evaluates_on_stages(plan: Plan) -> bool:
    """Whether this run evaluates on its training stages: eval.every on and no eval.device named."""
    return plan.eval.every > 0 and plan.eval.device is None


def refusal(plan: Plan) -> str | None:
    """Why this plan cannot evaluate on its training stages (with the way out), or None."""
    if any(s.chunks for s in plan.stages):
        why = "its devices hold interleaved chunks (planner.interleave)"
    elif any(s.stream_layers for s in plan.stages):
        why = "its stages stream weights from host RAM (planner.offload)"
    else:
        return None
    return (f"eval.every={plan.eval.every} evaluates on the training stages, but {why}: recompile with that off, or "
            "keep a device out of training for the evaluator (hetero compile ... eval.device=NAME)")


class StageEval:
    """The held-out rounds of a run, and one evaluation after a step: send each round, sum the answers."""

    def __init__(self, plan: Plan, names: list[str]) -> None:
        from hetero.runtime.run.held_out import held_out_batches

        if (why := refusal(plan)) is not None:
            raise ConfigError(why)
        pipeline = plan.pipelines[0]
        self.every, self.steps = plan.eval.every, plan.train.steps
        self.first, self.last = names[pipeline.stages[0]], names[pipeline.stages[-1]]
        m = pipeline.num_micro_batches if plan.replicas else plan.train.num_micro_batches
        wanted = math.ceil(plan.eval.max_batches / m)
        self.skipped: list[str] = []
        batch = held_out_batches(plan, replace(plan.eval, max_batches=wanted * m), self.skipped).step(0)
        self.rounds = min(wanted, int(batch.input_ids.shape[0]) // m)
        if self.rounds < 1:
            rows = m * plan.train.micro_batch_size
            raise ConfigError(f"the held-out data fills {int(batch.input_ids.shape[0])} micro-batch(es); the training "
                              f"stages evaluate whole rounds of {m} ({rows} records): add held-out records, or raise "
                              "eval.split")
        take = self.rounds * m
        self.input_ids, self.labels = batch.input_ids[:take], batch.labels[:take]
        # Packed plans' stages take each row's positions too: one record a row, 0..S-1.
        seq = self.input_ids.shape[-1]
        self.positions = (torch.arange(seq).expand_as(self.input_ids).contiguous() if plan.data.packing else None)
        self.m = m

    def welcome(self) -> dict[str, Any]:
        """The welcome's fields that tell the stages when to evaluate and how many rounds."""
        return {"stage_eval_every": self.every, "stage_eval_rounds": self.rounds}

    def due(self, step: int) -> bool:
        return stage_eval_due(self.every, self.steps, step)

    def run(self, transport: Any, mailbox: Any, step: int, timeout_s: float) -> EvalLine:
        """Evaluate after ``step``: every round through the first pipeline; the metrics.jsonl line."""
        start = time.perf_counter()
        loss_sum, tokens = 0.0, 0
        for r in range(self.rounds):
            part = slice(r * self.m, (r + 1) * self.m)
            inputs = {"input_ids": self.input_ids[part].contiguous()}
            if self.positions is not None:
                inputs["position_ids"] = self.positions[part].contiguous()
            labels = self.labels[part].contiguous()
            transport.send(self.first, "batch", step=step, tensors=inputs)
            transport.send(self.last, Labels(num_label_tokens=max(1, int((labels[..., 1:] != IGNORE_INDEX).sum()))),
                           step=step, tensors={"labels": labels})
            done = record_of(mailbox.recv("evaldone", step=step, sender=self.last, timeout_s=timeout_s), EvalDone)
            if done.round != r:
                raise WireError(f"{self.last} answered round {done.round} of the evaluation after step "
                                f"{step + 1}, expected {r}")
            loss_sum += float(done.loss_sum)
            tokens += done.num_label_tokens
        return EvalLine(step=step + 1, eval_loss=loss_sum / max(tokens, 1), eval_tokens=tokens,
                        eval_s=time.perf_counter() - start, eval_on="training stages")
