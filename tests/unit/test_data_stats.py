"""`hetero compile`'s look at the data (token lengths, packing efficiency, label share, steps and time per epoch,
a seq_len far above the data's needs), the plan's trained tokens/s, and `train.epochs` at compile and at run.

The numbers are checked against counts made here, independently of the runtime's encoder: records of the
``tokens`` format whose lengths (and best-fit packing) are worked out by hand, and alpaca records counted with
the tiny model's tokenizer directly.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from hetero import cli
from hetero.cli import data_stats
from hetero.cli.data_stats import measure_data
from hetero.cli.show import data_lines
from hetero.errors import ConfigError
from hetero.plan import Plan, compute_input_hash
from hetero.runtime.run.preflight import with_epoch_steps
from hetero.specs import DataSpec, ModelSpec

# Lengths of the tokens-format records: at seq_len 128, best-fit decreasing puts each 100 in a row of its own, the
# 60s two to a row (60 + 60 = 120) and the 28s into the 100s' rows: 6 full-ish rows, 2 records per row.
LENGTHS = [100, 60, 28] * 4
PACKED_ROWS, TOKENS = 6, sum(LENGTHS)  # 752 tokens in 6 rows of 128
LABELS = TOKENS - len(LENGTHS)  # every token is a label but each record's first (nothing before it predicts it)
ROWS_PER_STEP = 4  # train.micro_batch_size=2 x train.num_micro_batches=2
COMMON = ["model=tiny", "hardware=local", "train.micro_batch_size=2", "train.num_micro_batches=2",
          "planner.time_limit_s=5"]


def write_tokens(path: Path, lengths: list[int]) -> Path:
    with path.open("w") as f:
        for n, length in enumerate(lengths):
            f.write(json.dumps({"input_ids": [3 + (n + i) % 500 for i in range(length)]}) + "\n")
    return path


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory, tiny_cache: Path) -> dict[str, object]:
    """One in-process compile of the tiny model on the hand-counted tokens file, with train.epochs=2."""
    tmp = tmp_path_factory.mktemp("data_stats")
    data = write_tokens(tmp / "tokens.jsonl", LENGTHS)
    out = tmp / "plan"
    buffer = io.StringIO()  # module scope: no capsys
    with contextlib.redirect_stdout(buffer):
        code = cli.main(["compile", *COMMON, f"data.path={data}", "data.format=tokens", "train.epochs=2",
                         f"output={out}"])
    assert code == 0, buffer.getvalue()[-3000:]
    return {"out": buffer.getvalue(), "plan": Plan.load(out / "plan.json"), "data": data, "dir": out}


def test_compile_prints_the_data_lines_with_hand_counted_numbers(compiled: dict[str, object]) -> None:
    out, plan = str(compiled["out"]), compiled["plan"]
    assert isinstance(plan, Plan)
    stats = plan.data_stats
    assert stats is not None and not stats.sampled
    assert (stats.records, stats.total_records, stats.median_tokens, stats.p95_tokens, stats.longest_tokens) == \
        (12, 12, 60, 100, 100)
    assert stats.rows_per_epoch == PACKED_ROWS and stats.truncated == 0
    assert stats.efficiency == pytest.approx(TOKENS / (PACKED_ROWS * 128))
    assert stats.label_fraction == pytest.approx(LABELS / (PACKED_ROWS * 128))
    steps_per_epoch = math.ceil(PACKED_ROWS / ROWS_PER_STEP)  # 2
    step_s = plan.prediction.step_time_s
    assert f"data: {compiled['data']}: 12 records" in out
    assert "tokens per record: median 60, p95 100, longest 100" in out
    assert (f"packing on: 2.0 records per 128-token row, {TOKENS / (PACKED_ROWS * 128):.0%} of computed tokens are "
            f"record tokens (packing efficiency), {LABELS / (PACKED_ROWS * 128):.0%} carry a label") in out
    assert f"per step: {ROWS_PER_STEP} rows, about 8 records; {steps_per_epoch} steps per epoch" in out
    from hetero.cli.show import fmt_duration

    assert f"predicted {fmt_duration(steps_per_epoch * step_s)} per epoch" in out
    # The plan's trained tokens/s: the label share of its computed tokens/s, in the prediction and the baselines.
    p = plan.prediction
    assert p.label_fraction == pytest.approx(stats.label_fraction)
    assert p.trained_tokens_per_s == pytest.approx(p.tokens_per_s * stats.label_fraction)
    for b in plan.baselines:
        if b.prediction is not None:
            assert b.prediction.trained_tokens_per_s == pytest.approx(b.prediction.tokens_per_s * stats.label_fraction)
    assert "trained (" in out and "computed)" in out  # the prediction line: trained, the computed beside it
    assert "trained tokens/s of" in plan.verdict[0]
    # train.epochs=2: 2 x 6 rows at 4 a step (steps run on across epochs: 3 steps, not 2 x 2), and compile says so.
    assert plan.train.epochs == 2 and plan.train.steps == math.ceil(2 * PACKED_ROWS / ROWS_PER_STEP) == 3
    assert f"train.epochs=2: 2 x {PACKED_ROWS} rows at {ROWS_PER_STEP} a step = 3 steps" in out
    assert "train.steps=20 is not used" in out  # conf/train/default.yaml's steps: the epochs win
    assert "warning" not in out  # the longest record needs more than half of seq_len 128


def test_the_runtime_counts_the_same_steps_per_epoch(compiled: dict[str, object], tiny_model_dir: Path) -> None:
    # What `hetero run` counts from the data it reads (StepBatches.steps_per_epoch) is what compile predicted.
    from hetero.runtime.run.data import StepBatches

    plan = compiled["plan"]
    assert isinstance(plan, Plan) and plan.data_stats is not None
    for packing, rows in ((True, PACKED_ROWS), (False, len(LENGTHS))):
        batches = StepBatches(replace(plan.data, packing=packing), tiny_model_dir, 128, 2, 2, 0, True)
        assert batches.steps_per_epoch == math.ceil(rows / ROWS_PER_STEP)
    ran = with_epoch_steps(plan, StepBatches(plan.data, tiny_model_dir, 128, 2, 2, 0, True))
    assert ran.train.steps == plan.train.steps == plan.data_stats.steps_per_epoch(plan.train, 2)
    assert ran.input_hash == plan.input_hash and compute_input_hash(ran) == plan.input_hash


def test_epochs_make_the_runs_steps(capsys: pytest.CaptureFixture[str], compiled: dict[str, object]) -> None:
    plan = compiled["plan"]
    assert isinstance(plan, Plan)
    # 10 rows an epoch at 4 rows a step: steps run on across epochs, so 3 epochs are 30 rows = 8 steps (not 3 x 3).
    fake = SimpleNamespace(rows_per_epoch=10, sequences_per_step=4, num_records=25)
    ran = with_epoch_steps(replace(plan, train=replace(plan.train, epochs=3, steps=1)), fake)
    assert ran.train.steps == 8
    assert "train.epochs=3: 3 x 10 rows (25 records) at 2 x 2 rows per step = 8 steps" in capsys.readouterr().out


def test_steps_and_epochs_on_one_command_line_is_one_line(compiled: dict[str, object],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["compile", "model=tiny", "hardware=local", "train.epochs=2", "train.steps=50", "output=never"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("hetero: error: train.steps=50 and train.epochs=2 both set the run's length"), err
    assert not Path("never").exists()
    # At `hetero run`: the plan's epochs (2) and steps on the command line, before anything starts.
    plan_json = Path(str(compiled["dir"])) / "plan.json"
    code = cli.main(["run", str(plan_json), "steps=5", "--run-dir", str(Path(str(compiled["dir"])) / "never-run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "steps=5 and train.epochs=2 (the plan's) both set the run's length" in err[0], err
    assert "train.epochs=0" in err[0]


def test_a_seq_len_far_above_the_data_is_warned_with_the_value_to_use(compiled: dict[str, object],
                                                                      tiny_spec: ModelSpec) -> None:
    plan = compiled["plan"]
    assert isinstance(plan, Plan)
    data = DataSpec(path=str(compiled["data"]), format="tokens")
    stats, note = measure_data(replace(tiny_spec, seq_len=256), data)
    assert stats is not None and note == ""
    assert stats.suggested_seq_len == 128 and stats.seq_len == 256
    lines = data_lines(replace(plan, data_stats=stats))
    warning = [line for line in lines if line.startswith("warning:")]
    assert len(warning) == 1
    assert "model.seq_len=256 is more than twice the longest record (100 tokens)" in warning[0]
    assert "model.seq_len=128 holds every record" in warning[0]
    # Not packed: the same records take a row each, and the warning says how much of a step is padding.
    stats, _ = measure_data(replace(tiny_spec, seq_len=256), replace(data, packing=False))
    assert stats is not None and stats.rows_per_epoch == len(LENGTHS)
    assert stats.efficiency == pytest.approx(TOKENS / (len(LENGTHS) * 256))
    lines = data_lines(replace(plan, data_stats=stats))
    assert any(f"now {1 - stats.efficiency:.0%} of every step is padding" in line for line in lines)
    assert any("packing off (one record per 256-token row)" in line for line in lines)


def test_alpaca_lengths_are_the_tokenizers(tmp_path: Path, tiny_spec: ModelSpec, tiny_model_dir: Path,
                                           compiled: dict[str, object]) -> None:
    # Counted with the tokenizer itself: BOS + prompt, then response + EOS; labels on the response only.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    records = [{"instruction": f"Say {word} {'again ' * n}", "output": f"{word} " * (1 + 3 * n)}
               for n, word in enumerate(["hello", "yes", "no", "maybe", "never", "always", "soon"])]
    path = tmp_path / "alpaca.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    lengths, labels = [], []
    for r in records:
        prompt = 1 + len(tok(f"### Instruction:\n{r['instruction']}\n\n### Response:\n", add_special_tokens=False)
                         ["input_ids"])
        response = len(tok(r["output"], add_special_tokens=False)["input_ids"]) + 1
        lengths.append(prompt + response)
        labels.append(min(prompt + response, tiny_spec.seq_len) - prompt)  # a record past seq_len is cut
    stats, note = measure_data(tiny_spec, DataSpec(path=str(path), packing=False))
    assert stats is not None, note
    ordered = sorted(lengths)
    assert (stats.median_tokens, stats.longest_tokens) == (ordered[3], ordered[-1])
    assert stats.truncated == sum(1 for n in lengths if n > tiny_spec.seq_len) == 1  # the longest, 143 tokens
    computed = len(records) * tiny_spec.seq_len
    assert stats.label_fraction == pytest.approx(sum(labels) / computed)
    assert stats.efficiency == pytest.approx(sum(min(n, tiny_spec.seq_len) for n in lengths) / computed)
    # One record in seven is cut: compile warns, and names the seq_len that keeps 95% of the records whole.
    plan = compiled["plan"]
    assert isinstance(plan, Plan)
    lines = data_lines(replace(plan, data_stats=stats))
    assert "1 of the 7 measured are longer than seq_len 128 and cut to it" in lines[1]
    keep = 64 * math.ceil(ordered[-1] / 64)  # p95 of seven records: the longest
    assert (f"warning: 14% of the records are longer than model.seq_len=128 and lose their ends "
            f"(model.seq_len={keep} keeps 95% of them whole)") in lines


def test_a_big_file_is_sampled_deterministically(tmp_path: Path, tiny_spec: ModelSpec,
                                                 compiled: dict[str, object]) -> None:
    from hetero.packing import pack_rows

    lengths = [10 + (7 * i) % 90 for i in range(600)]
    path = write_tokens(tmp_path / "big.jsonl", lengths)
    data = DataSpec(path=str(path), format="tokens")
    stats, note = measure_data(tiny_spec, data, sample=100)
    assert stats is not None, note
    assert (stats.records, stats.total_records, stats.sampled) == (100, 600, True)
    data_stats._CACHE.clear()
    again, _ = measure_data(tiny_spec, data, sample=100)
    assert again == stats  # the same sample every time
    # The sampled records' lengths; their rows scaled to the file (600 records: 6x the sample's).
    sample = sorted(lengths[i] for i in data_stats._chosen(600, 100))
    assert (stats.median_tokens, stats.longest_tokens) == (sample[50], sample[-1])
    assert stats.rows_per_epoch == len(pack_rows(sample, 128)) * 6
    # Parquet is sampled the same way, by row groups.
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"input_ids": [[3 + i % 400 for i in range(n)] for n in lengths]})
    pq.write_table(table, tmp_path / "big.parquet", row_group_size=128)
    parquet, note = measure_data(tiny_spec, replace(data, path=str(tmp_path / "big.parquet")), sample=100)
    assert parquet is not None, note
    assert (parquet.records, parquet.total_records) == (100, 600)
    assert (parquet.median_tokens, parquet.longest_tokens, parquet.rows_per_epoch) == \
        (stats.median_tokens, stats.longest_tokens, stats.rows_per_epoch)  # the same records were picked
    plan = compiled["plan"]
    assert isinstance(plan, Plan)
    assert "600 records, 100 sampled" in data_lines(replace(plan, data_stats=stats))[0]


def test_unreadable_data_or_tokenizer_is_one_note_not_a_failure(tmp_path: Path, tiny_spec: ModelSpec) -> None:
    stats, note = measure_data(tiny_spec, DataSpec(path=str(tmp_path / "missing.jsonl")))
    assert stats is None and "no such file" in note and "\n" not in note
    hub = replace(tiny_spec, pretrained="no-such-owner/no-such-model")
    stats, note = measure_data(hub, DataSpec())
    assert stats is None and "not in the local Hugging Face cache" in note


def test_plans_without_data_stats_load_with_their_hash(compiled: dict[str, object]) -> None:
    plan = compiled["plan"]
    assert isinstance(plan, Plan)
    # Data statistics, like the data itself, are not hashed: the placement is the same for any data.
    assert compute_input_hash(replace(plan, data_stats=None)) == plan.input_hash
    # A plan.json from before: no data_stats, no trained tokens, no train.epochs.
    data = json.loads(plan.to_json())
    del data["data_stats"], data["train"]["epochs"]
    for pred in [data["prediction"], *(b["prediction"] for b in data["baselines"] if b["prediction"])]:
        del pred["label_fraction"], pred["trained_tokens_per_s"]
    old = Path(str(compiled["dir"])) / "old-plan.json"
    old.write_text(json.dumps(data))
    loaded = Plan.load(old)
    assert loaded.data_stats is None and loaded.train.epochs == 0 and loaded.prediction.trained_tokens_per_s is None
    assert loaded.input_hash == plan.input_hash == compute_input_hash(loaded)
    lines = data_lines(loaded)
    assert lines[0].startswith("data: not measured") and "computed tokens" in lines[0]


def test_epochs_are_counted_in_range() -> None:
    from hetero.specs import PlannerOptions, TrainSpec, check_ranges

    with pytest.raises(ConfigError, match=re.escape("train.epochs")):
        check_ranges(ModelSpec("m", {}), TrainSpec(epochs=-1), PlannerOptions(), ConfigError)
