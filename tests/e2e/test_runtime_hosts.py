"""`hetero run` + `hetero worker` as real processes: two hosts on loopback, failures, and refusals."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from metrics_rows import read_metrics, step_lines
from plans import free_ports, make_plan
from procs import clean_up, clone_beside, finish, start

from hetero.plan import Plan, compute_input_hash
from hetero.specs import ModelSpec, TrainSpec

pytestmark = pytest.mark.slow

TRAIN = TrainSpec(micro_batch_size=2, num_micro_batches=4, steps=3, lr=1e-3)


def _two_host_plan(model_dir: Path, spec: ModelSpec, train: TrainSpec = TRAIN) -> Plan:
    return make_plan(model_dir, spec.architecture, [2, 2, 2], train=train, hosts=["alpha", "beta", "beta"])




@pytest.fixture(autouse=True)
def _no_leftovers():
    """Whatever a failing test started is killed, stopped stages included."""
    yield
    clean_up()


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("hetero: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose (its parent just has not reaped it yet).
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_two_hosts_train_and_the_adapter_loads_with_peft(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                         tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hetero.runtime.tools.generate import generate

    plan = _two_host_plan(tiny_model_dir, tiny_spec)
    plan.save(tmp_path / "plan.json")
    clone_beside(tmp_path)  # both hosts' children start from a directory holding the clone
    port = free_ports(1)[0]
    coordinator = f"tcp://127.0.0.1:{port}"
    run_dir = tmp_path / "run"
    # The remote host's worker may start before the coordinator: its hello waits in the queue.
    worker = start(["worker", "plan.json", "--host", "beta", "--coordinator", coordinator,
                     "--run-dir", str(tmp_path / "beta")], tmp_path)
    run = start(["run", "plan.json", "--run-dir", str(run_dir), "--port", str(port), "steps=2"], tmp_path)
    code, out, err = finish(run)
    assert code == 0, err[-3000:]
    assert "waiting for hosts beta" in out
    assert f"on beta: `hetero worker plan.json --host beta --coordinator {coordinator}`" in out, out  # as it is typed
    assert finish(worker, 60)[0] == 0

    metrics = step_lines(read_metrics(run_dir / "metrics.jsonl"))
    assert len(metrics) == 2  # the steps=2 override reached every host
    envs = json.loads((run_dir / "environments.json").read_text())
    assert [envs[f"stage{k}"]["host"] for k in range(3)] == ["alpha", "beta", "beta"]
    assert (run_dir / "logs" / "stage0.log").is_file() and (tmp_path / "beta" / "logs" / "stage2.log").is_file()
    assert Plan.load(run_dir / "plan.json").train.steps == 2

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(run_dir / "adapter"))
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 6 * 7 and all(p.abs().sum() > 0 for p in lora_b)  # every layer trained, every host
    assert isinstance(generate(run_dir, "Reverse the word cat.", max_new_tokens=5), str)


def test_a_worker_of_another_plan_is_refused(tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path) -> None:
    plan = _two_host_plan(tiny_model_dir, tiny_spec)
    plan.save(tmp_path / "plan.json")
    # Same fleet and ports, other LoRA rank: another plan hash.
    other = replace(plan, model=replace(plan.model, lora=replace(plan.model.lora, r=4)))
    other = replace(other, input_hash=compute_input_hash(other))
    assert other.input_hash != plan.input_hash
    other.save(tmp_path / "other.json")
    port = free_ports(1)[0]
    worker = start(["worker", "other.json", "--host", "beta", "--coordinator", f"tcp://127.0.0.1:{port}",
                     "--run-dir", str(tmp_path / "beta")], tmp_path)
    # Both foreign stages have queued their hello: the coordinator gets them as soon as it listens, so a
    # short handshake timeout is enough to see them dropped.
    logs = [tmp_path / "beta" / "logs" / f"stage{k}.log" for k in (1, 2)]
    deadline = time.monotonic() + 180
    while not all(log.is_file() and "hello sent" in log.read_text() for log in logs):
        assert worker.poll() is None and time.monotonic() < deadline, "the foreign worker never said hello"
        time.sleep(0.2)
    # The coordinator drops the foreign hellos and, long before its handshake timeout, names the host that runs
    # another plan, both plan hashes and what to do.
    began = time.monotonic()
    run = start(["run", "plan.json", "--run-dir", str(tmp_path / "run"), "--port", str(port),
                  "--handshake-timeout", "600"], tmp_path)
    code, _, err = finish(run)
    assert code == 2 and time.monotonic() - began < 120, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("hetero: error: stage ") and "on host beta" in line, err
    assert "started with another plan.json" in line and "hetero worker plan.json --host beta" in line, line
    assert plan.input_hash in line and other.input_hash in line, line
    wcode, _, werr = finish(worker, 120)
    assert wcode != 0 and "error" in werr  # the foreign worker does not linger either


def test_a_stage_error_is_one_line_naming_the_stage(tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path) -> None:
    """A stage that cannot build stops the run with its own one-line cause. (What `hetero run` can see
    before starting stages, such as an adapter of another rank, it refuses earlier: test_runtime_disk.py.)"""
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "model"  # weights lacking a tensor the architecture needs: only loading them tells
    shutil.copytree(tiny_model_dir, model_dir)
    weights = load_file(str(model_dir / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(model_dir / "model.safetensors"))
    plan = make_plan(model_dir, tiny_spec.architecture, [6])
    plan.save(tmp_path / "plan.json")
    run = start(["run", "plan.json", "--run-dir", str(tmp_path / "run"), "--port", str(free_ports(1)[0])], tmp_path)
    code, _, err = finish(run, 120)
    assert code == 2
    line = _one_error_line(err)
    assert "stage 0" in line and "tensor 'model.layers.1.mlp.down_proj.weight' is not in the weights" in line, line
    assert "stage0.log" in line or "logs" in line
    assert "Traceback" in (tmp_path / "run" / "logs" / "stage0.log").read_text()  # details stay in the log


def test_a_missing_host_is_named_with_the_command_to_start_it(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                               tmp_path: Path) -> None:
    from hetero.specs import HostSpec

    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [6], hosts=["beta"])
    port = free_ports(1)[0]
    hosts = [*plan.cluster.hosts, HostSpec("alpha", "127.0.0.1", port + 1)]  # the coordinator's host, no devices
    plan = replace(plan, cluster=replace(plan.cluster, hosts=hosts))
    plan = replace(plan, input_hash=compute_input_hash(plan))
    plan.save(tmp_path / "plan.json")
    run = start(["run", "plan.json", "--host", "alpha", "--handshake-timeout", "2", "--run-dir", str(tmp_path / "r")],
                 tmp_path)
    code, out, err = finish(run, 120)
    assert code == 2
    line = _one_error_line(err)
    assert "stage(s) 0 on beta sent no 'hello' within 2 s" in line, line
    assert f"hetero worker plan.json --host beta --coordinator tcp://127.0.0.1:{port}" in line, line


def test_run_refuses_placement_keys_and_edited_plans(tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from hetero.cli import main

    monkeypatch.chdir(tmp_path)
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3])
    plan.save(tmp_path / "plan.json")
    for override, expected in [
        ("model.seq_len=64", "model.seq_len changes the placement: recompile with `hetero compile ... model.seq_len=64`"),
        ("train.micro_batch_size=8", "train.micro_batch_size changes the placement"),
        ("num_micro_batches=2", "train.num_micro_batches changes the placement"),
        ("data.path=other.jsonl", "data.path is fixed in plan.json: recompile with `hetero compile ... "
                                  "data.path=other.jsonl` (same placement and plan hash"),
        ("lr=fast", "train.lr must be a number"),
        ("colour=red", "unknown override 'colour'"),
    ]:
        assert main(["run", "plan.json", override]) == 2
        assert expected in _one_error_line(capsys.readouterr().err)
    data = json.loads((tmp_path / "plan.json").read_text())
    data["model"]["lora"]["r"] = 16  # edited by hand: the hash no longer matches
    (tmp_path / "edited.json").write_text(json.dumps(data))
    assert main(["run", "edited.json"]) == 2
    assert "input hash" in _one_error_line(capsys.readouterr().err)
    assert main(["worker", "plan.json", "--host", "gamma"]) == 2
    assert "host 'gamma' runs no stage of this plan; its stages run on: localhost" in _one_error_line(
        capsys.readouterr().err)
    assert main(["run", "plan.json", "--host", "gamma"]) == 2
    assert "host 'gamma' is not in the plan" in _one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "runs").exists()  # nothing was started
