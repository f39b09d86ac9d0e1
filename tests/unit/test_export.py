"""`hetero export`: the merged model serves without peft and computes what base + adapter computes."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from reference import make_init_adapter
from transformers import AutoModelForCausalLM, AutoTokenizer

from hetero import cli
from hetero.runtime.tools import export as export_mod
from hetero.specs import ModelSpec


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A peft-written adapter for the tiny model, lora_B non-zero, naming the tiny model dir as its base."""
    out = tmp_path_factory.mktemp("export") / "adapter"
    make_init_adapter(tiny_model_dir, tiny_spec.lora, out, seed=5)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_model_dir)
    return out


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[1, 5, 77, 300, 12, 499, 2, 64], [1, 9, 9, 410, 33, 7, 250, 3]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_merged_model_equals_base_plus_adapter(
    adapter: Path, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "merged"
    assert cli.main(["export", str(adapter), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert re.search(r"merging tiny-\w+ \(0\.3\d+M parameters\) in float32: needs ~\d", captured.err)
    assert f"wrote {out}" in captured.out and f"AutoModelForCausalLM.from_pretrained('{out}')" in captured.out

    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in names and "config.json" in names and "tokenizer.json" in names, names
    assert not [n for n in names if n.endswith((".bin", ".pt")) or n.startswith("adapter")], names
    assert not list(tmp_path.glob(".merged*"))  # no staging leftovers

    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert not [k for k in merged.state_dict() if "lora" in k]  # a plain model: peft is not needed
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    plain = _logits(base)
    with_adapter = _logits(PeftModel.from_pretrained(base, str(adapter)).eval())
    got = _logits(merged)
    assert (with_adapter - plain).abs().max() > 1e-3  # the adapter changes the outputs
    torch.testing.assert_close(got, with_adapter, rtol=0, atol=2e-5)

    text = "Give three tips for staying healthy."
    assert AutoTokenizer.from_pretrained(str(out))(text)["input_ids"] == (
        AutoTokenizer.from_pretrained(str(tiny_model_dir))(text)["input_ids"])


def test_estimate_counts_the_base_and_one_delta(
    adapter: Path, tiny_model_dir: Path, tiny_spec: ModelSpec
) -> None:
    cost = export_mod.merge_cost(tiny_model_dir, adapter, "bfloat16")
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    assert cost.parameters == sum(p.numel() for p in base.parameters())
    assert cost.weight_bytes == 2 * cost.parameters
    arch = tiny_spec.architecture
    # The largest LoRA module is an MLP projection: hidden x intermediate, in fp32 plus its bf16 cast.
    assert cost.delta_bytes == arch["hidden_size"] * arch["intermediate_size"] * (4 + 2)
    assert cost.memory_bytes > cost.weight_bytes + cost.delta_bytes
    assert cost.disk_bytes >= cost.weight_bytes + (tiny_model_dir / "tokenizer.json").stat().st_size


def test_too_little_memory_or_disk_is_refused_and_writes_nothing(
    adapter: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "models" / "merged"
    monkeypatch.setattr(export_mod, "available_memory_bytes", lambda: 50_000_000)
    assert cli.main(["export", str(adapter), "--out", str(out), "--dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(
        r"hetero: error: merging tiny-\w+ in bfloat16 needs ~0\.\d GB of memory, "
        r"this host has 50 MB available: run `hetero export` on a host with more memory, "
        r"or serve the adapter with the base model \(AutoPeftModelForCausalLM\)", err), err
    assert not (tmp_path / "models").exists()

    monkeypatch.setattr(export_mod, "available_memory_bytes", lambda: None)  # no /proc/meminfo: a note
    monkeypatch.setattr(export_mod, "free_disk_bytes", lambda path: 100_000)
    assert cli.main(["export", str(adapter), "--out", str(out)]) == 2
    note, err = capsys.readouterr().err.strip().splitlines()
    assert note.startswith("hetero export: note: cannot read this host's available memory"), note
    assert re.fullmatch(r"hetero: error: the merged tiny-\w+ in float32 needs ~1\.\d+ MB of disk, "
                        rf"{tmp_path} has 0\.1 MB free: free space or pass --out on another disk", err), err
    assert not (tmp_path / "models").exists()


def test_memory_reader_takes_the_smaller_of_host_and_cgroup(tmp_path: Path) -> None:
    meminfo, cgroup = tmp_path / "meminfo", tmp_path / "cgroup"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:    8000000 kB\n")
    assert export_mod.available_memory_bytes(meminfo, cgroup) == 8_000_000 * 1024
    cgroup.mkdir()
    (cgroup / "memory.max").write_text("4000000000\n")
    (cgroup / "memory.current").write_text("1000000000\n")
    assert export_mod.available_memory_bytes(meminfo, cgroup) == 3_000_000_000
    (cgroup / "memory.max").write_text("max\n")
    assert export_mod.available_memory_bytes(meminfo, cgroup) == 8_000_000 * 1024
    assert export_mod.available_memory_bytes(tmp_path / "absent", cgroup) is None


def test_run_dir_finds_its_adapter_and_a_full_out_needs_force(
    adapter: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.json").write_text(json.dumps({"model": {"name": "tiny"}}))
    assert cli.main(["export", str(run), "--out", str(tmp_path / "x")]) == 2
    assert "did the run finish?" in capsys.readouterr().err

    shutil.copytree(adapter, run / "adapter")
    out = tmp_path / "served"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert cli.main(["export", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"hetero: error: --out {out} exists and is not empty: pass another directory, "
                   "or --force to replace it")
    assert (out / "notes.txt").read_text() == "keep me"
    assert cli.main(["export", str(run), "--out", str(run / "adapter"), "--force"]) == 2
    assert "holds the adapter or base model" in capsys.readouterr().err

    assert cli.main(["export", str(run), "--out", str(out), "--force", "--dtype", "bfloat16"]) == 0
    err = capsys.readouterr().err
    assert "merging tiny (0.3" in err and f"applying and merging the adapter {run / 'adapter'}" in err
    assert not (out / "notes.txt").exists()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert (run / "adapter" / "adapter_model.safetensors").is_file()


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert "merge a run's adapter into its base model" in cli.build_parser().format_help()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["export", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--out" in out and "--dtype {bfloat16,float16,float32}" in out and "--force" in out


@pytest.mark.parametrize("dtype", [None, "bfloat16", "float32"])
def test_a_pre_quantized_base_is_refused_with_or_without_dtype(
    adapter: Path, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], dtype: str | None
) -> None:
    # The base's config.json says its weights are stored quantized: a merge into them cannot be right,
    # whichever dtype --dtype asks the merged model in.
    base = tmp_path / "base-4bit"
    shutil.copytree(tiny_model_dir, base)
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (base / "config.json").write_text(json.dumps(config))
    quantized_adapter = tmp_path / "adapter"
    shutil.copytree(adapter, quantized_adapter)
    adapter_config = json.loads((quantized_adapter / "adapter_config.json").read_text())
    (quantized_adapter / "adapter_config.json").write_text(
        json.dumps({**adapter_config, "base_model_name_or_path": str(base)}))
    out = tmp_path / "merged"
    argv = ["export", str(quantized_adapter), "--out", str(out), *(["--dtype", dtype] if dtype else [])]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"hetero: error: base model {base} is stored bitsandbytes-quantized: a merge needs the "
                   "full-precision weights; point the adapter's base_model_name_or_path at the unquantized model")
    assert not out.exists()
