"""How the last stage computes the loss, as numbers the cost model and the runtime share (torch-free).

The head never holds a whole micro-batch's ``[tokens, vocab]`` logits: the runtime (runtime/stage/loss.py) runs
the LM head and the cross-entropy on ``loss_chunk_tokens(vocab)`` label tokens at a time. A frozen head computes
each chunk's input gradient while its logits exist and keeps only that for backward; a head with LoRA keeps each
chunk's input and computes its logits again in backward. Tokens without a label get no logits at all.
"""

from __future__ import annotations

IGNORE_INDEX = -100  # a label that carries no loss (the Hugging Face convention)
LOSS_CHUNK_BYTES = 1 << 26  # fp32 logits of one chunk: 64 MiB (128 tokens at Llama 3's 128k vocabulary)


def loss_chunk_tokens(vocab_size: int) -> int:
    """Label tokens per chunk of the loss head: its fp32 logits take about LOSS_CHUNK_BYTES."""
    return max(64, LOSS_CHUNK_BYTES // (4 * max(int(vocab_size), 1)))


def head_bytes_per_token(hidden_size: int, vocab_size: int, dtype_bytes: float, seq_len: int) -> float:
    """Activation bytes per token of the chunked head: its saved input (or, frozen, its input's gradient: the same
    size), plus one chunk's logits (in the stage dtype, their fp32 copy and its gradient) spread over a sequence (an
    upper bound where a micro-batch holds more)."""
    chunk = min(loss_chunk_tokens(vocab_size), max(int(seq_len), 1))
    return dtype_bytes * hidden_size + (dtype_bytes + 8) * vocab_size * chunk / max(int(seq_len), 1)
