"""Config composition, fleet building and datasheets: what a user declares becomes the right specs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hetero import config as config_mod
from hetero.config import load
from hetero.errors import ConfigError, UnknownDeviceError
from hetero.hardware import build_cluster, load_device_types

MODELS = {"tiny": 6, "llama8b": 32, "llama70b": 80, "mistral7b": 32, "qwen2_7b": 28, "qwen3_8b": 36, "qwen3_14b": 40,
          "phi4": 40, "mistral_nemo_12b": 40, "gemma3_12b": 48, "qwen3_30b_a3b": 48, "mixtral_8x7b": 32,
          "smollm3_3b": 36, "glm4_9b": 40, "qwen15_moe_a27b": 24, "olmoe_1b_7b": 16, "glm45_air": 46, "gpt_oss_20b": 24,
          "deepseek_v2_lite": 27, "llama4_scout": 48, "gpt_oss_120b": 36}
FLEETS = {"local": 2, "homelab": 2, "mixed_fleet": 4, "mining_rig": 6}
REQUIRED_TYPES = [
    "rtx2080ti", "rtx3060", "rtx3070", "rtx3080", "rtx3090", "rtx3090ti", "rtx4060ti_16gb", "rtx4070", "rtx4070ti",
    "rtx4080", "rtx4090", "rtx5090", "p40", "v100_16gb", "v100_32gb", "m40_24gb", "a100_40gb", "a100_80gb",
    "h100_sxm", "h200", "mi100", "mi210", "rx7900xtx", "strix_halo", "apple_m2_max", "apple_m3_max", "apple_m4_max", "cpu",
]  # fmt: skip


@pytest.mark.parametrize("hardware", sorted(FLEETS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_model_and_fleet_composes(model: str, hardware: str) -> None:
    cfg = load([f"model={model}", f"hardware={hardware}"])
    assert cfg.model.name == model
    assert cfg.model.architecture["num_hidden_layers"] == MODELS[model]
    assert cfg.model.lora.r > 0 and cfg.model.seq_len > 0
    assert len(cfg.cluster.devices) == FLEETS[hardware]
    hosts = [h.name for h in cfg.cluster.hosts]
    for i, a in enumerate(hosts):  # every pair of hosts can talk
        for b in hosts[i + 1 :]:
            assert cfg.cluster.link(a, b).bandwidth_gbps > 0
    assert cfg.raw["model"]["name"] == model and cfg.raw["hardware"]["name"] == hardware
    assert cfg.output == Path(".")


def test_real_model_architectures_match_their_parameter_counts() -> None:
    # An independent check of the HF configs: the published sizes (8.03B, 70.6B, 7.25B, 7.62B; Qwen3 8.2B and
    # 14.8B, Phi-4 14.7B, Mistral-Nemo 12.2B from their model cards; Gemma 3 12B's 12.2B less its 0.42B SigLIP
    # vision encoder; Qwen3-30B-A3B 30.5B, Mixtral 8x7B 46.7B; SmolLM3-3B 3.08B, GLM-4-9B-0414 9.4B,
    # Qwen1.5-MoE-A2.7B 14.3B, OLMoE-1B-7B 6.92B, GLM-4.5-Air 106B without its multi-token-prediction layer,
    # gpt-oss-20b 20.9B, gpt-oss-120b 116.8B, DeepSeek-V2-Lite 15.7B; Llama 4 Scout 109B on its model card, of which its language model
    # is 107.8B, the rest its vision encoder).
    def params(arch: dict) -> float:
        h, i, v, n = (
            arch["hidden_size"],
            arch["intermediate_size"],
            arch["vocab_size"],
            arch["num_hidden_layers"],
        )
        head = arch.get("head_dim", h // arch["num_attention_heads"])
        kv = arch["num_key_value_heads"] * head
        attn = h * arch["num_attention_heads"] * head * 2 + 2 * h * kv
        if arch.get("kv_lora_rank"):  # latent attention (DeepSeek): q straight, k/v through a normed latent
            heads, latent, rope = arch["num_attention_heads"], arch["kv_lora_rank"], arch["qk_rope_head_dim"]
            qk, vd = arch["qk_nope_head_dim"] + rope, arch["v_head_dim"]
            attn = h * heads * qk + h * (latent + rope) + latent + latent * heads * (qk - rope + vd) + heads * vd * h
        embeddings = (1 if arch.get("tie_word_embeddings") else 2) * v * h
        experts = arch.get("num_experts") or arch.get("num_local_experts") or arch.get("n_routed_experts")
        dense = arch.get("first_k_dense_replace", 0)  # GLM-4.5: its first layers have a dense MLP
        if experts:  # a router and every expert's gated MLP, and the shared experts (Qwen-MoE's one, GLM-4.5's)
            moe_i = arch.get("moe_intermediate_size", i)
            mlp = experts * (h + 3 * h * moe_i) + 3 * h * arch.get("shared_expert_intermediate_size", 0)
            mlp += 3 * h * moe_i * arch.get("n_shared_experts", 0)
            mlp += 3 * h * i if arch["model_type"] == "llama4_text" else 0  # Llama 4's shared expert
        else:
            mlp = 3 * h * i
        return (n * (attn + 2 * h) + (n - dense) * mlp + dense * 3 * h * i + embeddings + h) / 1e9

    expected = {"llama8b": 8.03, "llama70b": 70.55, "mistral7b": 7.25, "qwen2_7b": 7.62, "qwen3_8b": 8.19,
                "qwen3_14b": 14.77, "phi4": 14.66, "mistral_nemo_12b": 12.25, "gemma3_12b": 11.77,
                "qwen3_30b_a3b": 30.53, "mixtral_8x7b": 46.70, "smollm3_3b": 3.08, "glm4_9b": 9.4,
                "qwen15_moe_a27b": 14.3, "olmoe_1b_7b": 6.92, "glm45_air": 106.0, "gpt_oss_20b": 20.9,
                "deepseek_v2_lite": 15.7, "llama4_scout": 107.8, "gpt_oss_120b": 116.8}
    for model, billions in expected.items():
        arch = load([f"model={model}"]).model.architecture
        assert params(arch) == pytest.approx(billions, rel=0.01), model
    llama = load(["model=llama8b"]).model
    assert llama.architecture["rope_scaling"]["rope_type"] == "llama3"
    assert (
        llama.pretrained == "meta-llama/Llama-3.1-8B"
        and llama.seq_len == 2048
        and llama.quantization == "none"
    )


def test_homelab_fleet_is_a_5090_and_a_strix_halo_on_10gbe() -> None:
    cluster = load(["hardware=homelab"]).cluster
    gpu, igpu = cluster.devices
    assert (gpu.host, gpu.type, gpu.backend, gpu.memory_gb) == ("desktop", "rtx5090", "cuda", 32.0)
    assert (igpu.host, igpu.type, igpu.backend, igpu.memory_gb) == ("strix", "strix_halo", "rocm", 96.0)
    assert cluster.link("desktop", "strix").bandwidth_gbps == 10
    assert gpu.tflops["bfloat16"] == 209.5 and gpu.compute_dtype() == "bfloat16"


def test_local_fleet_follows_num_devices_and_splits_cpu_threads() -> None:
    cluster = load(["hardware=local", "hardware.num_devices=3"]).cluster
    assert [d.name for d in cluster.devices] == ["localhost.cpu0", "localhost.cpu1", "localhost.cpu2"]
    assert [d.index for d in cluster.devices] == [0, 1, 2]
    from hetero.cores import usable_cores

    assert all(d.threads == max(1, usable_cores() // 3) for d in cluster.devices)
    host = cluster.hosts[0]
    assert (host.address, host.port) == ("127.0.0.1", 29500)


def test_cpu_stage_compute_scales_with_its_threads() -> None:
    """A CPU stage computes with its own cores: 2 threads predict twice the TFLOPS of 1, unless overridden."""
    per_core = load_device_types()["cpu"].tflops_fp32
    cluster = build_cluster({"name": "t", "hosts": [{"name": "h", "devices": [
        {"type": "cpu", "threads": 2}, {"type": "cpu", "threads": 1},
        {"type": "cpu", "threads": 4, "tflops_fp32": 0.3}]}]})
    fast, slow, pinned = cluster.devices
    assert fast.tflops["float32"] == pytest.approx(2 * per_core)
    assert slow.tflops["float32"] == pytest.approx(per_core)
    assert pinned.tflops["float32"] == pytest.approx(0.3)  # the user's number is taken as is


def test_mining_rig_expands_counts_with_unique_names_and_torch_indices() -> None:
    cluster = load(["hardware=mining_rig"]).cluster
    assert [d.name for d in cluster.devices] == [
        "rig.rtx3090_0", "rig.rtx3090_1", "rig.rtx3090_2", "rig.rtx3090_3", "rig.rtx3080_0", "rig.rtx3080_1",
    ]  # fmt: skip
    assert [d.index for d in cluster.devices] == list(range(6))
    assert cluster.intra_host_bandwidth_gbps == 8


def test_overrides_reach_the_specs() -> None:
    cfg = load(["model=llama8b", "train.micro_batch_size=2", "planner.time_limit_s=5", "model.quantization=nf4",
                "output=out/x", "model.dtype=fp16", "lora.r=4"])  # fmt: skip
    assert cfg.train.micro_batch_size == 2 and cfg.planner.time_limit_s == 5.0
    assert cfg.model.quantization == "nf4" and cfg.model.dtype == "float16" and cfg.model.lora.r == 4
    assert cfg.output == Path("out/x") and cfg.raw["train"]["micro_batch_size"] == 2


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


FLEET = """\
name: mine
hosts:
  - name: box
    address: 10.0.0.2
    devices:
      - {type: rtx5090}
      - {type: v100_16gb, memory_gb: 15, name: old}
  - name: strix
    address: 10.0.0.3
    devices:
      - {type: strix_halo, memory_gb: 64}
