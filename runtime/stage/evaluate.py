"""Held-out evaluation on the training stages: after an evaluated step, forward only, through the pipeline.

The coordinator (runtime/run/stage_eval.py) sends the first pipeline's first stage a round of held-out rows as a
``batch`` and its last stage their ``labels``, both under the step just trained (every message of that step is
consumed by then, so nothing is mistaken for training). Each stage forwards the round's micro-batches in order
with no gradient and LoRA dropout off, and hands activations on as in training (the link's compression included);
the last stage sums the token cross-entropy as training does (runtime/stage/loss.py) and answers ``evaldone``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hetero.loss import IGNORE_INDEX
from hetero.protocol import Act, EvalDone
from hetero.runtime.stage.loss import chunked_loss_sum
from hetero.runtime.wire import compress
from hetero.security import COORDINATOR


@contextmanager
def _dropout_off(model: torch.nn.Module) -> Iterator[None]:
    """Dropout modules in eval mode for the pass, nothing else: eval() on a whole model would also repack
    bitsandbytes' Linear4bit weights, which then lose their input gradients in training (a known trap)."""
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.training]
    for m in dropouts:
        m.eval()
    try:
        yield
    finally:
        for m in dropouts:
            m.train()


def evaluate_round(executor: Any, step: int, round_index: int) -> float:
    """One round of held-out rows through this stage after ``step``; returns the seconds it took."""
    from hetero.runtime.stage.executor import _unpack

    stage, wire = executor.stage, executor.wire
    start = time.perf_counter()
    input_ids = positions = labels = None
    if stage.is_first:
        msg = wire.recv("batch", step=step, sender=COORDINATOR)
        input_ids, positions = msg.tensors["input_ids"], msg.tensors.get("position_ids")
    if stage.is_last:
        labels = wire.recv("labels", step=step, sender=COORDINATOR).tensors["labels"]
    micro_batches = executor.train.num_micro_batches if input_ids is None else int(input_ids.shape[0])
    if labels is not None:
        micro_batches = int(labels.shape[0])
    loss_sum, tokens = 0.0, 0
    with torch.no_grad(), _dropout_off(stage.model):
        for mb in range(micro_batches):
            pos = positions[mb] if positions is not None else None
            if stage.is_first:
                assert input_ids is not None
                x = input_ids[mb].to(stage.device)
            else:
                msg = wire.recv("act", step=step, mb=mb, sender=executor.prev)
                x = _unpack(msg.tensors, "h", executor.link_in, executor.hidden, stage.device).to(stage.device,
                                                                                                   stage.dtype)
                pos = msg.tensors.get("pos")
            out = stage.forward(x, pos, logits=False)
            if stage.is_last:
                assert labels is not None
                # frozen_head=False: the frozen head's variant computes input gradients, which no_grad has none of
                loss_sum += float(chunked_loss_sum(stage.logits, out, labels[mb], int(stage.model.config.vocab_size)))
                tokens += int((labels[mb][:, 1:] != IGNORE_INDEX).sum())
            else:
                tensors = compress.pack(out, "h", executor.link_out)
                if pos is not None:
                    tensors["pos"] = pos
                wire.send(executor.next, Act(sent=time.time(), chunk=executor.next_chunk), step=step, mb=mb,
                          tensors=tensors)
    if stage.is_last:
        wire.send(COORDINATOR, EvalDone(loss_sum=loss_sum, num_label_tokens=tokens, round=round_index), step=step)
    return time.perf_counter() - start
