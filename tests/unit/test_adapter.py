"""Adapter I/O: stage pieces saved as one PEFT adapter load back in plain peft with identical outputs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from hetero.errors import CheckpointError
from hetero.runtime.stage.adapter import layer_prefix, load_adapter_state, save_adapter, select
from hetero.specs import LoraSpec, ModelSpec


@pytest.fixture(scope="module")
def trained_peft(tiny_model_dir: Path, tiny_spec: ModelSpec) -> torch.nn.Module:
    """A peft model whose LoRA B is non-zero, so the adapter really changes the outputs."""
    lora = tiny_spec.lora
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=0.0, target_modules=list(lora.target_modules),
                        task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model.eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(3, 3 + 2 * 24).view(2, 24)
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_stage_pieces_make_one_standard_adapter(
    trained_peft: torch.nn.Module, tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path
) -> None:
    state = {k: v.clone() for k, v in get_peft_model_state_dict(trained_peft).items()}
    layers = tiny_spec.architecture["num_hidden_layers"]
    # Three fake stages of two decoder layers each, as the runtime holds them.
    pieces = [select(state, [layer_prefix(i) for i in range(k, k + 2)]) for k in range(0, layers, 2)]
    assert all(pieces) and sum(len(p) for p in pieces) == len(state)
    union: dict[str, torch.Tensor] = {}
    for piece in pieces:
        assert not set(piece) & set(union)
        union.update(piece)

    out = tmp_path / "adapter"
    save_adapter(union, tiny_spec.lora, str(tiny_model_dir), out)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == tiny_spec.lora.r and config["task_type"] == "CAUSAL_LM"
    assert config["base_model_name_or_path"] == str(tiny_model_dir)
    # Written without peft, read by peft as the LoraConfig peft itself would write for these settings.
    from peft import LoraConfig, PeftConfig

    read = PeftConfig.from_pretrained(str(out))
    lora = tiny_spec.lora
    want = LoraConfig(r=lora.r, lora_alpha=int(lora.alpha), lora_dropout=lora.dropout, bias="none",
                      target_modules=list(lora.target_modules), task_type="CAUSAL_LM",
                      base_model_name_or_path=str(tiny_model_dir))
    assert isinstance(read, LoraConfig)
    assert {k: v for k, v in read.to_dict().items() if k not in ("inference_mode", "peft_version")} == \
        {k: v for k, v in want.to_dict().items() if k not in ("inference_mode", "peft_version")}

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    plain = _logits(base)
    loaded = PeftModel.from_pretrained(base, out).eval()
    expected = _logits(trained_peft)
    assert not torch.allclose(expected, plain, atol=1e-4)  # the adapter matters
    assert torch.equal(_logits(loaded), expected)

    back = load_adapter_state(out, tiny_spec.lora)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)


def test_load_validates_against_the_plan(trained_peft: torch.nn.Module, tiny_spec: ModelSpec, tmp_path: Path) -> None:
    state = get_peft_model_state_dict(trained_peft)
    out = tmp_path / "adapter"
    save_adapter(state, tiny_spec.lora, "tiny", out)
    with pytest.raises(CheckpointError, match="r=8 but the plan has lora.r=4"):
        load_adapter_state(out, dataclasses.replace(tiny_spec.lora, r=4))
    with pytest.raises(CheckpointError, match="target_modules"):
        load_adapter_state(out, dataclasses.replace(tiny_spec.lora, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(CheckpointError, match="lora_alpha"):
        load_adapter_state(out, dataclasses.replace(tiny_spec.lora, alpha=32.0))
    (out / "adapter_model.safetensors").unlink()
    (out / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match="never loads"):
        load_adapter_state(out)
    with pytest.raises(CheckpointError, match="no such directory"):
        load_adapter_state(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="adapter_config.json"):
        load_adapter_state(tmp_path)


def test_save_rejects_inconsistent_state(trained_peft: torch.nn.Module, tmp_path: Path) -> None:
    state = dict(get_peft_model_state_dict(trained_peft))
    lora = LoraSpec(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    with pytest.raises(CheckpointError, match="not rank 4"):
        save_adapter(state, dataclasses.replace(lora, r=4), "tiny", tmp_path / "a")
    with pytest.raises(CheckpointError, match="LoRA on '(gate|up|down)_proj'"):
        save_adapter(state, dataclasses.replace(lora, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
                     "tiny", tmp_path / "b")
    lonely = {k: v for k, v in state.items() if not k.endswith("layers.0.self_attn.q_proj.lora_B.weight")}
    with pytest.raises(CheckpointError, match="without its pair"):
        save_adapter(lonely, lora, "tiny", tmp_path / "c")
    with pytest.raises(CheckpointError, match="PEFT key space"):
        save_adapter({"model.layers.0.q_proj.lora_A.weight": torch.zeros(8, 4)}, lora, "tiny", tmp_path / "d")
    assert not (tmp_path / "a").exists()  # nothing half-written on a rejected state


