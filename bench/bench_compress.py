"""What compressing a hand-off costs a stage: encode and decode time of runtime/wire/compress.py (issue 37).

    python bench/bench_compress.py [--threads 1] [--json out.json]

For hand-offs of W1's model (fp32 [4, 1024, 256], 4 MiB) and of an 8B model's micro-batch (bf16 [1, 2048, 4096],
16 MiB), on this machine's CPU (and its GPU, where there is one): the median of 7 encodes and 7 decodes per scheme,
against a baseline measured in the same run, a plain copy of the tensor (``clone``), which reads and writes the
same bytes once. Prints seconds, GB/s of the uncompressed tensor, and the ratio to the copy: what the planner's
datasheet estimate of the codec has to match (encode and decode pass over the tensor several times, in fp32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hetero.runtime.wire import compress  # noqa: E402

SHAPES = {"w1 fp32 [4,1024,256]": ((4, 1024, 256), torch.float32),
          "8b bf16 [1,2048,4096]": ((1, 2048, 4096), torch.bfloat16)}


def _median_s(fn: Any, device: str, reps: int = 7) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(device: str) -> list[dict[str, Any]]:
    rows = []
    for name, (shape, dtype) in SHAPES.items():
        x = torch.randn(shape, device=device).to(dtype)
        size = x.numel() * x.element_size()
        copy = _median_s(x.clone, device)
        rows.append({"device": device, "tensor": name, "op": "copy", "s": copy, "gb_per_s": size / copy / 1e9,
                     "over_copy": 1.0})
        for scheme in ("int8", "int4"):
            parts = compress.encode(x, scheme)
            enc = _median_s(lambda x=x, scheme=scheme: compress.encode(x, scheme), device)
            dec = _median_s(lambda p=parts, s=scheme, h=shape[-1], d=dtype: compress.decode(p, s, h, d), device)
            for op, s in ((f"encode {scheme}", enc), (f"decode {scheme}", dec)):
                rows.append({"device": device, "tensor": name, "op": op, "s": s, "gb_per_s": size / s / 1e9,
                             "over_copy": s / copy})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (a CPU stage's)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = measure("cpu") + (measure("cuda") if torch.cuda.is_available() else [])
    print(f"torch {torch.__version__}, {args.threads} CPU thread(s)")
    print("| device | tensor | op | ms | GB/s (uncompressed) | / copy |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['device']} | {r['tensor']} | {r['op']} | {r['s'] * 1e3:.2f} | {r['gb_per_s']:.2f} | "
              f"{r['over_copy']:.1f}x |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
