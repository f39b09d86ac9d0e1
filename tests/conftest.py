"""Shared fixtures: the tiny model spec and its locally built weights + tokenizer (no downloads)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from hetero.errors import ConfigError
from hetero.serde import from_dict
from hetero.specs import ModelSpec

REPO = Path(__file__).resolve().parent.parent
TINY_YAML = REPO / "conf" / "model" / "tiny.yaml"


def load_tiny_spec() -> ModelSpec:
    """ModelSpec of conf/model/tiny.yaml, read with plain yaml (no Hydra)."""
    model = yaml.safe_load(TINY_YAML.read_text())["model"]
    return from_dict(ModelSpec, model, where="conf/model/tiny.yaml:model", error=ConfigError)


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
def tiny_model_dir(tiny_spec: ModelSpec, tiny_cache: Path) -> Path:
    """Directory with the tiny model's config.json, model.safetensors and tokenizer."""
    from hetero.runtime.pretrained import resolve_dir

    return resolve_dir(tiny_spec)