links:
  - {a: box, b: strix, bandwidth_gbps: 2.5, latency_us: 80}
"""


def test_user_fleet_from_config_dir_with_overrides(tmp_path: Path) -> None:
    _write(tmp_path / "hardware" / "myfleet.yaml", FLEET)
    cluster = load(["hardware=myfleet"], str(tmp_path)).cluster
    names = [d.name for d in cluster.devices]
    assert names == ["box.rtx5090_0", "old", "strix.strix_halo0"]
    old = cluster.device("old")
    assert old.memory_gb == 15.0 and old.overrides == ["memory_gb=15 (datasheet 16)"] and not old.bf16
    assert old.compute_dtype() == "float16"  # V100: no bf16
    assert cluster.device("strix.strix_halo0").memory_gb == 64.0
    assert cluster.device("box.rtx5090_0").overrides == []
    assert cluster.link("strix", "box").bandwidth_gbps == 2.5


def test_user_hardware_specs_dir_adds_device_types(tmp_path: Path) -> None:
    spec = (Path(__file__).parents[2] / "hardware_specs" / "rtx3090.yaml").read_text()
    _write(tmp_path / "hardware_specs" / "rtx3090ti.yaml", spec.replace("name: rtx3090", "name: rtx3090ti"))
    _write(tmp_path / "hardware" / "ti.yaml", "name: ti\nhosts:\n  - name: a\n    devices: [rtx3090ti]\n")
    assert load(["hardware=ti"], str(tmp_path)).cluster.devices[0].type == "rtx3090ti"


def test_datasheets_are_complete_and_consistent() -> None:
    types = load_device_types()
    assert set(REQUIRED_TYPES) <= set(types)
    for name, t in types.items():
        assert t.name == name and t.source, name
        assert t.memory_gb > 0 and t.memory_bandwidth_gbs > 0 and t.tflops_fp32 > 0 and t.tflops_fp16 > 0
        assert (t.tflops_bf16 > 0) == t.bf16, name
    for old in ("v100_16gb", "v100_32gb", "m40_24gb"):
        assert not types[old].bf16
    assert types["m40_24gb"].tflops_fp16 == types["m40_24gb"].tflops_fp32  # no tensor cores, no fast fp16
    for geforce in ("rtx3060", "rtx3070", "rtx3080", "rtx3090", "rtx3090ti", "rtx4060ti_16gb", "rtx4070", "rtx4070ti",
                    "rtx4080", "rtx4090", "rtx5090"):
        # GeForce tensor fp16 with fp32 accumulate is 2x the fp32 rate (the fp16-accumulate figure is 4x)
        assert types[geforce].tflops_fp16 / types[geforce].tflops_fp32 == pytest.approx(2.0, rel=0.01)
    assert all(not t.nf4 for t in types.values() if t.backend == "mps")
    assert types["cpu"].nf4 and not types["cpu"].bf16 and types["cpu"].backend == "cpu"


# --- one-line errors -------------------------------------------------------------------------------


def _error(overrides: list[str], config_dir: Path | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(overrides, None if config_dir is None else str(config_dir))
    message = str(info.value)
    assert "\n" not in message
    return info.value


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "hardware" / "broken.yaml", "name: b\nhosts:\n  - name: a\n    devices: [{type: rtx3090}\n"
    )
    message = str(_error(["hardware=broken"], tmp_path))
    assert message.startswith(f"{path}:") and "malformed YAML" in message
    line = int(message.split(":")[1])
    assert 4 <= line <= 5  # the unclosed bracket on line 4 (the parser notices at the end of the file)


def test_unknown_gpu_type_suggests_the_closest(tmp_path: Path) -> None:
    _write(tmp_path / "hardware" / "typo.yaml", "hosts:\n  - name: a\n    devices: [{type: rtx9090}]\n")
    err = _error(["hardware=typo"], tmp_path)
    assert isinstance(err, UnknownDeviceError)
    assert str(err).startswith("unknown GPU type 'rtx9090' in hardware.hosts[0].devices[0] (a typo of rtx5090?); "
                               "closest of the ")
    # ... the nearest names (not all of them: one line however many types), and how to add a card not bundled.
    assert re.search(r"known: rtx5090, rtx4090, rtx3090, rtx3090ti; for another card copy \S+/hardware_specs/rtx5090\.yaml "
                     r"to hardware_specs/<type>\.yaml beside your fleet \(-cd DIR\) and edit its figures$", str(err)), str(err)


def test_unknown_group_option_lists_available() -> None:
    assert str(_error(["model=llama9b"])) == (
        "unknown model 'llama9b'; available: deepseek_v2_lite, gemma3_12b, glm45_air, glm4_9b, gpt_oss_120b, "
        "gpt_oss_20b, hf, llama4_scout, llama70b, llama8b, mistral7b, mistral_nemo_12b, mixtral_8x7b, olmoe_1b_7b, phi4, qwen15_moe_a27b, qwen2_7b, qwen3_14b, "
        "qwen3_30b_a3b, qwen3_8b, smollm3_3b, tiny"
    )
    assert "add --config-dir" in str(_error(["hardware=myfleet"]))


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.micro_batch_size=four", "train.micro_batch_size must be an integer, got 'four'"),
        ("planner.efficiency=fast", "planner.efficiency must be a number, got 'fast'"),
        ("train.schedule=zigzag", "train.schedule must be one of ['1f1b', 'gpipe'], got 'zigzag'"),
        ("model.dtype=int3", "model.dtype must be one of"),
        ("train.num_micro_batches=0", "train.num_micro_batches must be positive, got 0"),
        ("train.foo=1", "unknown key 'train.foo'; train has: micro_batch_size"),
        ("+train.foo=1", "unknown key(s) train.foo; train has: micro_batch_size"),
        ("hardware.num_devices=two", "hardware.hosts[0].devices[0].count must be an integer, got 'two'"),
    ],
)
def test_bad_values_are_one_line_errors(override: str, expected: str) -> None:
    assert str(_error([override])).startswith(expected)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("~train=3", "~train=3: ~train removes the train group and takes no value (or the name of its selected "
                     "file); to change one of its keys write train.KEY=VALUE"),
        ("~model=[a]", "~model=[a]: ~model removes the model group"),
        ("~model", "model must be a mapping (pick one with model=<name>), got None"),
        ("=3", "'=3' has no key before '=': write key=value, e.g. train.lr=1e-4"),
        ("~=1", "'~=1' has no key before '='"),
        ("train.=", "cannot read the override 'train.='; write key=value"),
        ("++x", "cannot read the override '++x'"),
        ("train.lr=[", "cannot read the override 'train.lr=['"),
        ("hydra/launcher=3", "hydra/launcher=3: hetero has no hydra settings (Hydra only composes its config); your "
                             "own config files go in a directory passed with --config-dir DIR"),
        ("hydra.sweeper.params={a:1}", "hydra.sweeper.params={a:1}: hetero has no hydra settings"),
        ("model@x=tiny", "model@x=tiny: hetero's config groups have fixed places; drop '@x' and write model=..."),
    ],
)
def test_malformed_overrides_are_one_line_errors(override: str, expected: str) -> None:
    # Hydra's grammar reads most of these and its composer then fails with a bare ValueError (a traceback).
    assert str(_error(["model=tiny", override])).startswith(expected)


def test_a_malformed_override_on_the_command_line_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from hetero import cli

    assert cli.main(["compile", "~train=3", "output=never-written"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hetero: error: ~train=3: ~train removes the train group") and err.count("\n") == 1, err
    assert not Path("never-written").exists()


def test_missing_link_and_unknown_fleet_key(tmp_path: Path) -> None:
    two = ("hosts:\n  - name: a\n    address: 10.0.0.1\n    devices: [rtx3090]\n  - name: b\n    address: 10.0.0.2\n"
           "    devices: [rtx4090]\n")
    _write(tmp_path / "hardware" / "nolink.yaml", two)
    assert "no link between hosts 'a' and 'b'" in str(_error(["hardware=nolink"], tmp_path))
    # Without addresses, several hosts would all be 127.0.0.1: refused at compile, not found out at run time.
    _write(tmp_path / "hardware" / "noaddress.yaml", two.replace("    address: 10.0.0.2\n", ""))
    assert str(_error(["hardware=noaddress"], tmp_path)) == (
        "hardware.hosts[1] ('b'): a fleet of 2 hosts needs every host's address (where the others reach it, e.g. "
        "address: 192.168.1.20); 1 host(s) have none (b). Hosts on one machine for a test: address: 127.0.0.1")
    _write(
        tmp_path / "hardware" / "extra.yaml", "hosts:\n  - name: a\n    devices: [{type: rtx3090, vram: 3}]\n"
    )
    assert "unknown key(s) ['vram']" in str(_error(["hardware=extra"], tmp_path))


def test_manual_split_must_cover_the_layers() -> None:
    message = str(_error(["model=llama8b", "hardware=homelab", "planner.split=[10,10]"]))
    assert (
        message
        == "planner.split [10, 10] covers 20 decoder layers but llama8b has 32; make the counts add up to 32"
    )
    assert "unknown device" in str(_error(["hardware=homelab", "planner.devices=[desktop.gpu0]"]))
    ok = load(
        [
            "model=llama8b",
            "hardware=homelab",
            "planner.split=[20,12]",
            "planner.devices=[strix.strix_halo0,desktop.rtx5090_0]",
        ]
    )
    assert ok.planner.split == [20, 12]


def test_hf_model_resolves_its_architecture(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "model.pretrained is required" in str(_error(["model=hf"]))
    seen = []

    def fake_resolve(architecture: dict | None, pretrained: str) -> dict:
        seen.append((architecture, pretrained))
        return {"model_type": "qwen2", "num_hidden_layers": 24}

    monkeypatch.setattr(config_mod, "resolve_architecture", fake_resolve)
    cfg = load(["model=hf", "model.pretrained=Qwen/Qwen2-0.5B"])
    assert seen == [(None, "Qwen/Qwen2-0.5B")]
    assert cfg.model.name == "Qwen2-0.5B" and cfg.model.model_type == "qwen2"
    assert cfg.raw["model"]["architecture"]["num_hidden_layers"] == 24


def test_model_file_architecture_must_agree_with_local_weights(tmp_path: Path) -> None:
    """A declared architecture that contradicts the named weights' config.json is an error, not a silent choice."""
    weights = tmp_path / "weights"
    weights.mkdir()
    arch = dict(load(["model=tiny"]).model.architecture)
    (weights / "config.json").write_text(json.dumps(arch))
    agreed = load(["model=tiny", f"model.pretrained={weights}"])
    assert agreed.model.architecture["hidden_size"] == arch["hidden_size"]
    err = _error(["model=tiny", f"model.pretrained={weights}", "model.architecture.hidden_size=128"])
    assert "hidden_size: declared 128, config.json 64" in str(err) and "\n" not in str(err)
    # Weights not on this machine: compile works from the declared architecture (no download, ever).
    assert load(["model=llama8b"]).model.architecture["hidden_size"] == 4096


