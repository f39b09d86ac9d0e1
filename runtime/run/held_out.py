"""Held-out data for evaluation: eval.path screened for records the training format cannot use, or eval.split's
records of the training data, as micro-batches of one record a row. The evaluator on a spare device
(runtime/tools/evaluator.py) and the evaluation on the training stages (runtime/run/stage_eval.py) read it alike.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from hetero.errors import ConfigError
from hetero.plan import Plan
from hetero.runtime.run.data_files import parse_json
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
    from hetero.runtime.run.data import CHARS_PER_TOKEN_CUT
    from hetero.runtime.run.data_files import held_out_indices, load_located, text_bound

    records, _, _ = load_located(plan.data, text_bound(plan.model.seq_len, CHARS_PER_TOKEN_CUT))
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
        whole = parse_json(text)
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
        return parse_json(line)
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
