"""`hetero compile`'s look at the training data: token lengths, packing efficiency and the label share, measured
with the model's own tokenizer exactly as `hetero run` encodes records (runtime/run/data.py's StepBatches).

A big file is sampled (at most SAMPLE_RECORDS records, chosen by a fixed seed) so that the look takes seconds:
a JSON Lines or Parquet file is sampled without reading every record into memory; a .json file is read whole.
Where the data or the tokenizer cannot be read at compile time (a hub model not downloaded, a data file on
another host), there are no statistics and the plan counts computed tokens only; `hetero run` reads the data
again either way.
"""

from __future__ import annotations

import json
import random
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from hetero.errors import ConfigError, HeteroError
from hetero.packing import length_stats
from hetero.plan import DataStats
from hetero.specs import DataSpec, ModelSpec

SAMPLE_RECORDS = 2000
# Measured data per (tokenizer, data, seq_len): a sweep's points share one look at the data.
_CACHE: dict[str, tuple[DataStats | None, str]] = {}


def measure_data(model: ModelSpec, data: DataSpec, sample: int = SAMPLE_RECORDS) -> tuple[DataStats | None, str]:
    """The data's statistics at model.seq_len, and ``""``; or None and one line saying why they are missing."""
    path = Path(data.path).expanduser() if data.path else None
    version = (path.stat().st_mtime_ns, path.stat().st_size) if path is not None and path.is_file() else None
    key = json.dumps([model.pretrained, model.architecture if model.pretrained == "hetero:tiny" else None,
                      model.seq_len, repr(data), version, sample], sort_keys=True, default=str)
    if key not in _CACHE:
        try:
            _CACHE[key] = (_measure(model, data, sample), "")
        except HeteroError as exc:
            _CACHE[key] = (None, " ".join(str(exc).split()))
        except Exception as exc:  # the look at the data must never fail a compile: `hetero run` reads it again
            text = " ".join(str(exc).split())[:200]
            _CACHE[key] = (None, f"{type(exc).__name__}: {text}" if text else type(exc).__name__)
    return _CACHE[key]


def check_data_file(data: DataSpec, seq_len: int, sample: int = SAMPLE_RECORDS) -> None:
    """An explicit ``data.path`` that `hetero run` could not read or use is a ConfigError (one line, naming the file,
    the line and the setting that reads it) before anything is planned; the bundled demo set is not checked. Its
    records are cut to what rows of ``seq_len`` tokens can use as they are read (a 1 GiB record is not kept)."""
    if data.path is None:
        return
    from hetero.runtime.run.data import CHARS_PER_TOKEN_CUT
    from hetero.runtime.run.data_files import load_located, text_bound, validate_records

    with tempfile.TemporaryDirectory(prefix="hetero-data-check-") as tmp:
        picked, _ = _sample_file(data, sample, Path(tmp) / "sample.jsonl")
        read = replace(data, path=str(picked)) if picked is not None else data
        try:
            records, name, located = load_located(read, text_bound(seq_len, CHARS_PER_TOKEN_CUT))
            validate_records(records, read, name, located)
        except ConfigError as exc:
            if picked is None:
                raise
            raise ConfigError(str(exc).replace(str(picked), f"{data.path} (its {sample} sampled records)")) from None


def refuse_unlabeled(stats: DataStats | None, data: DataSpec) -> None:
    """A file read whole in which no record keeps a label token at seq_len cannot train: `hetero run` would stop at
    its first step; say so at compile, in one line (a sample without labels may be luck: the run checks)."""
    if stats is None or stats.label_fraction > 0 or stats.sampled or data.path is None:
        return
    prompt = "" if data.train_on_prompt or data.format in ("text", "tokens") else " or data.train_on_prompt=true"
    raise ConfigError(f"data.path '{data.path}': no record keeps a label token after truncation to seq_len="
                      f"{stats.seq_len} (the prompts fill the rows): raise model.seq_len{prompt}")


