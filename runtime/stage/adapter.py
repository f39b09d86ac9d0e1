"""PEFT adapter directories: write the trained LoRA weights as one standard adapter, read one back.

Stages hold LoRA weights under whole-model PEFT keys (``get_peft_model_state_dict`` of the full
model, e.g. ``base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight``), so the adapter of
the whole pipeline is the union of the stages' states, and a stage starting from ``lora.init_from``
takes the keys of its own layers with ``select``.
"""

from __future__ import annotations

import errno
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from hetero.errors import CheckpointError
from hetero.runtime.base.rundir import RunDirError, latest_checkpoint, staging_dir, write_bytes
from hetero.specs import LoraSpec

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_LORA_PARTS = (".lora_A.weight", ".lora_B.weight")


def _split_key(key: str) -> tuple[str, str]:
    """``...q_proj.lora_A.weight`` -> (``...q_proj``, ``A``); other keys are not LoRA weights."""
    for part in _LORA_PARTS:
        if key.endswith(part):
            return key[: -len(part)], part[6]
    raise CheckpointError(f"adapter tensor '{key}' is not a LoRA A/B weight (expected '*.lora_A.weight' / '*.lora_B.weight')")


def _check_state(state: dict[str, torch.Tensor], r: int, target_modules: Iterable[str], where: str) -> None:
    """Every module has both A [r, in] and B [out, r], and is one of the target modules."""
    targets = set(target_modules)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        if not key.startswith(PEFT_PREFIX):
            raise CheckpointError(f"{where}: tensor '{key}' is not in PEFT key space (must start with '{PEFT_PREFIX}')")
        module, part = _split_key(key)
        modules.setdefault(module, {})[part] = tensor
    if not modules:
        raise CheckpointError(f"{where}: no LoRA tensors")
    for module, parts in sorted(modules.items()):
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in targets:
            raise CheckpointError(
                f"{where}: LoRA on '{leaf}' ({module}) but lora.target_modules is {sorted(targets)}; "
                "use the target_modules the adapter was trained with"
            )
        if set(parts) != {"A", "B"}:
            raise CheckpointError(f"{where}: module '{module}' has lora_{next(iter(parts))} without its pair")
        a, b = parts["A"], parts["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise CheckpointError(
                f"{where}: '{module}' has LoRA shapes A{tuple(a.shape)} B{tuple(b.shape)}, not rank {r}; "
                "set lora.r to the adapter's rank"
            )


def adapter_config(lora: LoraSpec, base_model: str) -> dict[str, Any]:
    """The adapter_config.json of a plain LoRA adapter, as peft's LoraConfig reads it (a key it does not
    find takes peft's default). Written without importing peft: that import costs seconds of CPU at the
    end of every run."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.r,
        # peft types alpha as int and standard adapters store 16, not 16.0; a fractional alpha still works.
        "lora_alpha": int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(lora.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def save_adapter(state: dict[str, torch.Tensor], lora: LoraSpec, base_model: str, out_dir: Path) -> None:
    """Write ``state`` (whole-model PEFT keys) as a standard PEFT LoRA adapter directory, whole or not at all.

    The files go to a hidden sibling that is flushed and renamed onto ``out_dir``; a full or read-only
    disk raises RunDirError (one line) and leaves no partial adapter behind.
    """
    from safetensors.torch import save

    out_dir = Path(out_dir)
    _check_state(state, lora.r, lora.target_modules, f"adapter for {out_dir}")
    # Contiguous CPU copies: stage tensors may be views on an accelerator, safetensors wants neither.
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in sorted(state.items())}
    config = json.dumps(adapter_config(lora, base_model), indent=2, sort_keys=True) + "\n"
    try:
        with staging_dir(out_dir) as tmp:
            write_bytes(tmp / ADAPTER_CONFIG, config.encode())
            write_bytes(tmp / ADAPTER_WEIGHTS, save(tensors, metadata={"format": "pt"}))
    except OSError as exc:
        raise _adapter_write_failure(exc, out_dir) from None


def _adapter_write_failure(exc: OSError, out_dir: Path) -> RunDirError:
    reason = exc.strerror or type(exc).__name__
    fix = "free space" if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else f"make {out_dir.parent} writable"
    last = latest_checkpoint(out_dir.parent)
    kept = f"; the same LoRA weights are in the final checkpoint {last}" if last is not None else ""
    return RunDirError(f"cannot write the adapter to {out_dir} ({reason}): {fix}{kept}")


def read_adapter_config(adapter_dir: Path) -> dict[str, Any]:
    """The adapter's adapter_config.json as a dict (validated to be a LoRA config)."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not path.is_file():
        raise CheckpointError(f"lora.init_from '{adapter_dir}': no {ADAPTER_CONFIG}; point it at a PEFT adapter directory")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc.msg})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {str(exc)[:160]})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA" or "r" not in config:
        raise CheckpointError(f"{path}: not a LoRA adapter config (needs peft_type LORA and r)")
    r, alpha = config["r"], config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1 or (
            alpha is not None and (not isinstance(alpha, (int, float)) or isinstance(alpha, bool))):
        raise CheckpointError(f"{path}: r must be a positive integer and lora_alpha a number (got r={r!r}, "
                              f"lora_alpha={alpha!r})")
    return config


