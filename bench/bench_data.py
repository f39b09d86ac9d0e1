"""Workload W7 (/work/shared/BENCHMARKS.md): real-length data, packed and padded, in trained (label) tokens/s.

    python -m bench data                     # the full workload (~15 min on 2 quiet cores)
    python -m bench data --quick             # smoke test: seq 128, 96 records, 3 steps of 16 rows (~3 min)
    python bench/bench_data.py --only hetero-packed,trl-default --steps 4 --json w7.json

W1's model (w1_model.py: random-init Llama, hidden 256, 8 layers, fp32, LoRA r=8 alpha 16 dropout 0 on
q,k,v,o,gate,up,down, AdamW lr 1e-3 constant, no weight decay, gradient clipping at 1.0) at ``model.seq_len=1024``,
trained on 512 ``text`` records whose token lengths follow instruction data: log-normal, median 200 tokens,
sigma 0.8 (mean ~270, a long tail), clipped to [8, 1000]. The lengths are drawn from a seeded ``random.Random``;
each record's text is built from words the bench's tokenizer maps to exactly one token each, so a record
encodes (BOS + words + EOS, as hetero's ``text`` format does) to exactly its drawn length. Every run, one script
run:

  hetero-packed    `hetero compile/run`, 2 CPU stages x 1 thread, data.packing=true
  hetero-padded    the same, data.packing=false (one record per row, right-padded to seq_len)
  hetero-full      records of exactly seq_len tokens, packing on: every row full (the no-padding limit)
  trl-packed       TRL's SFTTrainer in one process, torch.set_num_threads(2), packing=True (TRL's default
                   strategy "bfd", which turns on padding_free: see TRL_NOTES)
  trl-default      SFTTrainer with its defaults (no packing: each micro-batch padded to its longest record)

The global batch is the same in rows: 8 micro-batches of 4 rows of at most seq_len tokens per optimizer step
(hetero: train.micro_batch_size=4, num_micro_batches=8; TRL: per_device_train_batch_size=4,
gradient_accumulation_steps=8). Packed, a row is a packed row (~3.7 records of ~270 tokens); unpacked, a row
is one record. Both TRL runs: fp32 (bf16=False), gradient_checkpointing=False (TRL's defaults are bf16 and
checkpointing; hetero recomputes nothing here), the pre-tokenized ids of the same records (so both see
identical tokens), attention sdpa.

Trained tokens/s = the label tokens of the timed steps (steps WARMUP+1..N; a token has a label when the loss
predicts it from an earlier token of its own record: (labels[:, 1:] != -100), as the loss shifts them) / the
wall time of those steps. hetero: metrics.jsonl's ``label_tokens`` and ``step_time_s``; TRL: the labels of the
micro-batches each optimizer step consumed, timed between consecutive ``on_step_end`` callbacks (the data
loading of a step included, as hetero's step time includes it). Computed tokens are the token positions the
model ran (rows x seq_len for hetero; input_ids.numel() for TRL); packing efficiency = real (non-pad) tokens /
computed tokens.

Each run takes 6 optimizer steps and times steps 2..6 (``--steps``, ``--warmup``). ``--trl-micro-batch 1``
gives TRL one row per forward (gradient accumulation 32): packed, its flattened sequence and dense mask are then
seq_len long, not 4 x seq_len; unpacked, nothing is padded.

Ratios (issue 32's goals): hetero packed / padded >= 2.5; packed / no-padding limit >= 0.9; hetero packed /
the best TRL run >= 2. Run it on a quiet machine: TRL's two OpenMP threads slow down 2-3x when another process
shares the cores (hetero's one-thread stages much less), so a busy machine flatters hetero against TRL.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from w1_hetero import HARDWARE_YAML, free_ports, hetero_cmd  # noqa: E402
from w1_model import LR, TARGETS, W1_ARCH  # noqa: E402

from hetero.runtime.run.metrics_file import NAME, read_metrics  # noqa: E402

IGNORE_INDEX = -100
CASES = ("hetero-packed", "hetero-padded", "hetero-full", "trl-packed", "trl-default")
TRL_NOTES = ("TRL packing=True uses packing_strategy='bfd', which forces padding_free: each micro-batch's packed "
             "rows are flattened into one [1, rows x seq_len] sequence with position_ids restarting at every "
             "record and no attention_mask; under sdpa transformers detects the packed sequences from the "
             "position_ids and builds a dense block-diagonal causal mask over the whole flattened sequence (no "
             "cross-record attention, but an L x L mask and L x L scores, L = 4 x seq_len). flash_attention_2 "
             "(varlen) is what TRL documents padding_free for; it is CUDA-only.")


@dataclass(frozen=True)
class Setup:
    """One W7 configuration (the full workload, or --quick's scaled-down one)."""

    seq_len: int = 1024
    records: int = 512
    median: float = 200.0  # tokens per record (BOS and EOS included)
    sigma: float = 0.8  # of the log-normal: mean ~ median x exp(sigma^2 / 2) before clipping
    max_len: int = 1000
    min_len: int = 8
    micro_batch: int = 4
    num_micro: int = 8
    steps: int = 6
    warmup: int = 1  # steps not timed (the first: allocators, caches, lazy initialisation)
    seed: int = 0
    trl_micro_batch: int = 4  # TRL per_device_train_batch_size (x gradient accumulation = micro_batch x num_micro)
    threads: int = 2  # TRL's one process

    @property
    def rows_per_step(self) -> int:
        return self.micro_batch * self.num_micro


FULL = Setup()
# The same shape at an eighth of the length: lengths scale with seq_len, so the padding and packing ratios stay.
QUICK = Setup(seq_len=128, records=96, median=25.0, max_len=125, min_len=4, num_micro=4, steps=3)


# ---------------------------------------------------------------- the data


def record_lengths(n: int, seed: int = 0, median: float = 200.0, sigma: float = 0.8, max_len: int = 1000,
                   min_len: int = 8) -> list[int]:
    """``n`` token lengths of instruction-like records: log-normal (median ``median``, ``sigma``), clipped to
    [min_len, max_len]; deterministic in ``seed`` (Python's Random: the same on every platform)."""
    rng = random.Random(f"w7-lengths:{seed}")
    mu = math.log(median)
    return [min(max_len, max(min_len, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def one_token_words(tokenizer: Any) -> list[tuple[str, int]]:
    """(word, id) of every vocabulary entry that ' word' encodes to alone: text built of ' w1 w2 ...' then
    tokenizes to exactly one token per word (the byte-level pre-tokenizer splits before every space)."""
    out = []
    for piece, tid in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        if not piece.startswith("\u0120"):  # byte-level BPE's marker of a leading space
            continue
        word = piece[1:]
        if word.isascii() and word.isalpha() and tokenizer(" " + word, add_special_tokens=False)["input_ids"] == [tid]:
            out.append((word, tid))
    if len(out) < 8:
        raise RuntimeError(f"the tokenizer has only {len(out)} one-token words; W7 needs a few dozen")
    return out


def make_records(lengths: list[int], words: list[tuple[str, int]], bos: int, eos: int,
                 seed: int = 0) -> list[tuple[str, list[int]]]:
    """(text, token ids) per length: ids = [bos] + one id per word + [eos], ``len(ids) == length``, as hetero's
    ``text`` format encodes the text."""
    rng = random.Random(f"w7-words:{seed}")
    out = []
    for n in lengths:
        if n < 3:
            raise ValueError(f"a record needs >= 3 tokens (BOS, a word, EOS), got {n}")
        picked = [words[rng.randrange(len(words))] for _ in range(n - 2)]
        out.append(("".join(" " + w for w, _ in picked), [bos, *(t for _, t in picked), eos]))
    return out


def label_count(labels: Any) -> int:
    """Label tokens of a batch ``[..., S]``: the positions the shifted next-token loss trains on."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def batch_counts(batch: dict[str, Any]) -> tuple[int, int, int]:
    """(label, real, computed) tokens of one model input as a TRL collator writes it. Padded batches carry an
    attention_mask (real = its ones); padding-free ones a position_ids of the flattened records and no pads
    (TRL pads those only to pad_to_multiple_of, which is off on CPU)."""
    ids = batch["input_ids"]
    computed = int(ids.numel())
    mask = batch.get("attention_mask")
    real = int(mask.sum()) if mask is not None else computed
    return label_count(batch["labels"]), real, computed


def length_summary(lengths: list[int]) -> dict[str, Any]:
    ordered = sorted(lengths)
    return {"records": len(lengths), "median": statistics.median(ordered), "mean": statistics.fmean(ordered),
            "p95": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], "max": ordered[-1],
            "min": ordered[0]}


def prepare(work: Path, setup: Setup) -> dict[str, Any]:
    """The model (W1's, seed 0, positions for seq_len) with the W1 tokenizer, and the data files: variable-length
    records (text JSONL for hetero, their ids for TRL) and full-row records (text JSONL)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from hetero.runtime.pretrained import build_tokenizer

    arch = dict(W1_ARCH, max_position_embeddings=max(W1_ARCH["max_position_embeddings"], setup.seq_len))
    model_dir = work / "w7-model"
    config = AutoConfig.for_model(arch.pop("model_type"), **arch)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.float32).save_pretrained(str(model_dir))
    build_tokenizer(dict(W1_ARCH, vocab_size=512), model_dir)  # as w1_model.prepare: the demo corpus fills 512
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    words = one_token_words(tok)
    lengths = record_lengths(setup.records, setup.seed, setup.median, setup.sigma, setup.max_len, setup.min_len)
    variable = make_records(lengths, words, tok.bos_token_id, tok.eos_token_id, setup.seed)
    full = make_records([setup.seq_len] * setup.records, words, tok.bos_token_id, tok.eos_token_id, setup.seed + 1)
    for text, ids in variable[:16] + full[:2]:  # the tokenizer agrees with the ids built (hetero re-tokenizes)
        got = [tok.bos_token_id, *tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]
        if got != ids:
            raise RuntimeError("the one-token words do not tokenize one token each")
    paths = {"variable": work / "w7-text.jsonl", "full": work / "w7-full.jsonl", "ids": work / "w7-ids.jsonl"}
    for key, recs in (("variable", variable), ("full", full)):
        with paths[key].open("w") as f:
            for text, _ in recs:
                f.write(json.dumps({"text": text}) + "\n")
    with paths["ids"].open("w") as f:
        for _, ids in variable:
            f.write(json.dumps({"input_ids": ids}) + "\n")
    return {"model_dir": model_dir, **paths, "lengths": length_summary(lengths), "one_token_words": len(words)}


# ---------------------------------------------------------------- hetero


def _hetero(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(hetero_cmd() + args, capture_output=True, text=True, cwd=cwd, timeout=timeout)


def _fail(proc: subprocess.CompletedProcess, what: str) -> str:
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return f"`hetero {what}` failed: {lines[-1] if lines else proc.returncode}"


def hetero_case(name: str, model_dir: Path, data: Path, packing: bool, setup: Setup, work: Path) -> dict[str, Any]:
    """`hetero compile` + `hetero run` of one case on 2 local CPU stages x 1 thread; the row of the table."""
    case = work / name
    conf = case / "conf"
    (conf / "hardware").mkdir(parents=True, exist_ok=True)
    (conf / "hardware" / "w7.yaml").write_text(HARDWARE_YAML.replace("name: w1", "name: w7").format(
        port=free_ports(3) + 1, count=2, host_extra=""))
    overrides = [
        "-cd", str(conf), "model=hf", f"model.pretrained={model_dir}", f"model.seq_len={setup.seq_len}",
        "model.dtype=float32", "lora.r=8", "lora.alpha=16", "lora.dropout=0.0",
        f"lora.target_modules=[{','.join(TARGETS)}]", "hardware=w7", f"train.micro_batch_size={setup.micro_batch}",
        f"train.num_micro_batches={setup.num_micro}", f"train.steps={setup.steps}", f"train.lr={LR}",
        f"train.seed={setup.seed}", "train.schedule=1f1b", f"data.path={data}", "data.format=text",
        f"data.packing={'true' if packing else 'false'}", "planner.num_stages=2", f"output={case / 'plan'}",
    ]
    row: dict[str, Any] = {"run": name, "engine": "hetero", "packing": packing}
    t0 = time.perf_counter()
    proc = _hetero(["compile", *overrides], case, 1800)
    if proc.returncode != 0:
        return {**row, "error": _fail(proc, "compile")}
    row["compile_s"] = time.perf_counter() - t0
    plan = case / "plan" / "plan.json"
    run_dir = case / "run"
    t0 = time.perf_counter()
    proc = _hetero(["run", str(plan), "--run-dir", str(run_dir), "--no-progress"], case, 3600)
    row["run_wall_s"] = time.perf_counter() - t0
    (case / "run.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {**row, "error": _fail(proc, "run")}
    steps = read_metrics(run_dir / NAME).steps
    if len(steps) < setup.steps:
        return {**row, "error": f"metrics.jsonl has {len(steps)} steps, expected {setup.steps}"}
    # Real (non-pad) tokens: metrics.jsonl's record_tokens where the run writes them, else rebuilt from the data.
    real = None if all(s.record_tokens is not None for s in steps) else hetero_real_tokens(plan, len(steps))
    computed = setup.rows_per_step * setup.seq_len
    per_step = []
    for i, r in enumerate(steps):
        per_step.append({"time_s": r.step_time_s, "label": r.label_tokens,
                         "computed": r.computed_tokens if r.computed_tokens is not None else computed,
                         "real": r.record_tokens if r.record_tokens is not None else
                         real[i] if real is not None else None})
    return {**row, **summarize(per_step, setup.warmup),
            "split": [sum(1 for n in s["node_names"] if n.startswith("layers."))
                      for s in json.loads(plan.read_text())["stages"]],
            "losses": [s.loss for s in steps]}


def hetero_real_tokens(plan: Path, steps: int) -> list[int] | None:
    """Real (non-pad) tokens of each step's rows, rebuilt with the run's own StepBatches (the rows are a pure
    function of the step number); None where this tree's data pipeline cannot say."""
    try:
        from hetero.plan import Plan
        from hetero.runtime.pretrained import resolve_dir
        from hetero.runtime.run.data import StepBatches

        p = Plan.load(plan)
        t = p.train
        batches = StepBatches(p.data, resolve_dir(p.model), p.model.seq_len, t.micro_batch_size,
                              t.num_micro_batches, t.seed, t.shuffle)
        out = []
        for i in range(steps):
            b = batches.step(i)
            # StepBatch.num_tokens where it exists; else every record's first token is the one without a label
            n = getattr(b, "num_tokens", None)
            out.append(int(n) if n is not None else int(b.num_label_tokens) + len(b.record_ids))
        return out
    except Exception:  # noqa: BLE001 - a figure of the report, never a reason to lose the run's numbers
        return None


# ---------------------------------------------------------------- the report


def summarize(per_step: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """A run's figures over its timed steps (warmup+1..N)."""
    timed = per_step[warmup:] if len(per_step) > warmup else per_step
    wall = sum(s["time_s"] for s in timed)
    label = sum(s["label"] for s in timed)
    computed = sum(s["computed"] for s in timed)
    real = None if any(s.get("real") is None for s in timed) else sum(s["real"] for s in timed)
    return {"steps": len(per_step), "timed_steps": len(timed), "timed_s": wall,
            "step_s": statistics.median(s["time_s"] for s in timed), "label_tokens": label,
            "computed_tokens": computed, "real_tokens": real,
            "trained_tok_s": label / wall if wall > 0 else None,
            "computed_tok_s": computed / wall if wall > 0 else None,
            "efficiency": real / computed if real is not None and computed else None,
            "label_per_step": label / len(timed), "per_step": per_step}


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Issue 32's three ratios of trained tokens/s (None where a run is missing)."""
    def tps(name: str) -> float | None:
        return rows.get(name, {}).get("trained_tok_s")

    def div(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    trl = [t for t in (tps("trl-packed"), tps("trl-default")) if t]
    return {"packed_over_padded": div(tps("hetero-packed"), tps("hetero-padded")),
            "packed_over_full": div(tps("hetero-packed"), tps("hetero-full")),
            "packed_over_best_trl": div(tps("hetero-packed"), max(trl) if trl else None)}


GOALS = (("packed_over_padded", "hetero packed / padded", 2.5), ("packed_over_full",
         "hetero packed / no-padding limit", 0.9), ("packed_over_best_trl", "hetero packed / best TRL", 2.0))


def _f(x: Any, p: int = 0) -> str:
    return "-" if x is None else f"{x:,.{p}f}"


def lines(result: dict[str, Any]) -> list[str]:
    """W7's table and ratios (markdown), as printed and as docs/benchmarks.md takes them."""
    s, d = result["setup"], result["data"]
    out = [f"W7: W1's model at seq_len {s['seq_len']}, {d['records']} text records (tokens per record median "
           f"{d['median']:.0f}, mean {d['mean']:.0f}, p95 {d['p95']}, max {d['max']}); {s['micro_batch']} x "
           f"{s['num_micro']} rows per step, {s['steps']} steps, timed steps {s['warmup'] + 1}..{s['steps']}. "
           f"hetero: 2 CPU stages x 1 thread; TRL {result.get('trl_version', '?')}: one process x {s['threads']} "
           "threads.", "",
           "| run | steps | trained tok/s | computed tok/s | packing efficiency | s/step | label tokens/step | note |",
           "|---|---|---|---|---|---|---|---|"]
    for name in CASES:
        r = result["rows"].get(name)
        if r is None:
            continue
        if "error" in r:
            out.append(f"| {name} | - | - | - | - | - | - | {r['error']} |")
            continue
        note = (f"{r.get('attention', '')}; micro-batches of {r.get('per_device_train_batch_size')} x "
                f"{r.get('gradient_accumulation_steps')} accumulated" if r["engine"] == "trl" else
                f"split {r.get('split')}")
        eff = "-" if r.get("efficiency") is None else f"{r['efficiency']:.1%}"
        out.append(f"| {name} | {r['steps']} | **{_f(r['trained_tok_s'])}** | {_f(r['computed_tok_s'])} | {eff} | "
                   f"{r['step_s']:.2f} | {_f(r['label_per_step'])} | {note} |")
    out.append("")
    for key, label, goal in GOALS:
        x = result["ratios"].get(key)
        verdict = "-" if x is None else ("met" if x >= goal else "NOT met")
        out.append(f"- {label}: **{'-' if x is None else f'{x:.2f}x'}** (goal >= {goal}: {verdict})")
    return out


def bench(work: Path, setup: Setup = FULL, only: tuple[str, ...] = CASES, log: Any = print) -> dict[str, Any]:
    """Every case of W7 in ``work``; returns {"setup", "data", "rows", "ratios", "trl_version"}."""
    t0 = time.perf_counter()
    data = prepare(work, setup)
    log(f"data: {data['lengths']} ({data['one_token_words']} one-token words), {time.perf_counter() - t0:.0f} s")
    rows: dict[str, dict[str, Any]] = {}
    for name in CASES:
        if name not in only:
            continue
        t0 = time.perf_counter()
        if name.startswith("hetero"):
            rows[name] = hetero_case(name, data["model_dir"], data["full" if name == "hetero-full" else "variable"],
                                     name != "hetero-padded", setup, work)
        else:
            from bench_data_trl import trl_case

            rows[name] = trl_case(name, data["model_dir"], data["ids"], name == "trl-packed", setup, work)
        r = rows[name]
        log(f"{name}: " + (r["error"] if "error" in r else
                           f"{r['trained_tok_s']:.0f} trained tok/s, {r['step_s']:.2f} s/step, efficiency "
                           f"{_f(r.get('efficiency') and 100 * r['efficiency'], 1)} %")
            + f" ({time.perf_counter() - t0:.0f} s)")
    trl_version = next((r["trl"] for r in rows.values() if "trl" in r), None)
    if trl_version is None:
        try:
            import trl

            trl_version = trl.__version__
        except ImportError:
            trl_version = "not installed"
    return {"setup": asdict(setup), "data": data["lengths"], "rows": rows, "ratios": ratios(rows),
            "trl_version": trl_version, "trl_notes": TRL_NOTES}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m bench data", description="W7: packed vs padded vs TRL, trained tok/s")
    ap.add_argument("--quick", action="store_true", help="smoke test: seq 128, 96 records, 3 steps of 16 rows")
    ap.add_argument("--steps", type=int, help=f"optimizer steps per run (default {FULL.steps}, quick {QUICK.steps})")
    ap.add_argument("--warmup", type=int, help="untimed steps at the start (default 1)")
    ap.add_argument("--trl-micro-batch", type=int, help="TRL per_device_train_batch_size (default 4, hetero's)")
    ap.add_argument("--hetero-micro-batch", type=int,
                    help="hetero's train.micro_batch_size (default 4; the rows per step stay the same)")
    ap.add_argument("--trl-threads", type=int, help="TRL's torch threads (default 2: the cores hetero's stages use)")
    ap.add_argument("--only", default=",".join(CASES), help=f"comma-separated runs of {', '.join(CASES)}")
    ap.add_argument("--json", type=Path, help="also write the result here")
    ap.add_argument("--keep", type=Path, help="work in this directory and keep it (run dirs, logs)")
    args = ap.parse_args(argv)
    setup = QUICK if args.quick else FULL
    for key, value in (("steps", args.steps), ("warmup", args.warmup), ("trl_micro_batch", args.trl_micro_batch),
                       ("threads", args.trl_threads)):
        if value is not None:
            setup = replace(setup, **{key: value})
    if args.hetero_micro_batch is not None:
        if args.hetero_micro_batch < 1 or setup.rows_per_step % args.hetero_micro_batch:
            ap.error(f"--hetero-micro-batch must divide the {setup.rows_per_step} rows of a step")
        setup = replace(setup, micro_batch=args.hetero_micro_batch,
                        num_micro=setup.rows_per_step // args.hetero_micro_batch)
    only = tuple(args.only.split(","))
    unknown = [n for n in only if n not in CASES]
    if unknown:
        ap.error(f"unknown runs {unknown}; runs: {', '.join(CASES)}")
    work = args.keep or Path(tempfile.mkdtemp(prefix="hetero-w7-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        result = bench(work, setup, only, log=lambda s: print("  " + s, flush=True))
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print("\n".join(lines(result)))
    print("\n" + TRL_NOTES)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
