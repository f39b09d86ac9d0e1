"""What a host runs: recorded in every run directory so mixed fleets can be compared and debugged.

Hosts in one fleet differ on purpose (driver, CUDA or ROCm, even torch version); a run records
each host's stack so a slow or failing stage can be traced to its software.
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
import sys
from importlib import metadata
from typing import Any

import torch

from hetero.cores import usable_cores

_SMI_TIMEOUT_S = 5.0
_PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "pyzmq", "msgpack", "safetensors", "hetero")


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _run_tool(argv: list[str]) -> str | None:
    """First line-ish output of a vendor tool, or None when absent, failing or hanging."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=_SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    text = out.stdout.strip()
    return text if out.returncode == 0 and text else None


def _driver() -> dict[str, Any]:
    """GPU driver versions as the vendor tools report them (a hung driver must not hang the run)."""
    info: dict[str, Any] = {}
    nvidia = _run_tool(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if nvidia:
        info["nvidia"] = sorted(set(nvidia.splitlines()))[0].strip()
    rocm = _run_tool(["rocm-smi", "--showdriverversion"])
    if rocm:
        lines = [ln.strip() for ln in rocm.splitlines() if "version" in ln.lower()]
        info["rocm"] = lines[0] if lines else rocm.splitlines()[0].strip()
    return info


def _devices(device: str | None) -> list[dict[str, Any]]:
    if not torch.cuda.is_available():  # ROCm builds answer through torch.cuda too
        return []
    indices = range(torch.cuda.device_count())
    if device is not None and device.startswith(("cuda", "hip")) and ":" in device:
        indices = [int(device.split(":", 1)[1])]  # type: ignore[assignment]
    out = []
    for i in indices:
        props = torch.cuda.get_device_properties(i)
        out.append({
            "index": i,
            "name": props.name,
            "memory_bytes": int(props.total_memory),
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": int(props.multi_processor_count),
            "arch": getattr(props, "gcnArchName", None),
        })
    return out


def _mps() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def describe_environment(device: str | None = None) -> dict[str, Any]:
    """Hostname, OS, Python, torch/CUDA/HIP, driver, devices and key package versions (JSON-serializable).

    ``device`` (e.g. ``"cuda:1"``) narrows the device list to the one a stage runs on.
    """
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": sys.version.split()[0],
        "pid": os.getpid(),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable_cores(),  # a container's CPU quota or affinity mask (hetero/cores.py)
        "device": device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cuda_available": torch.cuda.is_available(),
        "mps_available": _mps(),
        "driver": _driver(),
        "devices": _devices(device),
        "packages": {name: _package_version(name) for name in _PACKAGES},
    }
