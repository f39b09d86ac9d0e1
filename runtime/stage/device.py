"""The torch device a plan's device is on this host: the runtime's one resolver (stages, evaluator, profiler)."""

from __future__ import annotations

import os
import re

import torch

from hetero.errors import PlanError
from hetero.specs import DeviceSpec


def torch_device(backend: str, index: int, what: str) -> torch.device:
    """The torch device for ``backend`` device ``index``; ``what`` names it in the one-line PlanError
    (e.g. "stage 1 runs on box.rtx0"). ROCm builds of torch also call their GPUs 'cuda'."""
    if backend == "cpu":
        return torch.device("cpu")
    if backend in ("cuda", "rocm"):
        if not torch.cuda.is_available():
            raise PlanError(f"{what} ({backend}) but this torch sees no GPU here")
        return torch.device("cuda", index)
    if backend == "mps":
        return torch.device("mps")
    raise PlanError(f"{what}: unknown backend '{backend}'")


# A card in a tower is the one its fleet entry's `index:` names in nvidia-smi's order (PCI bus order); CUDA's own
# default numbers the fastest first, so with two cards the 3090's stage could land on the 10 GB 3080. Every hetero
# process that may touch CUDA sets this before CUDA starts (it is read once, at CUDA's first call).
os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
MEMORY_SHORT = 0.9  # a card with less than this share of its declared memory is not the declared card


def card_problem(device: DeviceSpec) -> str | None:
    """Why this box's ``device.index`` is not the card the fleet declares (no such card, another model, less
    memory, a torch build without kernels for it), with the fix; None where it is (and for CPU devices)."""
    where = f"{device.name} (index: {device.index} in the fleet file, declared {device.display_name})"
    if device.backend == "cpu":
        return None
    if device.backend == "mps":
        return None if torch.backends.mps.is_available() else f"{where}: this box's torch has no MPS device"
    build = f"torch {torch.__version__}" + (f" (CUDA {torch.version.cuda})" if torch.version.cuda else
                                            f" (ROCm {torch.version.hip})" if torch.version.hip else ", a CPU-only build")
    if not torch.cuda.is_available():
        return (f"{where}: {build} sees no GPU on this box: install the torch build for this card "
                "(pytorch.org's selector: CUDA for NVIDIA, ROCm for AMD) and check the driver (nvidia-smi / rocm-smi)")
    count = torch.cuda.device_count()
    if device.index >= count:
        return (f"{where}: this box has {count} GPU(s) (cuda:0..{count - 1} in nvidia-smi's order): fix index: in "
                "the fleet file")
    name = torch.cuda.get_device_name(device.index)
    total_gb = torch.cuda.get_device_properties(device.index).total_memory / 1e9
    model = _model_number(device.display_name) or _model_number(device.type)
    # NVIDIA's names are the datasheet's; an AMD APU's GPU (Strix Halo) is named and sized by its BIOS setting.
    other_model = device.backend == "cuda" and model is not None and model not in name.upper().replace(" ", "")
    if other_model or (device.backend == "cuda" and total_gb < MEMORY_SHORT * device.memory_gb):
        return (f"{where}: cuda:{device.index} on this box is a {name} with {total_gb:.1f} GB: set index: in the fleet "
                "file to the card's position in nvidia-smi's list, or declare the card it is")
    major, minor = torch.cuda.get_device_capability(device.index)
    arch = torch.cuda.get_arch_list() if torch.version.cuda else []
    cc = major * 10 + minor
    if arch and f"sm_{cc}" not in arch and not any(a.startswith("compute_") and int(a[8:]) <= cc for a in arch
                                                   if a[8:].isdigit()):
        return (f"{where}: {build} has no kernels for the {name} (sm_{cc}; it has {', '.join(arch)}): install a torch "
                "build whose CUDA still supports this card (Volta and Pascal: CUDA 12.x builds)")
    return None


def _model_number(text: str) -> str | None:
    """The model token of a card's name (``3090``, ``V100``, ``4060``), to tell one card from another."""
    match = re.search(r"\b([A-Z]?\d{3,4})\b", text.upper().replace("_", " "))
    return match.group(1) if match else None
