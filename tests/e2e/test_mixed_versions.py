"""Hosts that really differ: stages under another transformers or torch version train like the rest.

A second virtualenv (this Python's site-packages plus another release installed over it) runs host beta's
`hetero worker`; the run must train like the same plan run with every stage in this environment.

- transformers 5.12.1 (small): against plain transformers + peft, as every equivalence test.
- torch 2.14.1 (the other torch minor the package index has for this machine: a CUDA build, about 5.2 GB with
  its nvidia wheels; it runs on the CPU here). Installed once into a cache folder,
  ``$HETERO_TEST_CACHE`` or ``~/.cache/hetero-tests``, and reused by later runs (about 2 minutes to build
  on the 2-core sandbox); the losses must equal the single-version run's within 1e-5.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from metrics_rows import read_metrics, step_lines
from plans import free_ports, make_plan
from procs import STARTED, clean_up, finish, start
from reference import assert_close_to_scale
from safetensors.torch import load_file

from hetero.specs import ModelSpec, TrainSpec

pytestmark = pytest.mark.slow

OTHER_TRANSFORMERS = "5.12.1"
OTHER_TORCH = "2.14.1"
SEQ_LEN = 32
TRAIN = TrainSpec(micro_batch_size=2, num_micro_batches=4, steps=2, lr=1e-3, max_grad_norm=0.3)


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    clean_up()


def _see_this_environment(venv: Path) -> None:
    """Make this interpreter's packages (hetero itself) importable in ``venv``, after the venv's own: in a
    virtualenv, ``--system-site-packages`` reaches only the base interpreter's, where hetero may be missing or
    another checkout. Rewritten at each use: a cached venv may have been made from another environment."""
    import site

    lib = next((venv / "lib").glob("python*/site-packages"))
    lines = [f"import site; site.addsitedir({path!r})" for path in site.getsitepackages() if Path(path).is_dir()]
    (lib / "zz_hetero_parent.pth").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def other_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("other-env") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    _see_this_environment(venv)
    python = venv / "bin" / "python"
    # Where the venv sees a `kernels` package (this environment's or the base interpreter's), it gets the release
    # that transformers declares for it: a newer one breaks `import transformers` of older releases ("Either a
    # revision or a version must be specified", kernels >= 0.15 with transformers 5.12), seen on a CI machine.
    kernels = subprocess.run([str(python), "-c", "import importlib.util as u; print(u.find_spec('kernels') is not None)"],
                             capture_output=True, text=True, timeout=120).stdout.strip() == "True"
    extra = "[kernels]" if kernels else ""
    # --no-compile: byte-compiling every transformers module takes longer than importing the few a stage uses.
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                           "--no-compile", f"transformers{extra}=={OTHER_TRANSFORMERS}"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return python


def _cached_venv(name: str, requirement: str) -> Path:
    """A venv over this Python's site-packages with ``requirement`` installed, built once in the test cache."""
    cache = Path(os.environ.get("HETERO_TEST_CACHE") or Path.home() / ".cache" / "hetero-tests")
    venv = cache / f"venv-{name}-py{sys.version_info.major}{sys.version_info.minor}"
    python = venv / "bin" / "python"
    want = requirement.split("==")[1]
    check = [str(python), "-c", f"import {name}; print({name}.__version__.split('+')[0])"]
    if python.exists():
        _see_this_environment(venv)
        done = subprocess.run(check, capture_output=True, text=True, timeout=300)
        if done.returncode == 0 and done.stdout.strip() == want:
            return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--system-site-packages", str(venv)], check=True,
                   timeout=120)
    _see_this_environment(venv)
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile",
                           requirement], capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-2000:]
    done = subprocess.run(check, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == want, done.stdout + done.stderr[-2000:]
    return python


@pytest.fixture(scope="module")
def other_torch() -> Path:
    return _cached_venv("torch", f"torch=={OTHER_TORCH}")


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


def test_a_stage_on_another_transformers_version_trains_the_same(references: Callable[..., dict], tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                                tmp_path: Path, other_python: Path) -> None:
    # The independent reference (plain transformers + peft, this environment), not a second hetero run.
    reference = references(tiny_model_dir, TRAIN, SEQ_LEN)
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


def test_stages_on_another_torch_minor_train_the_same(tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path,
                                                      other_torch: Path) -> None:
    """Stage 0 under this torch, stages 1 and 2 under torch 2.14.1: the same losses as every stage under this
    torch (1e-5), the same adapter (1e-4 of each tensor's scale), and the environments say which ran where."""
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [2, 2, 2], hosts=["alpha", "beta", "beta"],
                     train=TRAIN, seq_len=SEQ_LEN)
    plan.save(tmp_path / "plan.json")
    same_losses, same_adapter, same_envs = _run(tmp_path, "same", Path(sys.executable))
    mixed_losses, mixed_adapter, mixed_envs = _run(tmp_path, "mixed", other_torch)

    here = torch.__version__.split("+")[0]
    versions = [mixed_envs[f"stage{k}"]["packages"]["torch"].split("+")[0] for k in range(3)]
    assert versions == [here, OTHER_TORCH, OTHER_TORCH] != [same_envs[f"stage{k}"]["packages"]["torch"].split("+")[0]
                                                            for k in range(3)], versions
    assert mixed_losses == pytest.approx(same_losses, rel=1e-5, abs=1e-6)
    assert mixed_adapter.keys() == same_adapter.keys()
    for key, want in same_adapter.items():
        assert_close_to_scale(key, mixed_adapter[key], want, 1e-4)