def test_build_cluster_rejects_duplicate_names_and_bad_numbers() -> None:
    with pytest.raises(ConfigError, match="used twice"):
        build_cluster(
            {
                "hosts": [
                    {"name": "a", "devices": [{"type": "cpu", "name": "x"}, {"type": "cpu", "name": "x"}]}
                ]
            }
        )
    with pytest.raises(ConfigError, match=r"memory_gb must be positive, got -1"):
        build_cluster({"hosts": [{"name": "a", "devices": [{"type": "cpu", "memory_gb": -1}]}]})


def test_wheel_ships_conf_and_hardware_specs(tmp_path: Path) -> None:
    # A non-editable install must find conf/ and hardware_specs/ as package data.
    root = Path(__file__).parents[2]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(root), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    wheel = next(tmp_path.glob("hetero-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in ("hetero/conf/config.yaml", "hetero/conf/model/llama8b.yaml", "hetero/conf/hardware/homelab.yaml",
                     "hetero/hardware_specs/rtx5090.yaml", "hetero/hardware_specs/strix_halo.yaml"):  # fmt: skip
        assert required in names


def test_seq_len_past_the_models_positions_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"model.seq_len=512 is longer than the model's max_position_embeddings=256 "
                                          r"\(its config.json\): set model.seq_len=256 or less"):
        config_mod.load(["model=tiny", "model.seq_len=512"])
    assert load(["model=tiny", "model.seq_len=256"]).model.seq_len == 256


