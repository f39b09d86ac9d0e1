"""The wire format between stage processes: a msgpack header frame plus one raw frame per tensor.

Frame 0 is a msgpack map ``{v, plan, kind, sender, step, mb, meta, tensors: [{name, dtype, shape}]}``;
frames 1..n are the tensors' bytes in header order, little-endian as the CPU holds them. No Python object is
ever rebuilt from received bytes: a peer can only make us build tensors of an allowed dtype from bytes we count.

Every check on received frames raises a one-line ``WireError``; a bad message is rejected whole and
never half-applied.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack
import torch

from hetero.errors import WireError
from hetero.protocol import KINDS, MAX_HEADER_BYTES, PLAN_DTYPES, WIRE_DTYPES, WIRE_VERSION, Record

# KINDS (every kind hetero/protocol.py defines a record for) is all a process sends or decodes.
# Wire dtype names (hetero/protocol.py): stable strings, independent of the torch version on either host.
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in WIRE_DTYPES}
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
# The dtypes a stage computes in: the runtime's one map from plan.json's dtype names to torch.
TORCH_DTYPES: dict[str, torch.dtype] = {name: DTYPES[name] for name in PLAN_DTYPES}


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a stage computing in ``dtype`` sums its loss, holds its LoRA weights and sends their gradients in: float32
    (peft upcasts a half-precision adapter), or float64 in a float64 plan, which would lose its exactness in float32."""
    return torch.promote_types(dtype, torch.float32)

_HEADER_KEYS = ("v", "plan", "kind", "sender", "step", "mb", "meta", "tensors")
PLAN_HASH_SHOWN = 16  # a plan's input hash is 16 hex digits (hetero/plan.py); a peer's claim is clipped to it
_PLAN_MISMATCH = re.compile(r"peer (\S+) runs plan (\S+), this process runs ")
MAX_TENSOR_DIMS = 16
MAX_DIM = 1 << 40  # bounds a zero-size tensor's other dims, which torch cannot allocate beyond int64


@dataclass
class Message:
    """One message between stages: kind, routing fields, small metadata and named tensors."""

    kind: str
    sender: str
    step: int = 0
    mb: int = -1
    meta: dict[str, Any] = field(default_factory=dict)  # msgpack-able scalars/lists/dicts only
    # Received tensors are CPU tensors of their wire dtype, viewing the receive buffer (no copy).
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # A received message's meta as its kind's record (hetero/protocol.py), once the receiver's rules checked it
    # (runtime/wire/rules.py): what receivers read, by field (``record_of``).
    record: Record | None = field(default=None, repr=False, compare=False)

    def describe(self) -> str:
        """Short text form for logs and errors, e.g. ``'grad' step 3 mb 2 from stage2`` (a sender's name that is not
        printable text, a line break say, quoted: a log line stays one line whatever a peer claims)."""
        sender = self.sender if self.sender.isprintable() else repr(self.sender)
        return f"{self.kind!r} step {self.step} mb {self.mb} from {sender}"


R = TypeVar("R", bound=Record)


def record_of(msg: Any, cls: type[R]) -> R:
    """``msg``'s meta as the record ``cls``: the one its receiver's rules checked, or checked now (a message made by
    hand, or received without rules); a meta that is not one is a WireError naming the message."""
    record = getattr(msg, "record", None)
    if isinstance(record, cls):
        return record
    where = msg.describe() if isinstance(msg, Message) else f"a {cls.KIND!r} message"
    return cls.from_wire(msg.meta, where)


