"""The torch device a plan's device is on this host: the runtime's one resolver (stages, evaluator, profiler)."""

from __future__ import annotations

import torch

from hetero.errors import PlanError


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
