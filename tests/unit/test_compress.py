"""Compressed hand-offs (runtime/wire/compress.py): what the receiver decodes, how far from what was sent, and
what it refuses."""

from __future__ import annotations

import math

import pytest
import torch

from hetero.errors import WireError
from hetero.runtime.wire import compress
from hetero.runtime.wire.compress import TILE, check, decode, encode, part_shapes, wire_bytes


def _roundtrip(x: torch.Tensor, scheme: str) -> torch.Tensor:
    parts = encode(x, scheme)
    check(parts, scheme, tuple(x.shape), "act")
    return decode(parts, scheme, x.shape[-1], x.dtype)


@pytest.mark.parametrize("hidden", [256, 100])  # whole tiles, and a last tile padded
def test_int8_is_within_half_a_level_of_each_tiles_largest_value(hidden: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 5, hidden) * torch.logspace(-3, 2, hidden)  # tiles of very different magnitudes
    got = _roundtrip(x, "int8")
    assert got.shape == x.shape and got.dtype == x.dtype
    tiles = torch.nn.functional.pad(x, (0, compress.padded(hidden) - hidden)).reshape(2, 5, -1, TILE)
    half_level = (tiles.abs().amax(-1) / 127 / 2).repeat_interleave(TILE, -1)[..., :hidden]
    assert bool(((got - x).abs() <= half_level * (1 + 1e-5) + 1e-12).all())


def test_int4_rotates_an_outlier_away() -> None:
    """One outlier per tile: without the rotation the other 63 values of its tile round to zero; rotated, the error
    of each tile is bounded by half a level per rotated value (the rotation keeps lengths)."""
    torch.manual_seed(0)
    x = torch.randn(8, 4 * TILE)
    x[:, ::TILE] *= 50.0
    got = _roundtrip(x, "int4")
    err = (got - x).reshape(8, 4, TILE).norm(dim=-1)
    rotated = x.reshape(8, 4, TILE) @ compress._hadamard(TILE, "cpu")
    bound = rotated.abs().amax(-1) / 7 / 2 * math.sqrt(TILE)
    assert bool((err <= bound * (1 + 1e-5)).all())
    # The same levels without the rotation: what the rotation buys on outliers.
    tiles = x.reshape(8, 4, TILE)
    scale = tiles.abs().amax(-1, keepdim=True) / 7
    plain = (torch.round(tiles / scale).clamp(-7, 7) * scale - tiles).norm(dim=-1)
    assert float(err.mean()) < 0.5 * float(plain.mean())


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_compute_dtype_comes_back_and_encoding_is_deterministic(scheme: str, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x = torch.randn(3, 7, 128).to(dtype)
    a, b = encode(x, scheme), encode(x.clone(), scheme)
    assert all(torch.equal(a[k], b[k]) for k in a)  # a resumed run sends the same bytes
    got = decode(a, scheme, 128, dtype)
    assert got.dtype == dtype and got.shape == x.shape
    rel = float((got.float() - x.float()).norm() / x.float().norm())
    assert rel < (0.01 if scheme == "int8" else 0.15), rel


def test_zero_tiles_and_wire_bytes() -> None:
    x = torch.zeros(2, 3, 128)
    x[0, 0, :10] = 1.0
    for scheme in ("int8", "int4"):
        parts = encode(x, scheme)
        got = decode(parts, scheme, 128, torch.float32)
        assert not bool(got[1].any()) and not bool(got[0, 1:].any())  # all-zero tiles come back as zeros exactly
        if scheme == "int8":
            assert torch.equal(got, x)
        sent = sum(t.numel() * t.element_size() for t in parts.values())
        assert sent == wire_bytes((2, 3, 128), scheme, 2)
    # bf16 [4, 2048, 4096]: 64 MiB as is; int8 about half, int4 about a quarter (scales included).
    shape = (4, 2048, 4096)
    assert wire_bytes(shape, "none", 2) == 2 * 4 * 2048 * 4096
    assert wire_bytes(shape, "int8", 2) / wire_bytes(shape, "none", 2) == pytest.approx(0.5 + 2 / TILE)
    assert wire_bytes(shape, "int4", 2) / wire_bytes(shape, "none", 2) == pytest.approx(0.25 + 2 / TILE)


def test_a_non_finite_value_is_refused_by_the_receiver() -> None:
    x = torch.randn(2, 128)
    x[1, 5] = math.nan
    parts = encode(x, "int8")
    with pytest.raises(WireError, match="scales must be finite"):
        check(parts, "int8", (2, 128), "act step 0 mb 0")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_malformed_parts_are_refused_in_one_line(scheme: str) -> None:
    shape = (2, 4, 192)
    good = encode(torch.randn(shape), scheme)
    q_shape, q_dtype = part_shapes(shape, scheme)["q"]
    bad_levels = good["q"].clone()
    bad_levels.view(-1)[3] = -128 if scheme == "int8" else 0x07 & 0x0F  # -128, or a zero high nibble
    cases = {
        "missing scale": {"q": good["q"]},
        "extra part": {**good, "h": torch.zeros(1)},
        "scale shape": {**good, "scale": good["scale"][..., :-1]},
        "q dtype": {**good, "q": good["q"].to(torch.int16)},
        "negative scale": {**good, "scale": -good["scale"]},
        "inf scale": {**good, "scale": good["scale"].masked_fill(torch.ones_like(good["scale"], dtype=torch.bool),
                                                                  math.inf)},
        "levels": {**good, "q": bad_levels},
    }
    for name, parts in cases.items():
        with pytest.raises(WireError) as err:
            check(parts, scheme, shape, "act step 3 mb 1 from stage0")
        line = str(err.value)
        assert "\n" not in line and line.startswith("act step 3 mb 1 from stage0: "), (name, line)
    assert q_dtype == (torch.int8 if scheme == "int8" else torch.uint8) and q_shape[-1] in (192, 96)
    with pytest.raises(ValueError, match="compression scheme 'int2'"):
        encode(torch.zeros(2, 64), "int2")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(0, 128), (2, 0, 128), (3, 1e-44)])
def test_empty_tensors_and_underflowing_tiles(scheme: str, shape: tuple) -> None:
    """A micro-batch of no rows goes and comes back empty; a tile so small that its scale underflows to 0 goes as
    zeros (not as NaN levels the receiver would refuse)."""
    if shape[-1] == 1e-44:
        x = torch.full((shape[0], 128), 1e-44)
    else:
        x = torch.zeros(shape)
    parts = encode(x, scheme)
    check(parts, scheme, tuple(x.shape), "act")
    got = decode(parts, scheme, x.shape[-1], x.dtype)
    assert got.shape == x.shape and bool((got.abs() <= 1e-40).all())