def _measure(model: ModelSpec, data: DataSpec, sample: int) -> DataStats:
    from transformers.utils import logging as hf_logging

    from hetero.runtime.pretrained import resolve_dir

    # Building the tiny model writes its weights (no bar under compile's status line), and the tokenizer logs
    # "sequence length is longer than ..." for a long record: compile says that itself, in its data lines.
    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        return _measure_with(resolve_dir(model), model, data, sample)  # a hub id: only if downloaded
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _measure_with(tokenizer_dir: Path, model: ModelSpec, data: DataSpec, sample: int) -> DataStats:
    with tempfile.TemporaryDirectory(prefix="hetero-data-stats-") as tmp:
        picked, total = _sample_file(data, sample, Path(tmp) / "sample.jsonl")
        read = replace(data, path=str(picked)) if picked is not None else data
        try:
            batches = _batches(read, tokenizer_dir, model.seq_len)
            if picked is None:  # the whole file is read: sample among its records
                total = batches.num_records
                indices = _chosen(total, sample)
            else:
                indices = list(range(batches.num_records))
            lengths, labels, cut = _lengths(batches, indices, model.seq_len)
        except HeteroError as exc:
            if picked is None:
                raise
            # Name the user's file, not the sample's (its record numbers count the sampled records).
            raise ConfigError(str(exc).replace(str(picked), f"{data.path} (its {sample} sampled records)")) from None
    stats = length_stats(lengths, labels, model.seq_len, data.packing, total)
    return DataStats(source=batches.source if picked is None else str(Path(str(data.path)).expanduser()),
                     records=stats.records, total_records=stats.total_records, median_tokens=stats.median,
                     p95_tokens=stats.p95, longest_tokens=stats.longest, truncated=stats.truncated,
                     seq_len=model.seq_len, packed=data.packing, rows_per_epoch=stats.rows_per_epoch,
                     efficiency=stats.efficiency, label_fraction=stats.label_fraction,
                     suggested_seq_len=stats.suggested_seq_len(), attention_len=stats.attention_len,
                     cut_before_tokenizing=cut)


def _batches(data: DataSpec, tokenizer_dir: Path, seq_len: int) -> Any:
    """The runtime's own reader and encoder of ``data`` (records, validation, tokenizer, formats)."""
    from hetero.runtime.run.data import StepBatches

    return StepBatches(data, tokenizer_dir, seq_len, 1, 1, 0, False)


def _lengths(batches: Any, indices: list[int], seq_len: int) -> tuple[list[int], list[int], int]:
    """Each record's tokens (before truncation) and its label tokens as a step counts them: after truncation to
    seq_len, its first token left out (no token of its own record before it predicts it); and how many of the
    records had a text cut before tokenizing (their token counts are lower bounds)."""
    from hetero.runtime.run.data import IGNORE_INDEX

    lengths, labels, cut = [], [], 0
    for i in indices:
        before = batches.cut_records
        ids, labs = batches.encode(i)
        cut += batches.cut_records > before
        lengths.append(len(ids))
        labels.append(sum(1 for t in labs[1:min(len(ids), seq_len)] if t != IGNORE_INDEX))
    return lengths, labels, cut


def _chosen(total: int, sample: int) -> list[int]:
    """Which of ``total`` records are measured: all, or ``sample`` of them picked by a fixed seed (in file order)."""
    if total <= sample:
        return list(range(total))
    return sorted(random.Random(f"hetero-data-stats:{total}").sample(range(total), sample))


def _sample_file(data: DataSpec, sample: int, out: Path) -> tuple[Path | None, int]:
    """A big JSON Lines or Parquet file's sampled records, written to ``out`` (JSON Lines) with the file's record
    count; (None, 0) where the runtime's reader reads the whole file (the demo set, a small file, .json, or
    anything it will refuse itself)."""
    if data.path is None:
        return None, 0
    path = Path(data.path).expanduser()
    suffix = path.suffix.lower()
    if not path.is_file() or suffix not in (".jsonl", ".parquet"):
        return None, 0
    if suffix == ".jsonl":
        with path.open("rb") as f:
            total = sum(1 for line in f if line.strip())
        if total <= sample:
            return None, 0
        wanted = set(_chosen(total, sample))
        with path.open("rb") as f, out.open("wb") as w:
            n = 0
            for line in f:
                if line.strip():
                    if n in wanted:
                        w.write(line.rstrip(b"\r\n") + b"\n")
                    n += 1
        return out, total
    try:
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(path)
        total = parquet.metadata.num_rows
        if total <= sample:
            return None, 0
        picks = _chosen(total, sample)
        rows: list[dict[str, Any]] = []
        first = 0
        for group in range(parquet.num_row_groups):
            size = parquet.metadata.row_group(group).num_rows
            inside = [i - first for i in picks if first <= i < first + size]
            if inside:
                rows += parquet.read_row_group(group).take(inside).to_pylist()
            first += size
    except Exception:  # not Parquet after all, or unreadable: the runtime's reader says what is wrong
        return None, 0
    with out.open("w") as w:
        for row in rows:
            w.write(json.dumps(row, default=str) + "\n")
    return out, total
