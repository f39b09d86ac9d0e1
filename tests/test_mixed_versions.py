"""Hosts that really differ: a stage under another transformers version trains like the rest.

A second virtualenv (this Python's site-packages plus another transformers release installed over
it) runs host beta's `hetero worker`; the run must train exactly like the same plan run with every
stage in this environment. Only transformers differs: every other torch release the package index
offers for this machine is a multi-GB CUDA build, too big for CI (see docs/running.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from procs import STARTED, clean_up, finish, start
from reference import assert_close_to_scale, reference_run
from safetensors.torch import load_file
from test_runtime_plans import free_ports, make_plan

from hetero.runtime.tools.run_compare import read_metrics, step_lines
from hetero.specs import ModelSpec, TrainSpec

pytestmark = pytest.mark.slow

OTHER_TRANSFORMERS = "5.12.1"
SEQ_LEN = 32
TRAIN = TrainSpec(micro_batch_size=2, num_micro_batches=4, steps=2, lr=1e-3, max_grad_norm=0.3)


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    clean_up()


@pytest.fixture(scope="module")
def other_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("other-env") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # --no-compile: byte-compiling every transformers module takes longer than importing the few a stage uses.
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                           "--no-compile", f"transformers=={OTHER_TRANSFORMERS}"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return python


def _run(tmp_path: Path, name: str, beta_python: Path) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    port = free_ports(1)[0]
    worker = subprocess.Popen(
        [str(beta_python), "-m", "hetero.cli", "worker", "plan.json", "--host", "beta",
         "--coordinator", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / f"{name}-beta")],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    STARTED.append(worker)
    run = start(["run", "plan.json", "--run-dir", name, "--port", str(port), "--no-progress"], tmp_path)
    code, _, err = finish(run)
    assert code == 0, err[-3000:]
    assert finish(worker, 60)[0] == 0
    losses = [x["loss"] for x in step_lines(read_metrics(tmp_path / name / "metrics.jsonl"))]
    adapter = load_file(str(tmp_path / name / "adapter" / "adapter_model.safetensors"))
    envs = json.loads((tmp_path / name / "environments.json").read_text())
    return losses, adapter, envs


def test_a_stage_on_another_transformers_version_trains_the_same(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                                tmp_path: Path, other_python: Path) -> None:
    # The independent reference (plain transformers + peft, this environment), not a second hetero run.
    reference = reference_run(tiny_model_dir, tmp_path / "reference", TRAIN, SEQ_LEN)
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [2, 2, 2], hosts=["alpha", "beta", "beta"],
                     train=TRAIN, lora=reference["lora"], seq_len=SEQ_LEN)
    plan.save(tmp_path / "plan.json")
    mixed_losses, mixed_adapter, mixed_envs = _run(tmp_path, "mixed", other_python)

    versions = [mixed_envs[f"stage{k}"]["packages"]["transformers"] for k in range(3)]
    assert versions[1] == versions[2] == OTHER_TRANSFORMERS != versions[0], versions
    assert mixed_losses == pytest.approx(reference["losses"], rel=1e-4)
    assert mixed_adapter.keys() == reference["state"].keys() and len(mixed_adapter) == 6 * 7 * 2
    for key, want in reference["state"].items():
        assert_close_to_scale(key, mixed_adapter[key], want, 1e-4)
