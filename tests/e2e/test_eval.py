"""Held-out evaluation on a device the plan leaves out of training (eval.*).

A one-stage plan trains on one CPU device while a second, spare one evaluates: metrics.jsonl gets an
eval_loss line every eval.every steps and after the last, and the last one equals the held-out loss
of the run's adapter computed independently with transformers + peft.
"""

from __future__ import annotations

import io
import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from plans import make_plan

from hetero.errors import ConfigError
from hetero.plan import compute_input_hash
from hetero.runtime.cli import main_run
from hetero.runtime.run.data import IGNORE_INDEX, StepBatches
from hetero.runtime.tools.evaluator import serve
from hetero.specs import DataSpec, DeviceSpec, EvalSpec, ModelSpec, TrainSpec

pytestmark = pytest.mark.slow

HELD_OUT = [{"instruction": f"Name a colour number {i}.", "input": "", "output": f"Colour {i} is blue-{i}."}
            for i in range(9)]


def _plan_with_spare(tiny_model_dir: Path, tiny_spec: ModelSpec, train: TrainSpec):
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [6], train=train, seq_len=64)
    host = plan.cluster.hosts[0]
    spare = DeviceSpec("localhost.spare", host.name, "cpu", 9, "cpu", "CPU", 8.0, 50.0,
                       {"float32": 1.0, "float16": 1.0, "bfloat16": 1.0}, False, True, threads=1)
    hosts = [replace(host, devices=[*host.devices, spare]), *plan.cluster.hosts[1:]]
    plan = replace(plan, cluster=replace(plan.cluster, hosts=hosts))
    return replace(plan, input_hash=compute_input_hash(plan))


def test_spare_device_evaluates_while_training(tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from procs import clone_beside

    monkeypatch.chdir(clone_beside(tmp_path / "home"))  # the evaluator and the stages start beside the clone
    train = TrainSpec(micro_batch_size=2, num_micro_batches=2, steps=5, lr=5e-3, seed=1)
    plan = _plan_with_spare(tiny_model_dir, tiny_spec, train)
    plan.save(tmp_path / "plan.json")
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps(r) + "\n" for r in HELD_OUT))
    run_dir = tmp_path / "run"
    assert main_run([str(tmp_path / "plan.json"), "--run-dir", str(run_dir), "--no-progress", "eval.every=2",
                     f"eval.path={held_out}", "eval.max_batches=3", "eval.device=localhost.spare"]) == 0

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "step_time_s" in x]
    evals = [x for x in lines if "eval_loss" in x]
    assert [x["step"] for x in steps] == list(range(1, 6))
    # After steps 2 and 4 (eval.every=2) and after the last. On a loaded machine the evaluation after step 2 may
    # still run when step 4 ends: that one is skipped, and the run says so (CI met it while other tests ran).
    err = capsys.readouterr().err
    skipped = [int(s) for s in re.findall(r"evaluation skipped after step\(s\) ([\d, ]+)", err)[0].split(", ")
               ] if "evaluation skipped" in err else []
    assert sorted([x["step"] for x in evals] + skipped) == [2, 4, 5] and evals[-1]["step"] == 5, (evals, err)
    assert len(evals) >= 2
    assert all(x["eval_tokens"] > 0 and x["eval_s"] > 0 for x in evals)
    assert len({round(x["eval_loss"], 6) for x in evals}) == len(evals), "the adapter changes between evaluations"
    assert (run_dir / "logs" / "eval.log").is_file()
    assert not list((run_dir / "eval").glob("*.safetensors")), "the evaluator deletes the adapters it took"

    # Independent: base model + the run's final adapter with transformers + peft, HF's own shifted loss.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(run_dir / "adapter")).eval()
    batches = StepBatches(DataSpec(path=str(held_out)), tiny_model_dir, plan.model.seq_len, 2, 3, 0, False)
    batch = batches.step(0)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for mb in range(3):
            labels = batch.labels[mb]
            n = int((labels[:, 1:] != IGNORE_INDEX).sum())
            total += float(model(input_ids=batch.input_ids[mb], labels=labels).loss) * n
            tokens += n
    assert evals[-1]["eval_tokens"] == tokens
    assert evals[-1]["eval_loss"] == pytest.approx(total / tokens, rel=1e-5)


