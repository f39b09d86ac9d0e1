"""Weights resolution: the locally built tiny model, local dirs, the HF cache, and the tensor index."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

import hetero.runtime.pretrained as pretrained
from hetero.errors import CheckpointError, ConfigError
from hetero.runtime.pretrained import build_tiny, resolve_dir, tiny_key, weight_index
from hetero.runtime.stage.weights import load_tensors
from hetero.specs import ModelSpec


def test_tiny_model_matches_its_architecture(tiny_model_dir: Path, tiny_spec: ModelSpec) -> None:
    arch = tiny_spec.architecture
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.model_type == arch["model_type"]
    for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "vocab_size", "intermediate_size"):
        assert getattr(model.config, key) == arch[key]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tok) == arch["vocab_size"]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (
        arch["pad_token_id"], arch["bos_token_id"], arch["eos_token_id"],
    )
    text = "### Instruction:\nConvert 12 miles to kilometers.\n\n### Response:\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text  # byte-level: lossless round trip
    assert len(ids) < len(text) / 2  # trained merges actually compress the demo domain
    assert max(ids) < arch["vocab_size"]


def test_tiny_build_is_deterministic_and_reused(tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path) -> None:
    torch.manual_seed(1234)  # the caller's RNG state must not leak into the weights
    rebuilt = tmp_path / "again"
    rebuilt.mkdir()
    build_tiny(tiny_spec.architecture, rebuilt)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (rebuilt / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    stamp = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_dir(tiny_spec) == tiny_model_dir
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == stamp
    assert tiny_model_dir.name == f"tiny-{tiny_key(tiny_spec.architecture)}"
    other = dict(tiny_spec.architecture, num_hidden_layers=2)
    assert tiny_key(other) != tiny_key(tiny_spec.architecture)


def test_lost_race_uses_the_winners_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_spec: ModelSpec) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    final = tmp_path / "hetero" / f"tiny-{tiny_key(tiny_spec.architecture)}"

    def racing_build(architecture: dict, out_dir: Path) -> None:
        # Another process finishes first while this one is still building.
        final.mkdir(parents=True)
        (final / "config.json").write_text("{}")
        (out_dir / "config.json").write_text('{"loser": true}')

    monkeypatch.setattr(pretrained, "build_tiny", racing_build)
    assert resolve_dir(tiny_spec) == final
    assert json.loads((final / "config.json").read_text()) == {}
    assert os.listdir(tmp_path / "hetero") == [final.name]  # the loser's temp dir is gone


def test_local_dir(tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path) -> None:
    spec = dataclasses.replace(tiny_spec, pretrained=str(tiny_model_dir))
    assert resolve_dir(spec) == tiny_model_dir.resolve()
    with pytest.raises(ConfigError, match="no config.json"):
        resolve_dir(dataclasses.replace(tiny_spec, pretrained=str(tmp_path)))
    with pytest.raises(ConfigError, match="no such directory"):
        resolve_dir(dataclasses.replace(tiny_spec, pretrained=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="empty"):
        resolve_dir(dataclasses.replace(tiny_spec, pretrained=None))


def test_hub_id_uses_local_cache_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_spec: ModelSpec) -> None:
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match="download it first"):
        resolve_dir(dataclasses.replace(tiny_spec, pretrained="someone/not-downloaded"))
    # The layout huggingface_hub writes: refs/main names the snapshot commit.
    repo = tmp_path / "models--someone--cached"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    got = resolve_dir(dataclasses.replace(tiny_spec, pretrained="someone/cached"))
    assert got.resolve() == snapshot.resolve()


def test_weight_index_single_and_sharded(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    state = model.state_dict()
    single = weight_index(tiny_model_dir)
    assert set(single) == set(state)
    assert set(single.values()) == {str(tiny_model_dir / "model.safetensors")}

    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sharded = weight_index(tmp_path)
    assert set(sharded) == set(state)
    assert len(set(sharded.values())) > 2
    for name, file in sharded.items():  # each name really is in the file the index points to
        with safe_open(file, framework="pt") as f:
            assert name in f.keys()
    wanted = ["model.layers.3.mlp.down_proj.weight", "lm_head.weight"]
    tensors = load_tensors(tmp_path, wanted)
    for name in wanted:
        assert torch.equal(tensors[name], state[name])
    with pytest.raises(CheckpointError, match="missing tensors"):
        load_tensors(tmp_path, ["model.layers.99.nope"])


def test_weight_index_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="safetensors"):
        weight_index(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(CheckpointError, match="weight_map"):
        weight_index(tmp_path)


def test_bad_special_token_ids(tiny_spec: ModelSpec, tmp_path: Path) -> None:
    arch = dict(tiny_spec.architecture, pad_token_id=7)
    with pytest.raises(ConfigError, match="special token ids"):
        build_tiny(arch, tmp_path)
    with pytest.raises(ConfigError, match="model_type"):
        build_tiny({k: v for k, v in tiny_spec.architecture.items() if k != "model_type"}, tmp_path)
