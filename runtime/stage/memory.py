"""What a forward really leaves in memory for its backward, on any device (CPU included).

``kept_bytes`` runs a forward under a dispatch mode that notes every storage an op creates and
holds only a weak reference to it; after the forward, the storages still alive (less the outputs)
are what autograd keeps for backward: tensors saved by ops, by custom autograd functions that
keep them outside ``save_for_backward`` (bitsandbytes), and the inputs a recomputing
(checkpointed) layer holds. Saved-tensor hooks alone miss the last two. Each storage counts once,
however many tensors view it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _Created(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                self.storages[ref.cdata] = (ref, storage.nbytes())
        return out


def kept_bytes(forward: Callable[[], Any]) -> int:
    """Bytes of the storages ``forward`` created that are still alive after it returns, less those
    of what it returned: what its autograd graph keeps until backward."""
    mode = _Created()
    with mode:
        out = forward()
    outputs = {StorageWeakRef(t.untyped_storage()).cdata for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
    kept = sum(n for key, (ref, n) in mode.storages.items() if key not in outputs and not ref.expired())
    del out
    return kept