def _config_targets(config: dict[str, Any], where: Path) -> set[str]:
    targets = config.get("target_modules")
    if isinstance(targets, str):
        # PEFT allows a regex here; hetero plans name modules, so only an exact list can be compared.
        raise CheckpointError(f"{where}: target_modules is a regex ('{targets}'); hetero needs an explicit list")
    if targets is not None and (not isinstance(targets, list) or not all(isinstance(t, str) for t in targets)):
        raise CheckpointError(f"{where}: target_modules must be a list of module names, got {targets!r}"[:300])
    return set(targets or [])


def load_adapter_state(adapter_dir: Path, lora: LoraSpec | None = None) -> dict[str, torch.Tensor]:
    """Read an adapter's LoRA tensors (whole-model PEFT keys); with ``lora``, check it matches the plan."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise CheckpointError(f"lora.init_from '{adapter_dir}': no such directory")
    config = read_adapter_config(adapter_dir)
    weights = adapter_dir / ADAPTER_WEIGHTS
    if not weights.is_file():
        hint = " (adapter_model.bin is a torch.save file, which hetero never loads: re-save with safetensors)" if (
            adapter_dir / "adapter_model.bin"
        ).exists() else ""
        raise CheckpointError(f"lora.init_from '{adapter_dir}': no {ADAPTER_WEIGHTS}{hint}")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as exc:
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise CheckpointError(f"{weights}: unreadable safetensors file, truncated or corrupt ({detail})") from None
    targets = _config_targets(config, adapter_dir / ADAPTER_CONFIG)
    where = f"lora.init_from '{adapter_dir}'"
    if lora is not None:
        if int(config["r"]) != lora.r:
            raise CheckpointError(f"{where}: adapter has r={config['r']} but the plan has lora.r={lora.r}")
        if targets != set(lora.target_modules):
            raise CheckpointError(
                f"{where}: adapter targets {sorted(targets)} but the plan has lora.target_modules "
                f"{sorted(lora.target_modules)}"
            )
        alpha = config.get("lora_alpha")
        if alpha is not None and float(alpha) != float(lora.alpha):
            raise CheckpointError(f"{where}: adapter has lora_alpha={alpha} but the plan has lora.alpha={lora.alpha}")
    _check_state(state, int(config["r"]), targets, where)
    return state


def select(state: dict[str, torch.Tensor], prefixes: Iterable[str]) -> dict[str, torch.Tensor]:
    """The entries of ``state`` whose key starts with one of ``prefixes`` (e.g. one stage's layers)."""
    wanted = tuple(prefixes)
    return {k: v for k, v in state.items() if k.startswith(wanted)}


def layer_prefix(layer: int) -> str:
    """PEFT key prefix of decoder layer ``layer`` (Llama-style ``model.layers.N``), for ``select``."""
    return f"{PEFT_PREFIX}model.layers.{layer}."
