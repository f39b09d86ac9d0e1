"""`hetero export RUN_DIR|ADAPTER_DIR --out DIR`: merge a LoRA adapter into its base model for serving.

The base is loaded on CPU in full precision (never quantized: a QLoRA adapter merges into the bf16 /
fp32 base), the adapter is applied and folded in with peft's ``merge_and_unload()``, and the result
is written with ``save_pretrained(safe_serialization=True)`` plus the base's tokenizer, so
``AutoModelForCausalLM.from_pretrained(DIR)`` serves it without peft. Before loading anything the
command checks the host's memory and the free disk of ``--out``; a refusal writes nothing.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetero.errors import CheckpointError, HeteroError
from hetero.runtime.base.rundir import nearest_existing, staging_dir
from hetero.runtime.stage.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapter_config

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
GB = 1e9
# Working room beyond the tensors: the tokenizer, safetensors headers, allocator slack while shards
# are written. The interpreter and libraries are already loaded when MemAvailable is read.
MARGIN_BYTES = 256 * 2**20
_LORA_KEY = re.compile(r"(.*)\.lora_(?:embedding_)?([AB])(?:\.weight)?")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


class ExportError(HeteroError):
    """`hetero export` cannot or will not write the merged model (memory, disk, --out, the base)."""


@dataclass(frozen=True)
class MergeCost:
    """What merging needs, in bytes, from the base's config and the adapter's tensor shapes."""

    parameters: int  # the base model's parameter count
    dtype: str
    adapter_bytes: int  # LoRA tensors as peft holds them on CPU (fp32)
    delta_bytes: int  # the largest module's B @ A, fp32 plus its cast to dtype: one alive at a time
    extra_files_bytes: int  # tokenizer, config and other non-weight files copied beside the weights

    @property
    def weight_bytes(self) -> int:
        return self.parameters * DTYPE_BYTES[self.dtype]

    @property
    def memory_bytes(self) -> int:
        # peft merges module by module in place: the base, the adapter, and one module's delta.
        return self.weight_bytes + self.adapter_bytes + self.delta_bytes + MARGIN_BYTES

    @property
    def disk_bytes(self) -> int:
        return self.weight_bytes + self.extra_files_bytes


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo"),
                           cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Memory this process can still take: MemAvailable, capped by a cgroup v2 limit (containers);
    None where /proc/meminfo does not exist (not Linux)."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    match = re.search(r"^MemAvailable:\s+(\d+)\s*kB", text, re.MULTILINE)
    if match is None:
        return None
    available = int(match.group(1)) * 1024
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        used = (cgroup / "memory.current").read_text().strip()
    except OSError:
        return available
    if limit.isdigit() and used.isdigit():
        available = min(available, max(int(limit) - int(used), 0))
    return available


def human(size: int) -> str:
    """``16.1 GB`` / ``340 MB``: the unit a reader compares with ``free -h`` and ``df -h``."""
    return f"{size / GB:.1f} GB" if size >= GB / 10 else f"{size / 1e6:.3g} MB"


def free_disk_bytes(path: Path) -> int:
    """Free bytes on the filesystem where ``path`` is or would be created."""
    return shutil.disk_usage(nearest_existing(path)).free


def find_adapter(source: Path) -> Path:
    """``source`` itself if it is an adapter directory, else ``source/adapter`` of a run directory."""
    if (source / ADAPTER_CONFIG).is_file():
        return source
    if (source / "adapter" / ADAPTER_CONFIG).is_file():
        return source / "adapter"
    if (source / "plan.json").is_file():
        raise CheckpointError(f"{source}: no trained adapter ({source / 'adapter' / ADAPTER_CONFIG}); "
                              "did the run finish?")
    raise CheckpointError(f"{source}: neither an adapter directory ({ADAPTER_CONFIG}) nor a run directory "
                          "(adapter/): pass RUN_DIR or RUN_DIR/adapter")


def resolve_base(base: str) -> Path:
    """The local directory of an adapter's ``base_model_name_or_path`` (a directory or a cached hub id)."""
    from hetero.errors import ConfigError
    from hetero.runtime.pretrained import resolve_dir
    from hetero.specs import ModelSpec

    try:
        return resolve_dir(ModelSpec(name=base, architecture={}, pretrained=base))
    except ConfigError as exc:
        raise CheckpointError(f"the adapter's base model: {exc}") from None


