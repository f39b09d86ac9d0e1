"""Attention kernels on one CPU thread: which one a packed record should run (W7, issue #32).

    python bench/cpu_attention.py [--json out.json]

W1's attention (8 heads of 32, fp32, causal) over one record of 128, 260 (W7's mean record), 700 and 1,024
tokens, forward and backward, one thread, as a CPU stage runs it:

  sdpa        torch's scaled_dot_product_attention, causal (its CPU flash kernel): what hetero's packed
              attention and TRL's default both call on CPU
  sdpa-math   the same call held to SDPA's math backend
  math        the scores, a causal mask, softmax and the values as plain tensor operations (eager attention)

Prints one line per length with milliseconds per forward + backward and each kernel's time over sdpa's (median
of 5 rounds of 20 calls, after 3 untimed). Measures what the kernels cost, so that a plan or a goal that rests
on a faster CPU attention can be checked against it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, HEAD_DIM = 8, 32
LENGTHS = (128, 260, 700, 1024)


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    n = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _sdpa_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


KERNELS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sdpa": _sdpa, "sdpa-math": _sdpa_math, "math": _math}


def time_ms(kernel: Callable[..., torch.Tensor], length: int, rounds: int = 5, calls: int = 20) -> float:
    """Median milliseconds of one forward + backward of ``kernel`` over one record of ``length`` tokens."""
    gen = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(1, HEADS, length, HEAD_DIM, generator=gen, requires_grad=True) for _ in range(3))
    for _ in range(3):
        kernel(q, k, v).sum().backward()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            kernel(q, k, v).sum().backward()
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {}
    for length in LENGTHS:
        row = {name: time_ms(kernel, length) for name, kernel in KERNELS.items()}
        result[length] = row
        print(f"{length:5d} tokens: " + ", ".join(
            f"{name} {ms:.2f} ms ({ms / row['sdpa']:.2f}x)" for name, ms in row.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": 1, "ms": result}, f, indent=1)


if __name__ == "__main__":
    main()
