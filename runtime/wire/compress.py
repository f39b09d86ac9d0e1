"""Compressed hand-offs: an activation or its gradient in 8 or 4 bits on a slow link (issue 37, first part).

A hand-off tensor ``[..., H]`` (the compute dtype: fp32, bf16 or fp16) is cut along its last dimension into tiles
of ``TILE`` values (the last tile padded with zeros), and each tile is sent as small integers and one float32
scale:

- ``int8``: ``q = round(x / s)`` with ``s = max|x| / 127`` per tile, ``q`` in [-127, 127], one byte per value;
- ``int4``: each tile is first rotated by the orthonormal Hadamard matrix of size ``TILE`` (which spreads an
  outlier over the whole tile, as QuaRot and TAH-Quant do before 4-bit quantization), then ``q = round(y / s)``
  with ``s = max|y| / 7``, ``q`` in [-7, 7], two values per byte (``q + 8`` in each nibble).

The receiver multiplies back (and rotates back: the normalized Hadamard matrix is its own inverse) into the
compute dtype. Rounding is to the nearest level, so on one device and torch build the same tensor always encodes to
the same bytes and a resumed run sends what the first one sent (int4's rotation is a matmul, whose rounding may
differ between devices and BLAS builds). Per value, a tile costs 1 or 0.5 bytes plus 4 / TILE for its scale.

``check`` is the receiver's edge: parts of the wrong dtype or shape, scales that are negative, NaN or inf, and
levels outside the scheme's range are refused in one line (WireError), like every other bad frame.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from hetero.errors import WireError

SCHEMES = ("none", "int8", "int4")
TILE = 64  # values per scale; a power of two, for the Hadamard rotation of int4
LEVELS = {"int8": 127, "int4": 7}  # the largest level: levels are symmetric around zero


def _check_scheme(scheme: str) -> None:
    if scheme not in LEVELS:
        raise ValueError(f"compression scheme {scheme!r}: expected one of {', '.join(LEVELS)}")


def padded(hidden: int) -> int:
    """The last dimension as sent: ``hidden`` rounded up to whole tiles."""
    return -(-int(hidden) // TILE) * TILE


def part_shapes(shape: tuple[int, ...], scheme: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The parts a ``shape`` tensor is sent as under ``scheme``: name -> (shape, dtype)."""
    _check_scheme(scheme)
    *lead, hidden = shape
    width = padded(hidden)
    q = (*lead, width) if scheme == "int8" else (*lead, width // 2)
    return {"q": (tuple(q), torch.int8 if scheme == "int8" else torch.uint8),
            "scale": ((*lead, width // TILE), torch.float32)}


def wire_names(name: str, scheme: str) -> dict[str, str]:
    """Part -> the message's tensor name it travels under, for a hand-off ``name`` (``h``, ``g``) on a link of
    ``scheme``: ``{"": name}`` uncompressed, else ``{"q": name_q, "scale": name_scale}``."""
    if scheme == "none":
        return {"": name}
    return {part: f"{name}_{part}" for part in part_shapes((TILE,), scheme)}


def pack(t: torch.Tensor, name: str, scheme: str) -> dict[str, torch.Tensor]:
    """A hand-off tensor as a message carries it on a link of ``scheme``: itself under ``name``, or its encoded parts
    under wire_names (the receiver's rules check them: ``parts_of`` + check)."""
    if scheme == "none":
        return {name: t}
    parts = encode(t, scheme)
    return {wire: parts[part] for part, wire in wire_names(name, scheme).items()}


def parts_of(tensors: dict[str, torch.Tensor], name: str, scheme: str) -> dict[str, torch.Tensor]:
    """The encoded parts of hand-off ``name`` in a message's ``tensors`` (what ``pack`` sent), by part name."""
    return {part: tensors[wire] for part, wire in wire_names(name, scheme).items()}


def wire_bytes(shape: tuple[int, ...], scheme: str, dtype_bytes: float) -> float:
    """Bytes a ``shape`` tensor of ``dtype_bytes`` per value puts on the wire under ``scheme`` (``none``: as is)."""
    if scheme == "none":
        return math.prod(shape) * dtype_bytes
    parts = part_shapes(shape, scheme)
    return float(sum(math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in parts.values()))


@lru_cache(maxsize=4)
def _hadamard(size: int, device: str) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix of ``size`` (a power of two): symmetric and its own inverse."""
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(size)).to(device)


def _tiles(x: torch.Tensor) -> torch.Tensor:
    """``[..., H]`` as fp32 ``[..., H_padded / TILE, TILE]`` (zeros after the last value)."""
    hidden = x.shape[-1]
    x = x.float()
    if padded(hidden) != hidden:
        x = torch.nn.functional.pad(x, (0, padded(hidden) - hidden))
    return x.reshape(*x.shape[:-1], padded(hidden) // TILE, TILE)


def encode(x: torch.Tensor, scheme: str) -> dict[str, torch.Tensor]:
    """``x`` ``[..., H]`` as the parts ``q`` (int8, or uint8 of two int4 levels) and ``scale`` (float32 per tile)."""
    _check_scheme(scheme)
    tiles = _tiles(x.detach())
    if scheme == "int4":
        tiles = tiles @ _hadamard(TILE, str(tiles.device))
    top = LEVELS[scheme]
    largest = tiles.abs().amax(dim=-1) if tiles.numel() else tiles.new_zeros(tiles.shape[:-1])
    scale = largest / top
    nonzero = scale > 0  # an all-zero tile, or one so small that its scale underflows: levels 0, scale 0
    q = torch.round(tiles / torch.where(nonzero, scale, torch.ones_like(scale)).unsqueeze(-1)).clamp_(-top, top)
    q = torch.where(nonzero.unsqueeze(-1), q, torch.zeros_like(q))
    scale = torch.where(nonzero, scale, torch.zeros_like(scale))
    # A NaN or inf value: a NaN scale, which the receiver refuses as it refuses non-finite tensors sent as they are.
    scale = torch.where(torch.isfinite(largest), scale, torch.full_like(scale, math.nan))
    q = q.reshape(*q.shape[:-2], q.shape[-2] * TILE)
    if scheme == "int8":
        return {"q": q.to(torch.int8), "scale": scale}
    nibbles = (q + 8).to(torch.uint8)
    return {"q": nibbles[..., 0::2] | (nibbles[..., 1::2] << 4), "scale": scale}


def decode(parts: dict[str, torch.Tensor], scheme: str, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``[..., hidden]`` tensor in ``dtype`` that ``encode`` sent as ``parts`` (checked with ``check`` first)."""
    _check_scheme(scheme)
    q, scale = parts["q"], parts["scale"]
    width = scale.shape[-1] * TILE
    if scheme == "int8":
        levels = q.float()
    else:
        levels = torch.stack([(q & 0x0F), (q >> 4)], dim=-1).reshape(*q.shape[:-1], width).float() - 8
    tiles = levels.reshape(*levels.shape[:-1], scale.shape[-1], TILE) * scale.unsqueeze(-1)
    if scheme == "int4":
        tiles = tiles @ _hadamard(TILE, str(tiles.device))
    return tiles.reshape(*tiles.shape[:-2], width)[..., :hidden].to(dtype)


def check(parts: dict[str, torch.Tensor], scheme: str, shape: tuple[int, ...], what: str) -> None:
    """Raise WireError (one line, naming ``what``) unless ``parts`` is what ``encode`` sends for a ``shape`` tensor."""
    expected = part_shapes(shape, scheme)
    if set(parts) != set(expected):
        raise WireError(f"{what}: compressed ({scheme}) parts {sorted(parts)}, expected {sorted(expected)}")
    for name, (want_shape, want_dtype) in expected.items():
        t = parts[name]
        if tuple(t.shape) != want_shape or t.dtype != want_dtype:
            raise WireError(f"{what}: compressed ({scheme}) part {name!r} is {t.dtype}{list(t.shape)}, expected "
                            f"{want_dtype}{list(want_shape)}")
    scale, q = parts["scale"], parts["q"]
    if scale.numel() and not bool((torch.isfinite(scale) & (scale >= 0)).all()):
        raise WireError(f"{what}: compressed ({scheme}) scales must be finite and >= 0")
    if not q.numel():
        return
    if scheme == "int8" and int(q.min()) < -LEVELS["int8"]:
        raise WireError(f"{what}: int8 levels must lie in [-127, 127]")
    if scheme == "int4" and bool((((q & 0x0F) == 0) | ((q >> 4) == 0)).any()):
        raise WireError(f"{what}: int4 levels must lie in [-7, 7] (nibbles 1..15)")
