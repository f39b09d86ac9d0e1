"""The chunked loss head (runtime/stage/loss.py): the plain loss and gradients, without the full logits' memory."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hetero.loss import head_bytes_per_token, loss_chunk_tokens
from hetero.runtime.stage.loss import chunked_loss_sum


def _plain(head, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = head(hidden)[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100,
                           reduction="sum")


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable-head", "frozen-head"])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_chunks_equal_the_plain_loss_and_its_gradients(softcap: float | None, frozen: bool) -> None:
    """Both paths: a head with trainable parameters (checkpointed chunks) and a frozen one (each chunk's input
    gradient computed in forward, the head run once per chunk instead of twice)."""
    torch.manual_seed(0)
    vocab = 50_000  # several chunks of label tokens (loss_chunk_tokens(50k) = 335)
    lm_head = torch.nn.Linear(32, vocab, bias=False).requires_grad_(not frozen)
    calls = []

    def head(h: torch.Tensor) -> torch.Tensor:
        calls.append(h.shape[0])
        out = lm_head(h) / 2.0
        return out if softcap is None else torch.tanh(out / softcap) * softcap

    hidden = torch.randn(3, 400, 32, requires_grad=True)
    labels = torch.randint(0, vocab, (3, 400))
    labels[0, :150] = -100  # a prompt
    labels[2] = -100  # a row without labels
    assert loss_chunk_tokens(vocab) < int((labels[:, 1:] != -100).sum())
    want = _plain(head, hidden, labels)
    (want_grad,) = torch.autograd.grad(want, hidden)
    calls.clear()
    got = chunked_loss_sum(head, hidden, labels, vocab, frozen_head=frozen)
    (got_grad,) = torch.autograd.grad(got, hidden)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    # fp32 sums in another order (chunks, the vocabulary split otherwise by the BLAS of each CPU): ~1e-7 against
    # gradients of ~0.1; a token left out or counted twice moves them by ~0.1.
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)
    labeled = int((labels[:, 1:] != -100).sum())
    assert sum(calls) == (1 if frozen else 2) * labeled  # the head's tokens: once each frozen, twice checkpointed
    if not frozen:  # the trainable head's own gradient, as the plain loss gives it
        lm_head.zero_grad()
        _plain(head, hidden, labels).backward()
        want_w = lm_head.weight.grad.clone()
        lm_head.zero_grad()
        chunked_loss_sum(head, hidden, labels, vocab).backward()
        torch.testing.assert_close(lm_head.weight.grad, want_w, rtol=1e-5, atol=1e-8)
    none = chunked_loss_sum(head, hidden, torch.full_like(labels, -100), vocab, frozen_head=frozen)
    (zero,) = torch.autograd.grad(none, hidden)
    assert float(none) == 0.0 and not bool(zero.any())


PEAK = """
import resource, sys, torch
from hetero.runtime.stage.loss import chunked_loss_sum
import torch.nn.functional as F
torch.manual_seed(0)
vocab, tokens, hidden = 128_256, 2048, 64
head = torch.nn.Linear(hidden, vocab, bias=False).requires_grad_(False)
h = torch.randn(1, tokens, hidden, requires_grad=True)
labels = torch.randint(0, vocab, (1, tokens))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if sys.argv[1] in ("chunked", "frozen"):
    loss = chunked_loss_sum(head, h, labels, vocab, frozen_head=sys.argv[1] == "frozen")
else:
    logits = head(h)[:, :-1].float()
    loss = F.cross_entropy(logits.reshape(-1, vocab), labels[:, 1:].reshape(-1), reduction="sum")
loss.backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
"""


def test_a_128k_vocabulary_head_at_2048_tokens_never_holds_the_fp32_logits() -> None:
    """Measured in fresh processes (peak resident memory during one micro-batch's forward and backward): the chunked
    head saves at least the fp32 logits, [2048, 128256] x 4 bytes = 1.05 GB."""
    def peak(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", PEAK, mode], capture_output=True, text=True, timeout=300,
                             check=True)
        return int(out.stdout.split()[-1])

    logits_bytes = 2047 * 128_256 * 4
    plain, chunked, frozen = peak("plain"), peak("chunked"), peak("frozen")
    assert plain - chunked >= logits_bytes, f"plain {plain / 1e9:.2f} GB, chunked {chunked / 1e9:.2f} GB"
    assert plain - frozen >= logits_bytes, f"plain {plain / 1e9:.2f} GB, gradient in forward {frozen / 1e9:.2f} GB"
    # What the cost model prices per token of the head at llama8b's sizes: the hidden state and one chunk spread over
    # the sequence, instead of (2 + 8) bytes x 128256 per token.
    assert head_bytes_per_token(4096, 128_256, 2, 2048) < 0.1 * (2 + 8) * 128_256