def _model_name(adapter: Path, base: str) -> str:
    """The run's model name when the adapter sits in a run directory, else the base's own name."""
    try:
        name = json.loads((adapter.parent / "plan.json").read_text())["model"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        name = None
    return name if isinstance(name, str) and name else Path(base).name or base


def _base_config(base_dir: Path) -> dict[str, Any]:
    try:
        config = json.loads((base_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{base_dir / 'config.json'}: unreadable ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{base_dir / 'config.json'}: not a model config")
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "quantized")
        raise ExportError(f"base model {base_dir} is stored {method}-quantized: a merge needs the "
                          "full-precision weights; point the adapter's base_model_name_or_path at the "
                          "unquantized model")
    return config


def default_dtype(config: dict[str, Any]) -> str:
    """The base model's own dtype (config.json ``dtype`` / ``torch_dtype``), else float32."""
    stored = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    return stored if stored in DTYPE_BYTES else "float32"


def count_parameters(base_dir: Path) -> int:
    """The base model's parameter count, from its config on the meta device (no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(base_dir))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"{base_dir}: transformers cannot build the model from its config.json ({exc})"
                              ) from None
    return sum(p.numel() for p in model.parameters())  # tied embeddings are one parameter


def adapter_sizes(adapter: Path) -> tuple[int, int]:
    """(numel of all adapter tensors, numel of the largest module's B @ A), from the safetensors header."""
    from safetensors import SafetensorError, safe_open

    weights = adapter / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"{adapter}: no {ADAPTER_WEIGHTS} (hetero loads safetensors adapters only)")
    shapes: dict[str, list[int]] = {}
    try:
        with safe_open(str(weights), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                shapes[name] = list(f.get_slice(name).get_shape())
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{weights}: unreadable safetensors file ({str(exc).strip()[:160]})") from None
    total = sum(_numel(s) for s in shapes.values())
    pairs: dict[str, dict[str, list[int]]] = {}
    for name, shape in shapes.items():
        match = _LORA_KEY.fullmatch(name)
        if match and len(shape) == 2:
            pairs.setdefault(match.group(1), {})[match.group(2)] = shape
    # A is [r, in], B is [out, r]: the delta is [out, in].
    largest = max((p["B"][0] * p["A"][1] for p in pairs.values() if set(p) == {"A", "B"}), default=0)
    return total, largest


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def merge_cost(base_dir: Path, adapter: Path, dtype: str) -> MergeCost:
    """Bytes of memory and disk a merge of ``adapter`` into ``base_dir`` in ``dtype`` needs."""
    adapter_numel, delta_numel = adapter_sizes(adapter)
    extra = sum(p.stat().st_size for p in base_dir.iterdir()
                if p.is_file() and not p.name.endswith((*_WEIGHT_SUFFIXES, ".index.json")))
    return MergeCost(parameters=count_parameters(base_dir), dtype=dtype, adapter_bytes=adapter_numel * 4,
                     delta_bytes=delta_numel * (4 + DTYPE_BYTES[dtype]), extra_files_bytes=extra)


def check_resources(cost: MergeCost, name: str, out: Path, say: Any) -> None:
    """Refuse (one line, with the numbers) when this host lacks the memory or --out's disk the space."""
    available = available_memory_bytes()
    if available is None:
        say(f"note: cannot read this host's available memory (no /proc/meminfo); the merge needs "
            f"~{human(cost.memory_bytes)}, not checked")
    elif cost.memory_bytes > available:
        raise ExportError(
            f"merging {name} in {cost.dtype} needs ~{human(cost.memory_bytes)} of memory, this host "
            f"has {human(available)} available: run `hetero export` on a host with more memory, or "
            "serve the adapter with the base model (AutoPeftModelForCausalLM)")
    free = free_disk_bytes(out)
    if cost.disk_bytes > free:
        raise ExportError(
            f"the merged {name} in {cost.dtype} needs ~{human(cost.disk_bytes)} of disk, "
            f"{nearest_existing(out)} has {human(free)} free: free space or pass --out on another disk")
    memory = "not checked" if available is None else f"{human(available)} available"
    say(f"merging {name} ({cost.parameters / 1e6:.4g}M parameters) in {cost.dtype}: needs "
        f"~{human(cost.memory_bytes)} of memory ({memory}) and ~{human(cost.disk_bytes)} of disk "
        f"({human(free)} free)")


def check_out(out: Path, force: bool, inputs: list[Path]) -> None:
    """Refuse a file, a non-empty directory without --force, or a directory holding the inputs."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file: pass a directory")
    resolved = out.resolve()
    for path in inputs:
        if path.resolve() == resolved or resolved in path.resolve().parents:
            raise ExportError(f"--out {out} holds the adapter or base model it would replace: "
                              "pass another directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"--out {out} exists and is not empty: pass another directory, "
                          "or --force to replace it")


def merge_and_save(base_dir: Path, adapter: Path, dtype: str, out: Path, say: Any) -> None:
    """Load the base, merge the adapter, write ``out`` (safetensors + tokenizer) whole or not at all."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    say(f"loading the base model {base_dir} in {dtype} on CPU")
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the status lines say where it is; bars would clutter a log
    try:
        # No quantization_config: a QLoRA adapter's base loads in full precision here.
        base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=getattr(torch, dtype))
        say(f"applying and merging the adapter {adapter}")
        merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
        _write(merged, base_dir, out, say)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _write(merged: Any, base_dir: Path, out: Path, say: Any) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    except (OSError, ValueError) as exc:
        say(f"note: no tokenizer in {base_dir} ({str(exc).splitlines()[0][:120]}); copy one into {out}")
        tokenizer = None
    say(f"writing safetensors to {out}")
    try:
        with staging_dir(out) as tmp:
            merged.save_pretrained(str(tmp), safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp))
            _readable_by_all(tmp)
    except OSError as exc:
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        fix = "free space" if full else f"make {out.parent} writable"
        raise ExportError(f"cannot write the merged model to {out} ({exc.strerror or exc}): {fix}") from None


def _readable_by_all(directory: Path) -> None:
    """Give the files the umask's usual mode: safetensors writes 0600, which a model server running as
    another user (a container) cannot read."""
    mask = os.umask(0)
    os.umask(mask)
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~mask)


