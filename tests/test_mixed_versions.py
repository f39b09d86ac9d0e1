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
from safetensors.torch import load_file
from test_runtime_plans import free_ports, make_plan

from hetero.specs import ModelSpec, TrainSpec

pytestmark = pytest.mark.slow

OTHER_TRANSFORMERS = "5.12.1"


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    clean_up()


@pytest.fixture(scope="module")
def other_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("other-env") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                           f"transformers=={OTHER_TRANSFORMERS}"], capture_output=True, text=True, timeout=600)
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
    losses = [json.loads(x)["loss"] for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    adapter = load_file(str(tmp_path / name / "adapter" / "adapter_model.safetensors"))
    envs = json.loads((tmp_path / name / "environments.json").read_text())
    return losses, adapter, envs


def test_a_stage_on_another_transformers_version_trains_the_same(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                                tmp_path: Path, other_python: Path) -> None:
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [2, 2, 2], hosts=["alpha", "beta", "beta"],
                     train=TrainSpec(micro_batch_size=2, num_micro_batches=4, steps=2, lr=1e-3))
    plan.save(tmp_path / "plan.json")
    same_losses, same_adapter, same_envs = _run(tmp_path, "same", Path(sys.executable))
    mixed_losses, mixed_adapter, mixed_envs = _run(tmp_path, "mixed", other_python)

    versions = [mixed_envs[f"stage{k}"]["packages"]["transformers"] for k in range(3)]
    assert versions[1] == versions[2] == OTHER_TRANSFORMERS != versions[0], versions
    assert same_envs["stage1"]["packages"]["transformers"] == versions[0]
    assert mixed_losses == pytest.approx(same_losses, rel=1e-5)
    assert same_adapter.keys() == mixed_adapter.keys() and len(same_adapter) == 6 * 7 * 2
    for key, tensor in same_adapter.items():
        torch.testing.assert_close(mixed_adapter[key], tensor, rtol=1e-4, atol=1e-6, msg=key)
