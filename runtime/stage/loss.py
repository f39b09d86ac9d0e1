"""The last stage's loss in chunks: the summed token cross-entropy without a whole ``[tokens, vocab]`` logits tensor.

Only positions with a label get logits. Each chunk of ``loss_chunk_tokens(vocab)`` of them runs the head (and the
family's logit divisor or soft cap) and the fp32 cross-entropy under activation checkpointing: backward keeps the
chunk's hidden states and computes its logits again, so at most one chunk's logits exist at any time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from hetero.loss import IGNORE_INDEX, loss_chunk_tokens


def chunked_loss_sum(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor,
                     vocab_size: int) -> torch.Tensor:
    """Sum over label tokens of the cross-entropy of ``head(hidden)`` (HF causal convention: position t predicts
    label t+1); ``hidden`` ``[B, S, H]``, ``labels`` ``[B, S]`` with -100 where no loss."""
    targets = labels[:, 1:].reshape(-1).to(hidden.device)
    keep = (targets != IGNORE_INDEX).nonzero().flatten()
    states = hidden[:, :-1].reshape(-1, hidden.shape[-1]).index_select(0, keep)
    targets = targets.index_select(0, keep)
    if keep.numel() == 0:  # no label here: a zero that still hands backward a (zero) gradient
        return hidden.sum().float() * 0.0
    total = hidden.new_zeros((), dtype=torch.float32)
    step = loss_chunk_tokens(vocab_size)
    # split, not slices: its backward writes each chunk's gradient once instead of a zero-filled whole per chunk
    for chunk, target in zip(states.split(step), targets.split(step), strict=True):
        if chunk.requires_grad:
            part = torch.utils.checkpoint.checkpoint(_chunk_loss, head, chunk, target, use_reentrant=False)
        else:
            part = _chunk_loss(head, chunk, target)
        total = total + part
    return total


def _chunk_loss(head: Callable[[torch.Tensor], torch.Tensor], chunk: torch.Tensor, target: torch.Tensor
                ) -> torch.Tensor:
    return F.cross_entropy(head(chunk).float(), target, reduction="sum")
