"""The last stage's loss in chunks: the summed token cross-entropy without a whole ``[tokens, vocab]`` logits tensor.

Only positions with a label get logits. Each chunk of ``loss_chunk_tokens(vocab)`` of them runs the head (and the
family's logit divisor or soft cap) and the fp32 cross-entropy, so at most one chunk's logits exist at any time:

- a frozen head (the usual case: no LoRA on lm_head) computes each chunk's gradient with respect to its hidden
  states in the forward pass, while the chunk's logits exist, and keeps only that ``[tokens, hidden]`` gradient
  for backward. The head runs once per chunk: its matmul twice (logits, then the gradient), not three times;
- a head with trainable parameters runs each chunk under activation checkpointing: backward keeps the chunk's
  hidden states and computes its logits again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from hetero.loss import IGNORE_INDEX, loss_chunk_tokens
from hetero.runtime.wire.frames import accumulate_dtype


def chunked_loss_sum(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor,
                     vocab_size: int, frozen_head: bool = False) -> torch.Tensor:
    """Sum over label tokens of the cross-entropy of ``head(hidden)`` (HF causal convention: position t predicts
    label t+1); ``hidden`` ``[B, S, H]``, ``labels`` ``[B, S]`` with -100 where no loss. ``frozen_head``: ``head``
    has no parameter that needs a gradient (then each chunk's input gradient is computed in forward)."""
    targets = labels[:, 1:].reshape(-1).to(hidden.device)
    keep = (targets != IGNORE_INDEX).nonzero().flatten()
    states = hidden[:, :-1].reshape(-1, hidden.shape[-1]).index_select(0, keep)
    targets = targets.index_select(0, keep)
    if keep.numel() == 0:  # no label here: a zero that still hands backward a (zero) gradient
        return hidden.sum().to(accumulate_dtype(hidden.dtype)) * 0.0
    total = hidden.new_zeros((), dtype=accumulate_dtype(hidden.dtype))
    step = loss_chunk_tokens(vocab_size)
    # split, not slices: its backward writes each chunk's gradient once instead of a zero-filled whole per chunk
    for chunk, target in zip(states.split(step), targets.split(step), strict=True):
        if chunk.requires_grad and frozen_head:
            part = _GradInForward.apply(chunk, target, head)
        elif chunk.requires_grad:
            part = torch.utils.checkpoint.checkpoint(_chunk_loss, head, chunk, target, use_reentrant=False)
        else:
            part = _chunk_loss(head, chunk, target)
        total = total + part
    return total


def _chunk_loss(head: Callable[[torch.Tensor], torch.Tensor], chunk: torch.Tensor, target: torch.Tensor
                ) -> torch.Tensor:
    logits = head(chunk)
    return F.cross_entropy(logits.to(accumulate_dtype(logits.dtype)), target, reduction="sum")


class _GradInForward(torch.autograd.Function):
    """A frozen head's chunk loss whose input gradient is computed in forward, while its logits exist: backward
    scales the kept ``[tokens, hidden]`` gradient and runs nothing again."""

    @staticmethod
    def forward(ctx: Any, chunk: torch.Tensor, target: torch.Tensor,  # type: ignore[override]
                head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        with torch.enable_grad():
            x = chunk.detach().requires_grad_(True)
            loss = _chunk_loss(head, x, target)
            (grad,) = torch.autograd.grad(loss, x)
        ctx.save_for_backward(grad)
        return loss.detach()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        wide = accumulate_dtype(grad.dtype)
        return (grad.to(wide) * grad_out.to(wide)).to(grad.dtype), None, None