@pytest.mark.parametrize("shape", ["pipeline", "replicas"])
def test_the_training_stages_evaluate_between_steps(tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path,
                                                    shape: str) -> None:
    """eval.every without eval.device (issue 53): the training stages forward the held-out rows through the pipeline
    between steps, no device kept out; eval_loss after the last step is a transformers + peft forward of the same
    rows with the saved adapter (1e-6). Two stages of one pipeline, and two one-stage replicas (the default plan of
    hardware=local), whose first pipeline evaluates."""
    train = TrainSpec(micro_batch_size=2, num_micro_batches=2, steps=3, lr=5e-3, seed=0)
    plan = (make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3], train=train, seq_len=64) if shape == "pipeline"
            else make_plan(tiny_model_dir, tiny_spec.architecture, [[6], [6]], train=train, seq_len=64, shares=[1, 1]))
    plan.save(tmp_path / "plan.json")
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps(r) + "\n" for r in HELD_OUT))
    run_dir = tmp_path / "run"
    assert main_run([str(tmp_path / "plan.json"), "--run-dir", str(run_dir), "--no-progress", "eval.every=2",
                     f"eval.path={held_out}", "eval.max_batches=3"]) == 0
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in lines if "eval_loss" in x]
    assert [x["step"] for x in evals] == [2, 3] and all(x["eval_on"] == "training stages" for x in evals), evals
    assert [x["step"] for x in lines if "step_time_s" in x] == [1, 2, 3]
    assert not (run_dir / "logs" / "eval.log").exists()  # no evaluator process
    # max_batches=3 in whole rounds of the pipeline's micro-batches: 2 rounds of 2 (a replica: 2 rounds of 1... 3)
    rows = 4 if shape == "pipeline" else 3
    loss, tokens = _peft_held_out_loss(tiny_model_dir, run_dir / "adapter", held_out, rows)
    assert evals[-1]["eval_tokens"] == tokens
    assert evals[-1]["eval_loss"] == pytest.approx(loss, rel=1e-6, abs=1e-7)


def test_eval_split_holds_out_a_fraction_of_the_training_records(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                                  tmp_path: Path) -> None:
    """eval.split=0.2 (issue 53): a fifth of data.path's records never train, and eval_loss is a transformers + peft
    forward of exactly those records, in file order, with the run's adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hetero.runtime.run.data_files import held_out_indices

    records = [{"instruction": f"Add {i} and {i + 1}.", "input": "", "output": f"{2 * i + 1}"} for i in range(20)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    train = TrainSpec(micro_batch_size=2, num_micro_batches=2, steps=2, lr=5e-3, seed=3)
    plan = _plan_with_spare(tiny_model_dir, tiny_spec, train)
    plan = replace(plan, data=replace(plan.data, path=str(data)))
    replace(plan, input_hash=compute_input_hash(plan)).save(tmp_path / "plan.json")
    held = held_out_indices(20, 0.2, 3)
    assert len(held) == 4
    trains = StepBatches(DataSpec(path=str(data)), tiny_model_dir, 64, 2, 2, 3, True, hold_out=0.2)
    assert trains.num_records == 16 and all(r not in trains.records for r in (records[i] for i in held))

    run_dir = tmp_path / "run"
    assert main_run([str(tmp_path / "plan.json"), "--run-dir", str(run_dir), "--no-progress", "eval.every=1",
                     "eval.split=0.2", "eval.max_batches=2"]) == 0
    evals = [x for x in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in x]
    assert evals and evals[-1]["step"] == 2, evals

    kept = tmp_path / "held.jsonl"
    kept.write_text("".join(json.dumps(records[i]) + "\n" for i in held))
    batch = StepBatches(DataSpec(path=str(kept)), tiny_model_dir, 64, 2, 2, 3, False, packing=False).step(0)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(run_dir / "adapter")).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for mb in range(2):
            n = int((batch.labels[mb][:, 1:] != IGNORE_INDEX).sum())
            total += float(model(input_ids=batch.input_ids[mb], labels=batch.labels[mb]).loss) * n
            tokens += n
    assert evals[-1]["eval_tokens"] == tokens
    assert evals[-1]["eval_loss"] == pytest.approx(total / tokens, rel=1e-5)


def test_eval_needs_a_spare_device_and_held_out_data(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                     tmp_path: Path) -> None:
    train = TrainSpec(micro_batch_size=2, num_micro_batches=2, steps=2)
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [6], train=train, seq_len=64)
    plan.save(tmp_path / "plan.json")
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text(json.dumps(HELD_OUT[0]) + "\n")
    with pytest.raises(ConfigError, match="needs held-out data: set eval.split=0.1 .* or eval.path=FILE"):
        main_run([str(tmp_path / "plan.json"), "--run-dir", str(tmp_path / "r"), "eval.every=1"])
    with pytest.raises(ConfigError, match="has 1 usable record\\(s\\), fewer than one micro-batch"):
        main_run([str(tmp_path / "plan.json"), "--run-dir", str(tmp_path / "r2"), "eval.every=1",
                  f"eval.path={held_out}"])
    with pytest.raises(ConfigError, match="unknown eval option 'eval.evry=1'"):
        main_run([str(tmp_path / "plan.json"), "--run-dir", str(tmp_path / "r"), "eval.evry=1"])
    assert not (tmp_path / "r").exists(), "a refused run leaves no run directory"
    spare = replace(_plan_with_spare(tiny_model_dir, tiny_spec, train))
    spare.save(tmp_path / "spare.json")
    with pytest.raises(ConfigError, match="eval.device=localhost.cpu0 trains in this plan"):
        main_run([str(tmp_path / "spare.json"), "--run-dir", str(tmp_path / "r"), "eval.every=1",
                  f"eval.path={held_out}", "eval.device=localhost.cpu0"])


def _peft_held_out_loss(model_dir: Path, adapter: Path, held_out: Path, micro_batches: int) -> tuple[float, int]:
    """Summed token cross-entropy / label tokens of ``adapter`` on ``held_out`` (micro-batches of 2), computed
    with transformers + peft: HF's own shifted loss, weighted by each micro-batch's label tokens."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    batch = StepBatches(DataSpec(path=str(held_out)), model_dir, 64, 2, micro_batches, 0, False).step(0)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for mb in range(micro_batches):
            labels = batch.labels[mb]
            n = int((labels[:, 1:] != IGNORE_INDEX).sum())
            total += float(model(input_ids=batch.input_ids[mb], labels=labels).loss) * n
            tokens += n
    return total / tokens, tokens