def export(source: Path, out: Path, dtype: str | None = None, force: bool = False, say: Any = None) -> Path:
    """Merge the adapter of ``source`` (a run or adapter directory) into its base; write ``out``."""
    say = say or (lambda line: print(f"hetero export: {line}", file=sys.stderr, flush=True))
    adapter = find_adapter(Path(source))
    config = read_adapter_config(adapter)
    base = config.get("base_model_name_or_path")
    if not isinstance(base, str) or not base:
        raise CheckpointError(f"{adapter / ADAPTER_CONFIG}: no base_model_name_or_path; "
                              "it names the model to merge into")
    base_dir = resolve_base(base)
    # Read (and checked: a pre-quantized base is refused) whether or not --dtype names the merged dtype.
    base_config = _base_config(base_dir)
    chosen = dtype or default_dtype(base_config)
    check_out(out, force, [adapter, base_dir])
    name = _model_name(adapter, base)
    cost = merge_cost(base_dir, adapter, chosen)
    check_resources(cost, name, out, say)
    merge_and_save(base_dir, adapter, chosen, out, say)
    return out


def main_export(argv: list[str]) -> int:
    """`hetero export RUN_DIR|ADAPTER_DIR --out DIR [--dtype D] [--force]`."""
    ap = argparse.ArgumentParser(
        prog="hetero export",
        description="Merge a trained LoRA adapter into its base model and write a standalone model "
                    "(safetensors + tokenizer) that transformers serves without peft.")
    ap.add_argument("source", type=Path, metavar="RUN_DIR|ADAPTER_DIR",
                    help="a run directory (its adapter/ is used) or a PEFT adapter directory")
    ap.add_argument("--out", type=Path, required=True, help="directory to write the merged model to")
    ap.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default=None,
                    help="dtype of the merged weights (default: the base model's own, from its config.json)")
    ap.add_argument("--force", action="store_true", help="replace a non-empty --out")
    args = ap.parse_args(argv)
    out = export(args.source, args.out, args.dtype, args.force)
    where = repr(str(out))
    loader = (f"python -c \"from transformers import AutoModelForCausalLM, AutoTokenizer; "
              f"m = AutoModelForCausalLM.from_pretrained({where}); "
              f"t = AutoTokenizer.from_pretrained({where})\"")
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote {out} ({human(size)}); load it without peft:\n  {loader}")
    return 0