def test_the_composed_config_is_frozen_once() -> None:
    # Built and validated once at the edge: nothing downstream may patch a spec (a change is a replace).
    import dataclasses

    cfg = load(["model=tiny", "hardware=local", "lora.r=4"])
    assert cfg.model.lora.r == 4  # the lora section reaches the model spec through its one construction
    for obj, name, value in [(cfg, "output", Path("x")), (cfg.model, "lora", None), (cfg.model.lora, "r", 2),
                             (cfg.cluster, "intra_host_latency_us", 1.0), (cfg.cluster.hosts[0], "devices", []),
                             (cfg.cluster.devices[0], "threads", 3), (cfg.train, "lr", 1.0)]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, value)


def test_real_model_presets_train_with_real_run_defaults() -> None:
    """The tiny demo trains fast at lr 1e-3; a real model's preset gets LoRA/QLoRA's own defaults (warmup, cosine,
    the QLoRA paper's rates) rather than the demo's."""
    tiny = load([]).train
    assert (tiny.lr, tiny.scheduler, tiny.warmup_steps) == (1e-3, "constant", 0)
    for model, lr in [("llama8b", 2e-4), ("qwen3_8b", 2e-4), ("phi4", 2e-4), ("llama70b", 1e-4),
                      ("mixtral_8x7b", 1e-4)]:
        train = load([f"model={model}"]).train
        assert (train.lr, train.scheduler, train.warmup_steps) == (lr, "cosine", 10), model
    assert load(["model=llama8b", "train.lr=5e-5"]).train.lr == 5e-5  # still the user's to change


def test_an_override_key_thousands_of_characters_long_is_one_line() -> None:
    """Hydra looked such a key up as a config group on disk and died with `File name too long`."""
    message = str(_error(["a" * 5000 + "=1"]))
    assert message.endswith(": no key of hetero is 5,000 characters long; `hetero compile --help` lists them")
    assert len(message) < 200
