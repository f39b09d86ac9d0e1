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
from hetero.specs import DataSpec, EvalSpec


def held_out_batches(plan: Plan, evaluation: EvalSpec, skipped: list[str] | None = None) -> Any:
    """The held-out micro-batches: eval.path in data.format, in file order, at most eval.max_batches of them
    (never repeating a record). Records the format cannot use are left out; ``skipped`` gets one line
    saying which."""
    import tempfile

    from hetero.runtime.pretrained import resolve_dir
    from hetero.runtime.run.data import StepBatches

    if not evaluation.path and not evaluation.split:
        raise ConfigError("neither eval.split nor eval.path is set: held-out evaluation needs held-out records "
                          "(eval.split=0.1, or eval.path=FILE)")
    train, tokenizer_dir = plan.train, resolve_dir(plan.model)
    source = evaluation.path or f"{plan.data.path or 'the bundled demo set'} (eval.split={evaluation.split})"
    label = f"eval.path={evaluation.path}" if evaluation.path else source  # what the messages name

    def build(path: Path, micro_batches: int) -> Any:
        data = replace(plan.data, path=str(path), packing=False)  # the training data's format; one record a row
        return StepBatches(data, tokenizer_dir, plan.model.seq_len, train.micro_batch_size, micro_batches,
                           train.seed, False)

    with tempfile.TemporaryDirectory(prefix="hetero-eval-") as scratch:
        given = Path(evaluation.path).expanduser() if evaluation.path else _split_records(plan, evaluation.split,
                                                                                          Path(scratch))
        path, bad = screen_held_out(given, plan.data, Path(scratch))
        batches = build(path, evaluation.max_batches)
        refused = dict(_unencodable(batches, evaluation.max_batches * train.micro_batch_size))
        if refused:
            bad += list(refused.values())
            kept = [r for i, r in enumerate(batches.records) if i not in refused]
            batches = build(path := _write_records(kept, Path(scratch) / "encodable.jsonl"), evaluation.max_batches)
        fit = batches.num_records // train.micro_batch_size
        if fit < 1:
            raise ConfigError(f"{label} has {batches.num_records} usable record(s), fewer than "
                              f"one micro-batch (train.micro_batch_size={train.micro_batch_size})"
                              + (f"; left out: {bad[0]}" if bad else ""))
        if fit < evaluation.max_batches:
            batches = build(path, fit)
    batches.source = source  # errors name the user's file, not a scratch copy
    if bad and skipped is not None:
        more = f"; {len(bad) - 1} more like it" if len(bad) > 1 else ""
        skipped.append(f"{label}: left out {len(bad)} held-out record(s) that data.format="
                       f"{plan.data.format} cannot use ({bad[0]}{more}); evaluating the other {batches.num_records}")
    return batches


def _split_records(plan: Plan, split: float, scratch: Path) -> Path:
    """eval.split's held-out records of the training data (the ones training leaves out: StepBatches' hold_out), as
    a JSON-lines file in ``scratch``."""
    from hetero.runtime.run.data_files import held_out_indices, load_located

    records, _, _ = load_located(plan.data)
    held = held_out_indices(len(records), split, plan.train.seed)
    return _write_records([records[i] for i in held], scratch / "held_out.jsonl")


def screen_held_out(path: Path, data: DataSpec, scratch: Path) -> tuple[Path, list[str]]:
    """A JSON-lines (or JSON array) held-out file without the records ``data.format`` cannot use: ``path`` itself
    when every record is usable (or it is not JSON: Parquet is read whole), else a copy of the usable ones
    in ``scratch``; and one reason per record left out."""
    from hetero.runtime.run.data_files import validate_records

    if path.suffix.lower() not in (".jsonl", ".json") or not path.is_file():
        return path, []  # StepBatches reports a missing or unreadable file
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        whole = json.loads(text)
    except ValueError:
        whole = None
    if isinstance(whole, (list, dict)):  # a JSON array of records (or one record), not JSON lines
        entries: list[tuple[str, Any]] = [(f"record {i}", r) for i, r in enumerate(whole if isinstance(whole, list)
                                                                                  else [whole], 1)]
    else:
        entries = [(f"line {n}", _json_or_error(line)) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    good: list[dict[str, Any]] = []
    bad: list[str] = []
    for where, record in entries:
        if isinstance(record, ValueError):
            bad.append(f"{where}: invalid JSON ({record})")
            continue
        if not isinstance(record, dict):
            bad.append(f"{where}: a JSON {type(record).__name__}, not an object")
            continue
        try:
            validate_records([record], data, where)
        except ConfigError as exc:
            bad.append(str(exc).replace(f"{where}: record 1: ", f"{where}: ", 1))
            continue
        good.append(record)
    if not bad:
        return path, []
    if not good:
        raise ConfigError(f"eval.path={path}: none of its {len(bad)} record(s) is usable as data.format="
                          f"{data.format} ({bad[0]})")
    return _write_records(good, scratch / "usable.jsonl"), bad


def _json_or_error(line: str) -> Any:
    """The JSON value of one line, or the ValueError that says why it is none."""
    try:
        return json.loads(line)
    except ValueError as exc:
        return ValueError(str(getattr(exc, "msg", exc)))


def _write_records(records: list[dict[str, Any]], path: Path) -> Path:
    """``records`` as a JSON-lines file at ``path`` (what StepBatches reads)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _unencodable(batches: Any, wanted: int) -> list[tuple[int, str]]:
    """(index, reason) of the records the tokenizer refuses (a chat template that raises), in file order,
    looked at until ``wanted`` usable ones are found."""
    refused: list[tuple[int, str]] = []
    usable = 0
    for i in range(batches.num_records):
        if usable >= wanted:
            break
        try:
            batches.encode(i)
            usable += 1
        except ConfigError as exc:
            refused.append((i, str(exc).split(": ", 1)[-1]))
    return refused


def build_evaluator(plan: Plan, device_name: str) -> Any:
    """The whole model as one stage on ``device_name`` (built by runtime/stage/model.py, LoRA untrained)."""
    from hetero.planner.cost_model import compute_dtype
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
