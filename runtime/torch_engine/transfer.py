"""What the torch engine's ranks exchange besides activations: the step's batch, and stage state as bytes.

The ranks of a multi-host run share no file system, so nothing here goes through files. Global rank 0 reads
the data and broadcasts each step's batch (a few int64 tensors); a checkpoint's stage state travels to rank 0
(and, on `--resume`, from it) as safetensors bytes in a uint8 tensor, with the stage's JSON metadata in the
safetensors header. No Python object is ever rebuilt from bytes: torch.distributed's object collectives
are not used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

META = "hetero_meta"  # the safetensors metadata key holding a payload's JSON metadata


def send_bytes(data: bytes, dst: int) -> None:
    """Send ``data`` to rank ``dst``: its length, then its bytes (``recv_bytes`` there)."""
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst)


def recv_bytes(src: int) -> bytes:
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src)
    if int(size) == 0:
        return b""
    buf = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(buf, src)
    return buf.numpy().tobytes()


def pack_payload(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> bytes:
    """A stage payload (named CPU tensors + JSON-able metadata) as safetensors bytes."""
    from safetensors.torch import save

    return save({n: t.detach().to("cpu").contiguous().clone() for n, t in tensors.items()},
                metadata={META: json.dumps(meta)})


def unpack_payload(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors.torch import load

    tensors = load(data)
    # safetensors' loaders return no metadata from bytes: it is the JSON header after the 8-byte length.
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + header_len])
    return tensors, json.loads(header["__metadata__"][META])


@dataclass
class SharedBatch:
    """A step's batch as every rank holds it after ``broadcast_batch`` (StepBatch's fields the engine reads)."""

    input_ids: torch.Tensor  # int64 [M, B, S]
    labels: torch.Tensor  # int64 [M, B, S]
    num_label_tokens: int


def broadcast_batch(batch: Any, shape: tuple[int, int, int]) -> SharedBatch:
    """Rank 0's ``batch`` (a StepBatch; None on other ranks) on every rank, from one broadcast."""
    m, b, s = shape
    both = torch.empty(2 * m * b * s + 1, dtype=torch.int64)
    if batch is not None:
        both[:m * b * s] = batch.input_ids.reshape(-1)
        both[m * b * s:-1] = batch.labels.reshape(-1)
        both[-1] = int(batch.num_label_tokens)
    dist.broadcast(both, 0)
    return SharedBatch(both[:m * b * s].view(m, b, s), both[m * b * s:-1].view(m, b, s), int(both[-1]))


def broadcast_bytes(data: bytes | None) -> bytes:
    """Rank 0's ``data`` on every rank (other ranks pass None): a length, then the bytes."""
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, 0)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
           else torch.empty(int(size), dtype=torch.uint8))
    if int(size):
        dist.broadcast(buf, 0)
    return buf.numpy().tobytes()


def shared_settings(plan: Any) -> Any:
    """``plan`` with rank 0's training settings (the run's overrides: a host elsewhere holds the compiled plan)."""
    from dataclasses import replace

    from hetero.errors import PlanError
    from hetero.serde import from_dict, to_dict
    from hetero.specs import TrainSpec

    mine = json.dumps({"input_hash": plan.input_hash, "train": to_dict(plan.train)}).encode()
    theirs = json.loads(broadcast_bytes(mine if dist.get_rank() == 0 else None))
    if theirs["input_hash"] != plan.input_hash:
        raise PlanError(f"this host's plan has input hash {plan.input_hash}, rank 0's {theirs['input_hash']}: copy the "
                        "plan rank 0 runs to every host")
    return replace(plan, train=from_dict(TrainSpec, theirs["train"], "train", PlanError))
