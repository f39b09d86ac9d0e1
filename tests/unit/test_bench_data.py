"""bench/bench_data.py (W7): the record generator and the token counting; the benchmark itself takes minutes
(`python -m bench data --quick` is its smoke test) and is never run here."""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_data  # noqa: E402


def test_lengths_follow_instruction_data() -> None:
    lengths = bench_data.record_lengths(512)
    assert lengths == bench_data.record_lengths(512)  # deterministic in the seed
    assert lengths != bench_data.record_lengths(512, seed=1)
    assert abs(statistics.median(lengths) - 200) <= 20
    assert max(lengths) <= 1000 and min(lengths) >= 8
    assert statistics.fmean(lengths) > 1.2 * statistics.median(lengths)  # a long tail
    assert sum(n == 1000 for n in lengths) > 0  # some are clipped


def test_quick_lengths_scale_with_seq_len() -> None:
    q = bench_data.QUICK
    lengths = bench_data.record_lengths(q.records, q.seed, q.median, q.sigma, q.max_len, q.min_len)
    assert abs(statistics.median(lengths) - q.median) <= 0.1 * q.median
    assert max(lengths) <= q.max_len < q.seq_len


def test_records_tokenize_to_their_drawn_length(tmp_path: Path) -> None:
    from transformers import AutoTokenizer
    from w1_model import W1_ARCH

    from hetero.runtime.pretrained import build_tokenizer

    build_tokenizer(dict(W1_ARCH, vocab_size=512), tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    words = bench_data.one_token_words(tok)
    lengths = [3, 17, 200, 1000]
    records = bench_data.make_records(lengths, words, tok.bos_token_id, tok.eos_token_id)
    for n, (text, ids) in zip(lengths, records, strict=True):
        assert len(ids) == n
        # hetero's text format: BOS + the text's tokens + EOS
        assert [tok.bos_token_id, *tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id] == ids


def test_label_count_is_the_shifted_loss_positions() -> None:
    labels = torch.tensor([[-100, 5, 6, 7, -100, -100], [1, 2, -100, 3, 4, 5]])
    assert bench_data.label_count(labels) == 3 + 4  # the first column is never a target (1 is dropped)
    assert bench_data.label_count(labels.view(1, 2, 6)) == 7


def test_batch_counts_of_trl_collated_batches() -> None:
    trl = pytest.importorskip("trl")
    collator_cls = trl.trainer.sft_trainer.DataCollatorForLanguageModeling
    records = [[1, 10, 11, 2], [1, 12, 2], [1, 13, 14, 15, 16, 2]]
    # Padded (TRL's default): each record trains len - 1 tokens, as in hetero's rows
    padded = collator_cls(pad_token_id=0)([{"input_ids": r} for r in records])
    assert bench_data.batch_counts(padded) == (3 + 2 + 5, 4 + 3 + 6, 3 * 6)
    # Packed and padding-free: two packed rows flattened into one sequence, no cross-record targets
    packed = collator_cls(pad_token_id=0, padding_free=True)([
        {"input_ids": records[0] + records[1], "seq_lengths": [4, 3]},
        {"input_ids": records[2], "seq_lengths": [6]}])
    assert packed["input_ids"].shape == (1, 13)
    assert bench_data.batch_counts(packed) == (3 + 2 + 5, 13, 13)


def test_ratios_and_lines() -> None:
    def row(engine: str, tps: float) -> dict:
        return {"engine": engine, "trained_tok_s": tps, "computed_tok_s": 2 * tps, "efficiency": 0.5, "steps": 4,
                "step_s": 1.0, "label_per_step": tps, "split": [4, 4], "attention": "sdpa"}

    rows = {"hetero-packed": row("hetero", 3000.0), "hetero-padded": row("hetero", 1000.0),
            "hetero-full": row("hetero", 3100.0), "trl-packed": row("trl", 500.0),
            "trl-default": {"run": "trl-default", "engine": "trl", "error": "TRL run failed: boom"}}
    r = bench_data.ratios(rows)
    assert r["packed_over_padded"] == pytest.approx(3.0)
    assert r["packed_over_full"] == pytest.approx(3000 / 3100)
    assert r["packed_over_best_trl"] == pytest.approx(6.0)
    result = {"setup": asdict(bench_data.QUICK), "rows": rows, "ratios": r, "trl_version": "x",
              "data": {"records": 128, "median": 50, "mean": 67.0, "p95": 200, "max": 250}}
    text = "\n".join(bench_data.lines(result))
    assert "| hetero-packed | 4 | **3,000** |" in text
    assert "TRL run failed: boom" in text
    assert "hetero packed / padded: **3.00x** (goal >= 2.5: met)" in text
    assert "hetero packed / no-padding limit: **0.97x** (goal >= 0.9: met)" in text
