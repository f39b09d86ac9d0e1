"""Packed attention on a GPU: what one stage's attention costs per micro-batch, packed and unpacked (one CUDA GPU).

    python bench/gpu_attention.py [--json out.json]

gpu_check's model (16 query heads, 8 key/value heads, head dim 128, bf16, 12 layers) and rows of 512 tokens packed
first-fit with records of gpu_check's lengths (40-500 tokens), 8 micro-batches of 4 rows. For each variant,
forward and backward of the attention alone (q, k, v -> output, for 12 layers) over the 8 micro-batches, timed
twice: the first pass (cold: every new shape's kernel choice and plans included) and the second (warm). Variants:

  unpacked      one causal SDPA call over the whole rows (no record boundaries: the lower bound)
  packed        runtime/stage/attention.py as a stage runs it (length buckets; on CUDA, SDPA without cuDNN)
  packed-any    the same with SDPA's own backend choice (cuDNN included, as before 2026-11-28)
  packed-flash  the same under sdpa_kernel(FLASH_ATTENTION) only
  packed-mem    the same under sdpa_kernel(EFFICIENT_ATTENTION) only
  packed-cudnn  the same under sdpa_kernel(CUDNN_ATTENTION) only

Prints one JSON line per variant (seconds per pass, distinct bucket shapes) and the backends torch enables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hetero.runtime.stage import attention as packed_attention  # noqa: E402

HEADS, KV_HEADS, DIM, LAYERS, SEQ, ROWS, MICRO = 16, 8, 128, 12, 512, 4, 8


def packed_positions(rng: random.Random) -> torch.Tensor:
    """[ROWS, SEQ] position ids of rows packed first-fit with records of gpu_check's lengths."""
    rows = torch.zeros(ROWS, SEQ, dtype=torch.long)
    for r in range(ROWS):
        at = 0
        while at < SEQ:
            n = min(500, int(rng.lognormvariate(5.0, 0.6)) + 40, SEQ - at)
            rows[r, at:at + n] = torch.arange(n)
            at += n
    return rows


def one_pass(micro: list[torch.Tensor] | None, device: str, dtype: torch.dtype, backends: list | None) -> float:
    torch.manual_seed(0)
    ctx = torch.nn.attention.sdpa_kernel(backends) if backends else contextlib.nullcontext()
    if backends == []:  # packed-any: the stage's own backend choice lifted
        ctx = _any_backend()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with ctx:
        for positions in micro or [None] * MICRO:
            segments = None if positions is None else packed_attention.segments_of(positions)
            q = torch.randn(ROWS, HEADS, SEQ, DIM, device=device, dtype=dtype, requires_grad=True)
            k = torch.randn(ROWS, KV_HEADS, SEQ, DIM, device=device, dtype=dtype, requires_grad=True)
            v = torch.randn(ROWS, KV_HEADS, SEQ, DIM, device=device, dtype=dtype, requires_grad=True)
            total = torch.zeros((), device=device)
            for _ in range(LAYERS):
                if segments is None:
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                else:
                    out = packed_attention._per_segment("sdpa", q, k, v, segments, 0.0, None, None, None)
                total = total + out.float().square().mean()
            total.backward()
    sync()
    return time.perf_counter() - t0


@contextlib.contextmanager
def _any_backend():  # type: ignore[no-untyped-def]
    own = packed_attention._shape_free_kernels
    packed_attention._shape_free_kernels = lambda device: contextlib.nullcontext()  # type: ignore[assignment]
    try:
        yield
    finally:
        packed_attention._shape_free_kernels = own


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cpu", action="store_true", help="try the script on CPU (fp32)")
    args = ap.parse_args()
    device = "cpu" if args.cpu else "cuda"
    dtype = torch.float32 if args.cpu else torch.bfloat16
    rng = random.Random(0)
    micro = [packed_positions(rng) for _ in range(MICRO)]
    shapes = {s for p in micro for s in packed_attention.buckets(packed_attention.segments_of(p), SEQ, device).shapes}
    B = torch.nn.attention.SDPBackend
    variants = {"unpacked": (None, None), "packed": (micro, None)}
    if not args.cpu:
        variants.update({"packed-any": (micro, []), "packed-flash": (micro, [B.FLASH_ATTENTION]), "packed-mem": (micro, [B.EFFICIENT_ATTENTION]),
                         "packed-cudnn": (micro, [B.CUDNN_ATTENTION])})
        print(json.dumps({"flash": torch.backends.cuda.flash_sdp_enabled(),
                          "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                          "cudnn": torch.backends.cuda.cudnn_sdp_enabled(), "torch": torch.__version__}), flush=True)
    results = []
    for name, (batches, backends) in variants.items():
        row = {"variant": name, "bucket_shapes": None if batches is None else len(shapes)}
        try:
            row["cold_s"] = round(one_pass(batches, device, dtype, backends), 4)
            row["warm_s"] = round(one_pass(batches, device, dtype, backends), 4)
        except RuntimeError as exc:
            row["error"] = str(exc).splitlines()[0][:200]
        print(json.dumps(row), flush=True)
        results.append(row)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
