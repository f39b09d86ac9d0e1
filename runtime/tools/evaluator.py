"""Held-out evaluation on a device the plan leaves out of training, while training goes on.

`hetero run` starts ``python -m hetero.runtime.tools.evaluator PLAN --device NAME`` on the coordinator's
host when eval.every > 0. It builds the whole model the way a stage is built (runtime/stage/model.py: the
same weights, dtype, quantization and forward; one stage covering every node), once, then serves
requests over its stdin/stdout -- a local pipe, nothing on the network:

- in: one JSON line per evaluation, ``{"step": N, "adapter": PATH}``: PATH is a safetensors file of
  the LoRA weights after step N (whole-model keys), written by the coordinator; the evaluator
  deletes it once loaded.
- out: one JSON line per request, ``{"step": N, "eval_loss": x, "eval_tokens": n, "eval_s": t}``
  (summed token cross-entropy over the held-out micro-batches / their label tokens, the training
  loss's definition), or ``{"step": N, "error": "..."}``. End of input ends the process.

A held-out record the training format cannot use (a line that is not JSON, not an object, lacks a field
the format needs, or that the tokenizer refuses) does not stop evaluation: the evaluator leaves it out,
says so in one line (its ready line's ``skipped``, which the run records among its eval_errors) and
evaluates the others.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from hetero.errors import ConfigError, HeteroError
from hetero.plan import Plan
from hetero.runtime.run.held_out import held_out_batches
from hetero.specs import EvalSpec


def build_evaluator(plan: Plan, device_name: str) -> Any:
    """The whole model as one stage on ``device_name`` (built by runtime/stage/model.py, LoRA untrained)."""
    from hetero.planner.model.cost_model import compute_dtype
    from hetero.runtime.stage.device import torch_device
    from hetero.runtime.stage.model import build_stage

    spec = plan.cluster.device(device_name)
    nodes = plan.graph.nodes
    whole = replace(plan.stages[0], index=0, host=spec.host, device=spec.name, device_type=spec.type,
                    backend=spec.backend, dtype=compute_dtype(spec, plan.model),
                    quantization=spec.quantization(plan.model.quantization), first_node=0,
                    last_node=len(nodes) - 1, node_names=[n.name for n in nodes], recompute_layers=[],
                    compress_out="none",
                    # stage 0's streaming was planned for stage 0's device and layers, not for this one
                    stream_layers=[], stream_time_s=0.0, streamed_bytes_per_step=0.0, frozen_resident_cap_bytes=0.0)
    one = replace(plan, stages=[whole], replicas=[])
    device = torch_device(spec.backend, spec.index, f"eval.device {spec.name}")
    if device.type == "cpu":
        torch.set_num_threads(max(1, spec.threads or 1))
    stage = build_stage(one, 0, device)
    if stage.lora_model is not None:
        stage.lora_model.eval()  # no LoRA dropout when evaluating
    return stage


def held_out_loss(stage: Any, batch: Any) -> tuple[float, int]:
    """Summed token cross-entropy over every micro-batch of ``batch`` / its label tokens (fp32)."""
    from hetero.runtime.run.data import IGNORE_INDEX

    total = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for mb in range(batch.input_ids.shape[0]):
            logits = stage.forward(batch.input_ids[mb].to(stage.device))[:, :-1].float()
            labels = batch.labels[mb][:, 1:].to(logits.device)
            total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                       ignore_index=IGNORE_INDEX, reduction="sum").double().cpu()
    tokens = int(batch.num_label_tokens)
    return float(total) / max(tokens, 1), tokens


def serve(plan: Plan, device_name: str, evaluation: EvalSpec, stdin: Any, stdout: Any) -> int:
    """Answer evaluation requests until stdin ends; returns the exit code."""
    from safetensors.torch import load_file

    skipped: list[str] = []
    batch = held_out_batches(plan, evaluation, skipped).step(0)
    stage = build_evaluator(plan, device_name)
    ready: dict[str, Any] = {"ready": True, "batches": int(batch.input_ids.shape[0]),
                             "tokens": int(batch.num_label_tokens)}
    print(json.dumps({**ready, **({"skipped": skipped[0]} if skipped else {})}), file=stdout, flush=True)
    for line in stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            step, path = int(request["step"]), Path(request["adapter"])
        except (ValueError, KeyError, TypeError):
            print(f"evaluator: ignored a malformed request {line.strip()[:80]!r}", file=sys.stderr, flush=True)
            continue
        t0 = time.perf_counter()
        try:
            state = load_file(str(path))
            path.unlink(missing_ok=True)
            stage.load_lora_state(state)
            loss, tokens = held_out_loss(stage, batch)
            answer: dict[str, Any] = {"step": step, "eval_loss": loss, "eval_tokens": tokens,
                                      "eval_s": time.perf_counter() - t0}
            if not math.isfinite(loss):
                answer = {"step": step, "error": f"held-out loss is {loss}"}
        except (HeteroError, OSError, ValueError, RuntimeError) as exc:
            answer = {"step": step, "error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__}
        print(json.dumps(answer), file=stdout, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hetero.runtime.tools.evaluator",
                                 description="Held-out loss of a run's adapter (started by `hetero run`).")
    ap.add_argument("plan", type=Path)
    ap.add_argument("--device", required=True, help="the fleet device that evaluates")
    ap.add_argument("--eval", required=True, help="the eval settings, as JSON")
    args = ap.parse_args(argv)
    from hetero.runtime.base.processes import raise_open_file_limit
    from hetero.serde import from_dict

    raise_open_file_limit()  # like every process of a run (runtime/base/processes.py)

    plan = Plan.load(args.plan)
    evaluation = from_dict(EvalSpec, json.loads(args.eval), "--eval", ConfigError)
    try:
        return serve(plan, args.device, evaluation, sys.stdin, sys.stdout)
    except HeteroError as exc:
        print(f"hetero: error: evaluator: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
