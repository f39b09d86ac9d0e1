"""Shared fixtures: the tiny model spec and its locally built weights + tokenizer (no downloads)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tqdm
import yaml

from hetero.errors import ConfigError
from hetero.serde import from_dict
from hetero.specs import ModelSpec

REPO = Path(__file__).resolve().parent.parent

# tqdm's monitor thread outlives the first progress bar a test makes (transformers and the hub make them) and would
# keep `hetero run`'s launcher from forking in this process (runtime/run/launcher.py forks only a one-thread process):
# every later in-process run would start its stages as fresh interpreters, seconds of imports each.
tqdm.tqdm.monitor_interval = 0

TINY_YAML = REPO / "conf" / "model" / "tiny.yaml"


def load_tiny_spec() -> ModelSpec:
    """ModelSpec of conf/model/tiny.yaml, read with plain yaml (no Hydra)."""
    model = yaml.safe_load(TINY_YAML.read_text())["model"]
    return from_dict(ModelSpec, model, where="conf/model/tiny.yaml:model", error=ConfigError)


@pytest.fixture(autouse=True)
def _torch_state_of_the_session() -> Iterator[None]:
    """Each test starts with torch's process-wide settings as the session had them: a test that sets the
    thread count (as the profiler and the evaluator do in this process) or the default dtype must not change
    the rounding of the tests after it (a float64 comparison at one thread is not the one at two)."""
    import torch

    threads, dtype, grad = torch.get_num_threads(), torch.get_default_dtype(), torch.is_grad_enabled()
    yield
    torch.set_num_threads(threads)
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad)


@pytest.fixture(scope="session")
def tiny_spec() -> ModelSpec:
    """The tiny Llama ModelSpec from conf/model/tiny.yaml."""
    return load_tiny_spec()


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A per-session hetero cache: XDG_CACHE_HOME points here while the session's tests run.

    Set through a session MonkeyPatch (undone at the end) rather than globally, so stage processes
    that tests spawn inherit it and find the model already built.
    """
    root = tmp_path_factory.mktemp("xdg_cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(root))
    try:
        yield root
    finally:
        mp.undo()


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict]:
    """``references(model_dir, train, seq_len, **options)``: tests/reference.py's ``reference_run``, computed
    once per test session for the same inputs, so the test files that compare with one reference share it.
    Each caller gets a folder of its own as ``root`` (for its runs); the losses, the adapter state and the initial
    adapter are shared: read them, do not change them."""
    from reference import reference_run

    done: dict[tuple, dict] = {}

    def get(model_dir: Path, train: Any, seq_len: int, **options: Any) -> dict:
        key = (str(model_dir), train, seq_len, tuple(sorted((k, repr(v)) for k, v in options.items())))
        if key not in done:
            root = tmp_path_factory.mktemp("reference")
            done[key] = reference_run(model_dir, root, train, seq_len, **options)
        return {**done[key], "root": tmp_path_factory.mktemp("runs")}

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_spec: ModelSpec, tiny_cache: Path) -> Path:
    """Directory with the tiny model's config.json, model.safetensors and tokenizer."""
    from hetero.runtime.pretrained import resolve_dir

    return resolve_dir(tiny_spec)