def _wire_bytes(name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """The tensor as a contiguous CPU tensor and a zero-copy byte view of its memory."""
    if not isinstance(tensor, torch.Tensor):
        raise WireError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.dtype not in _DTYPE_NAMES:
        raise WireError(
            f"tensor {name!r} has dtype {tensor.dtype}, which the wire does not carry "
            f"(allowed: {', '.join(DTYPES)}): cast it before sending"
        )
    # GPU tensors are copied to CPU here (the sender pays the device->host copy); CPU tensors that
    # are already contiguous are sent from their own memory.
    cpu = tensor.detach().to("cpu").contiguous()
    if cpu.numel() == 0:
        return cpu, memoryview(b"")
    # bf16/fp16 have no numpy dtype: view the same memory as bytes. reshape(-1) first because a
    # dtype view that changes the element size needs at least one dimension.
    raw = cpu.reshape(-1).view(torch.uint8).numpy()
    return cpu, raw.data  # ndarray.data: a memoryview of the same memory


def _check_meta(value: Any, path: str = "meta", depth: int = 0) -> None:
    """Meta holds plain data only (no msgpack extension types, no non-string keys)."""
    if depth > 32:
        raise WireError(f"{path} is nested more than 32 levels deep")
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_meta(item, f"{path}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise WireError(f"{path} has a non-string key {key!r}")
            _check_meta(item, f"{path}.{key}", depth + 1)
        return
    raise WireError(f"{path} holds a {type(value).__name__}; only None/bool/int/float/str/bytes/list/dict")


def encode(msg: Message, plan_hash: str) -> list[bytes | memoryview]:
    """Header frame plus one frame per tensor; tensor frames view the tensors' memory (no copy).

    The returned memoryviews keep the (CPU copies of the) tensors alive; the caller must not modify
    a sent tensor in place until ZeroMQ has sent it (the runtime never does: activations and
    gradients are fresh tensors).
    """
    if msg.kind not in KINDS:
        raise WireError(f"cannot send unknown message kind {msg.kind!r} (known: {', '.join(sorted(KINDS))})")
    _check_meta(msg.meta)
    specs: list[dict[str, Any]] = []
    frames: list[bytes | memoryview] = [b""]
    for name, tensor in msg.tensors.items():
        if not isinstance(name, str):
            raise WireError(f"tensor names must be strings, got {name!r}")
        cpu, view = _wire_bytes(name, tensor)
        specs.append({"name": name, "dtype": _DTYPE_NAMES[cpu.dtype], "shape": list(cpu.shape)})
        frames.append(view)
    header = {
        "v": WIRE_VERSION, "plan": plan_hash, "kind": msg.kind, "sender": msg.sender,
        "step": int(msg.step), "mb": int(msg.mb), "meta": msg.meta, "tensors": specs,
    }
    try:
        frames[0] = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireError(f"cannot encode {msg.describe()}: {exc}") from None
    return frames


def _frame_buffer(frame: Any) -> memoryview:
    """A byte view of a received frame (zmq.Frame from copy=False, or bytes)."""
    buf = getattr(frame, "buffer", frame)  # zmq.Frame exposes .buffer; bytes/memoryview are buffers
    try:
        view = memoryview(buf)
    except TypeError:
        raise WireError(f"a frame is a {type(frame).__name__}, not bytes") from None
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _unpack_header(raw: memoryview) -> dict[str, Any]:
    if len(raw) > MAX_HEADER_BYTES:
        raise WireError(f"message header is {len(raw)} bytes (max {MAX_HEADER_BYTES}): not a hetero peer")
    try:
        header = msgpack.unpackb(
            raw, raw=False, strict_map_key=True, use_list=True,
            ext_hook=_reject_ext,
        )
    except WireError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for garbage input
        raise WireError(f"message header is not valid msgpack ({type(exc).__name__}): not a hetero peer?") from None
    if not isinstance(header, dict):
        raise WireError(f"message header is a msgpack {type(header).__name__}, not a map: not a hetero peer?")
    return header


def _shown(value: Any, *, quote: bool = True, limit: int = 40) -> str:
    """A peer-supplied value made safe for a one-line error: repr-escaped and clipped."""
    text = repr(value)
    if not quote and isinstance(value, str):
        text = text[1:-1]  # repr escapes newlines and control characters; drop its quotes
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reject_ext(code: int, data: bytes) -> Any:
    raise WireError(f"message header holds msgpack extension type {code}: not allowed on the wire")


def _require(header: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = header.get(key)
    # bool is an int subclass; a bool where a number belongs is a malformed header too
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise WireError(f"message header field {key!r} must be {what}, got {type(value).__name__}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _tensor_from_frame(spec: Any, buf: memoryview, who: str) -> tuple[str, torch.Tensor]:
    if not isinstance(spec, dict):
        raise WireError(f"{who}: tensor entry is a {type(spec).__name__}, not a map")
    name, dtype_name, shape = spec.get("name"), spec.get("dtype"), spec.get("shape")
    if not isinstance(name, str):
        raise WireError(f"{who}: tensor name must be a string, got {type(name).__name__}")
    name_text = _shown(name)
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise WireError(f"{who}: tensor {name_text} has unknown dtype {_shown(dtype_name)} (allowed: {', '.join(DTYPES)})")
    if (not isinstance(shape, list) or len(shape) > MAX_TENSOR_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM for d in shape)):
        raise WireError(f"{who}: tensor {name_text} has a malformed shape {_shown(shape)}")
    dtype = DTYPES[dtype_name]
    itemsize = dtype.itemsize
    expected = math.prod(shape) * itemsize
    if len(buf) != expected:
        raise WireError(
            f"{who}: tensor {name_text} {dtype_name}{shape} needs {expected} bytes, its frame has {len(buf)}"
        )
    if expected == 0:
        return name, torch.empty(shape, dtype=dtype)
    if buf.readonly:
        # Received frames are writable; read-only buffers (bytes) come from tests or tools. The
        # tensor is documented as "do not write", so torch's one-time warning is noise here.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = torch.frombuffer(buf, dtype=torch.uint8)
    else:
        flat = torch.frombuffer(buf, dtype=torch.uint8)
    if flat.data_ptr() % itemsize:
        # Small ZeroMQ messages can start at any offset of a shared receive buffer; a misaligned
        # typed view is undefined for vectorised kernels, so copy (small tensors only in practice).
        flat = flat.clone()
    return name, flat.view(dtype).reshape(shape)


def plan_mismatch(why: str) -> tuple[str, str] | None:
    """(the sender it claims, its plan hash) when ``why`` is ``decode``'s drop of a message of another plan; else None."""
    match = _PLAN_MISMATCH.search(why)
    return (match.group(1), match.group(2)) if match else None


def decode(frames: Sequence[Any], expect_plan_hash: str | None) -> Message:
    """Validate and decode received frames into a Message; raises a one-line WireError when malformed."""
    if len(frames) == 0:
        raise WireError("empty message: not a hetero peer?")
    header = _unpack_header(_frame_buffer(frames[0]))
    missing = [k for k in _HEADER_KEYS if k not in header]
    version = header.get("v")
    sender = header.get("sender")
    who = f"message from {_shown(sender, quote=False)}" if isinstance(sender, str) else "message"
    if "v" in header and version != WIRE_VERSION:
        raise WireError(
            f"{who} uses wire version {_shown(version)}, this process uses {WIRE_VERSION}: "
            "install the same hetero version on every host"
        )
    if missing:
        raise WireError(f"{who} header lacks {', '.join(missing)}: not a hetero peer?")
    sender = _require(header, "sender", str, "a string")
    plan = _require(header, "plan", str, "a string")
    peer = _shown(sender, quote=False)
    if expect_plan_hash is not None and plan != expect_plan_hash:
        # Whole hashes (16 hex digits): the line must let a person tell the two plan.json files apart.
        raise WireError(
            f"peer {peer} runs plan {_shown(plan[:PLAN_HASH_SHOWN], quote=False)}, this process runs "
            f"{expect_plan_hash[:PLAN_HASH_SHOWN]}: every host must run the same plan.json (copy it, with its keys, "
            "to every host and restart)"
        )
    kind = _require(header, "kind", str, "a string")
    if kind not in KINDS:
        raise WireError(f"message from {peer} has unknown kind {_shown(kind)}: is that host running another hetero version?")
    step = _require(header, "step", int, "an integer")
    mb = _require(header, "mb", int, "an integer")
    meta = _require(header, "meta", dict, "a map")
    specs = _require(header, "tensors", list, "a list")
    who = f"{kind!r} step {step} mb {mb} from {peer}"
    if len(frames) != 1 + len(specs):
        raise WireError(f"{who} announces {len(specs)} tensors but carries {len(frames) - 1} frames")
    tensors: dict[str, torch.Tensor] = {}
    for spec, frame in zip(specs, frames[1:], strict=True):
        name, tensor = _tensor_from_frame(spec, _frame_buffer(frame), who)
        if name in tensors:
            raise WireError(f"{who} carries tensor {_shown(name)} twice")
        tensors[name] = tensor
    return Message(kind=kind, sender=sender, step=step, mb=mb, meta=meta, tensors=tensors)


def chunk_of(msg: Message) -> int:
    """The chunk an act or grad is for (interleaved programs name it in the meta; any other message: 0)."""
    chunk = msg.meta.get("chunk") if isinstance(msg.meta, dict) else None
    return chunk if isinstance(chunk, int) else 0