def test_malformed_held_out_lines_are_left_out_and_the_rest_evaluated(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                                      tmp_path: Path) -> None:
    from reference import make_init_adapter

    plan = _plan_with_spare(tiny_model_dir, tiny_spec, TrainSpec(micro_batch_size=2, num_micro_batches=2, steps=2))
    good = [json.dumps(r) for r in HELD_OUT[:6]]
    broken = ['{"instruction": "cut off", "output": ', "[1, 2]", json.dumps({"instruction": "no output"})]
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("\n".join([good[0], broken[0], good[1], good[2], "", broken[1], *good[3:], broken[2]]) + "\n")
    clean = tmp_path / "clean.jsonl"
    clean.write_text("\n".join(good) + "\n")
    adapter = make_init_adapter(tiny_model_dir, plan.model.lora, tmp_path / "adapter", seed=3)
    request = tmp_path / "request.safetensors"
    shutil.copy(adapter / "adapter_model.safetensors", request)

    stdin = io.StringIO("not a request\n" + json.dumps({"step": 4, "adapter": str(request)}) + "\n")
    stdout = io.StringIO()
    threads = torch.get_num_threads()
    try:
        assert serve(plan, "localhost.spare", EvalSpec(every=1, path=str(held_out), max_batches=3), stdin, stdout) == 0
    finally:
        torch.set_num_threads(threads)  # the evaluator sets its device's thread count in this process
    ready, *answers = [json.loads(line) for line in stdout.getvalue().splitlines()]
    assert ready["ready"] and ready["batches"] == 3
    assert ready["skipped"] == (f"eval.path={held_out}: left out 3 held-out record(s) that data.format=alpaca cannot "
                                "use (line 2: invalid JSON (Expecting value); 2 more like it); evaluating the other 6")
    assert [a["step"] for a in answers] == [4], answers  # the malformed request is ignored, not fatal
    loss, tokens = _peft_held_out_loss(tiny_model_dir, adapter, clean, 3)
    assert answers[0]["eval_tokens"] == tokens == ready["tokens"]
    assert answers[0]["eval_loss"] == pytest.approx(loss, rel=1e-5)


def test_a_run_with_a_malformed_held_out_line_evaluates_and_reports_it(
    tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    plan = _plan_with_spare(tiny_model_dir, tiny_spec, TrainSpec(micro_batch_size=2, num_micro_batches=2, steps=2))
    plan.save(tmp_path / "plan.json")
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps(r) + "\n" for r in HELD_OUT[:4]) + '{"instruction": oops}\n')
    run_dir = tmp_path / "run"
    assert main_run([str(tmp_path / "plan.json"), "--run-dir", str(run_dir), "--no-progress", "eval.every=1",
                     f"eval.path={held_out}", "eval.max_batches=2"]) == 0
    evals = [x for x in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in x]
    assert [x["step"] for x in evals] == [1, 2]  # the evaluator kept evaluating
    reported = [line for line in capfd.readouterr().err.splitlines() if "left out" in line]
    assert reported == [f"hetero run: evaluation: eval.path={held_out}: left out 1 held-out record(s) that "
                        "data.format=alpaca cannot use (line 5: invalid JSON (Expecting value)); evaluating the other 4"]
