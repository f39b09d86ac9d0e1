"""The wire format: exact layout, every dtype, and every malformed input rejected with one line."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest
import torch

from hetero.errors import HeteroError, WireError
from hetero.runtime.wire.frames import DTYPES, KINDS, WIRE_VERSION, Message, decode, encode

PLAN = "1a2b3c4d5e6f7a8b9c0d"


def sample_tensors() -> dict[str, torch.Tensor]:
    """One tensor per wire dtype, with values every dtype represents exactly."""
    base = torch.arange(-6, 6).reshape(3, 4)
    out = {name: base.to(dtype) for name, dtype in DTYPES.items() if dtype not in (torch.uint8, torch.bool)}
    out["uint8"] = torch.arange(0, 256, 21, dtype=torch.uint8)
    out["bool"] = torch.tensor([[True, False, True], [False, False, True]])
    out["bfloat16_frac"] = torch.tensor([0.5, -1.25, 3.0e38, 1e-38], dtype=torch.bfloat16)
    return out


def frames_of(header: dict, *payloads: bytes) -> list[bytes]:
    return [msgpack.packb(header, use_bin_type=True), *payloads]


def good_header(**changes: object) -> dict:
    header = {"v": WIRE_VERSION, "plan": PLAN, "kind": "act", "sender": "stage1", "step": 3, "mb": 2,
              "meta": {}, "tensors": [{"name": "x", "dtype": "float32", "shape": [2, 3]}]}
    header.update(changes)
    return header


FLOATS_2x3 = np.arange(6, dtype="<f4").tobytes()


def test_round_trip_every_dtype_bit_exact() -> None:
    sent = sample_tensors()
    msg = Message("act", "stage0", step=7, mb=3, meta={"loss_scale": 2.5, "ids": [1, 2], "tag": "x"}, tensors=sent)
    got = decode(encode(msg, PLAN), PLAN)
    assert (got.kind, got.sender, got.step, got.mb) == ("act", "stage0", 7, 3)
    assert got.meta == {"loss_scale": 2.5, "ids": [1, 2], "tag": "x"}
    assert list(got.tensors) == list(sent)
    for name, tensor in sent.items():
        assert got.tensors[name].dtype == tensor.dtype, name
        assert got.tensors[name].shape == tensor.shape, name
        assert torch.equal(got.tensors[name], tensor), name


def test_header_layout_matches_the_documented_format() -> None:
    # Decode by hand with msgpack + numpy: a peer on another hetero build relies on this layout.
    t = torch.tensor([[1.5, -2.0], [3.25, 4.0]], dtype=torch.bfloat16)
    frames = encode(Message("grad", "stage2", step=1, mb=4, tensors={"g": t}), PLAN)
    header = msgpack.unpackb(bytes(frames[0]), raw=False)
    assert header == {"v": WIRE_VERSION, "plan": PLAN, "kind": "grad", "sender": "stage2", "step": 1, "mb": 4,
                      "meta": {}, "tensors": [{"name": "g", "dtype": "bfloat16", "shape": [2, 2]}]}
    # bf16 is the top half of the float32 with the same value (all four values are exact in bf16).
    as_f32 = np.frombuffer(bytes(frames[1]), dtype="<u2").astype("<u4") << 16
    assert as_f32.view("<f4").tolist() == [1.5, -2.0, 3.25, 4.0]


def test_decode_accepts_frames_built_independently() -> None:
    got = decode(frames_of(good_header(), FLOATS_2x3), PLAN)
    assert got.tensors["x"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_encode_is_zero_copy_for_contiguous_cpu_tensors() -> None:
    t = torch.randn(1024)
    frames = encode(Message("act", "s", tensors={"x": t}), PLAN)
    assert isinstance(frames[1], memoryview)
    assert np.frombuffer(frames[1], dtype=np.uint8).ctypes.data == t.data_ptr()


def test_noncontiguous_scalar_empty_and_grad_tensors_round_trip() -> None:
    base = torch.randn(4, 6, requires_grad=True)
    tensors = {"t": base.detach().t(), "s": torch.tensor(3.5), "e": torch.zeros(0, 5, dtype=torch.int64),
               "g": base * 2}
    got = decode(encode(Message("act", "s", tensors=tensors), PLAN), None).tensors
    assert torch.equal(got["t"], base.detach().t())
    assert got["s"].shape == () and got["s"].item() == 3.5
    assert got["e"].shape == (0, 5) and got["e"].dtype == torch.int64
    assert torch.equal(got["g"], (base * 2).detach()) and not got["g"].requires_grad


def test_misaligned_receive_buffer_is_copied_to_an_aligned_tensor() -> None:
    # ZeroMQ may hand small frames at any offset of its receive buffer.
    backing = bytearray(1 + 24)
    backing[1:] = np.arange(3, dtype="<i8").tobytes()
    header = good_header(tensors=[{"name": "x", "dtype": "int64", "shape": [3]}])
    got = decode([msgpack.packb(header), memoryview(backing)[1:]], PLAN).tensors["x"]
    assert got.data_ptr() % 8 == 0 and got.tolist() == [0, 1, 2]


def test_send_side_rejects_what_the_wire_cannot_carry() -> None:
    with pytest.raises(WireError, match="complex64"):  # float64 travels (a float64 plan's activations)
        encode(Message("act", "s", tensors={"x": torch.zeros(2, dtype=torch.complex64)}), PLAN)
    with pytest.raises(WireError, match="unknown message kind 'nope'"):
        encode(Message("nope", "s"), PLAN)
    with pytest.raises(WireError, match=r"meta\.obj holds a object"):
        encode(Message("act", "s", meta={"obj": object()}), PLAN)
    with pytest.raises(WireError, match="not a torch.Tensor"):
        encode(Message("act", "s", tensors={"x": [1, 2]}), PLAN)  # type: ignore[dict-item]


def test_wrong_plan_hash_names_both_plans_and_the_fix() -> None:
    frames = frames_of(good_header(plan="3c4d" * 10), FLOATS_2x3)
    with pytest.raises(WireError) as err:
        decode(frames, PLAN)
    text = str(err.value)
    assert "peer stage1 runs plan 3c4d" in text and f"this process runs {PLAN[:12]}" in text
    assert "same plan.json" in text and "\n" not in text
    assert decode(frames, None).sender == "stage1"  # no expectation: any plan is accepted


MALFORMED = {
    "wire version": (frames_of(good_header(v=WIRE_VERSION + 1), FLOATS_2x3), f"wire version {WIRE_VERSION + 1}"),
    "unknown kind": (frames_of(good_header(kind="exec"), FLOATS_2x3), "unknown kind 'exec'"),
    "garbage header": ([b"\xc1\xc1 not msgpack", FLOATS_2x3], "not valid msgpack"),
    "truncated header": ([msgpack.packb(good_header())[:-3], FLOATS_2x3], "not valid msgpack"),
    "header not a map": ([msgpack.packb([1, 2, 3]), FLOATS_2x3], "not a map"),
    "missing fields": (frames_of({"v": WIRE_VERSION, "plan": PLAN}), "lacks kind, sender"),
    "step is a string": (frames_of(good_header(step="3"), FLOATS_2x3), "'step' must be an integer"),
    "mb is a bool": (frames_of(good_header(mb=True), FLOATS_2x3), "'mb' must be an integer"),
    "mb is a float": (frames_of(good_header(mb=2.0), FLOATS_2x3), "'mb' must be an integer"),
    "sender not a string": (frames_of(good_header(sender=5), FLOATS_2x3), "'sender' must be a string"),
    "meta is a list": (frames_of(good_header(meta=[1]), FLOATS_2x3), "'meta' must be a map"),
    "tensors not a list": (frames_of(good_header(tensors={"x": 1}), FLOATS_2x3), "'tensors' must be a list"),
    "tensor entry not a map": (frames_of(good_header(tensors=["x"]), FLOATS_2x3), "not a map"),
    "unknown dtype": (frames_of(good_header(tensors=[{"name": "x", "dtype": "complex128", "shape": [3]}]),
                                FLOATS_2x3), "unknown dtype 'complex128'"),
    "object dtype": (frames_of(good_header(tensors=[{"name": "x", "dtype": "object", "shape": [1]}]), b"12345678"),
                     "unknown dtype 'object'"),
    "negative dim": (frames_of(good_header(tensors=[{"name": "x", "dtype": "float32", "shape": [-2, -3]}]),
                               FLOATS_2x3), "malformed shape"),
    "shape of strings": (frames_of(good_header(tensors=[{"name": "x", "dtype": "float32", "shape": ["6"]}]),
                                   FLOATS_2x3), "malformed shape"),
    "absurd dim of an empty tensor": (frames_of(good_header(tensors=[{"name": "x", "dtype": "uint8",
                                                                       "shape": [0, 2**63]}]), b""),
                                      "malformed shape"),
    "short frame": (frames_of(good_header(), FLOATS_2x3[:-1]), "needs 24 bytes, its frame has 23"),
    "long frame": (frames_of(good_header(), FLOATS_2x3 + b"\0" * 4), "needs 24 bytes, its frame has 28"),
    "missing frame": (frames_of(good_header()), "announces 1 tensors but carries 0 frames"),
    "extra frame": (frames_of(good_header(), FLOATS_2x3, b"x"), "announces 1 tensors but carries 2 frames"),
    "duplicate name": (frames_of(good_header(tensors=[{"name": "x", "dtype": "uint8", "shape": [1]}] * 2),
                                 b"a", b"b"), "tensor 'x' twice"),
    "msgpack extension": ([msgpack.packb(good_header(meta={"t": msgpack.ExtType(5, b"payload")})), FLOATS_2x3],
                          "extension type 5"),
    "no frames": ([], "empty message"),
    "sender with a newline": (frames_of(good_header(sender="a\nb", plan="f" * 20), FLOATS_2x3), "peer a\\nb runs"),
    "huge kind": (frames_of(good_header(kind="k" * 5000), FLOATS_2x3), "unknown kind 'kkkk"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_input_is_one_line_wire_error(case: str) -> None:
    frames, expected = MALFORMED[case]
    with pytest.raises(WireError) as err:
        decode(frames, PLAN)
    assert isinstance(err.value, HeteroError)
    assert expected in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def test_kinds_cover_the_runtime_protocol() -> None:
    assert {"act", "grad", "batch", "labels", "loss", "stop", "error", "heartbeat"} <= KINDS


def test_random_corruption_only_ever_raises_wire_error() -> None:
    # Whatever a broken or hostile peer sends, decode answers with a Message or a one-line WireError.
    rng = random.Random(1234)
    tensors = {"a": torch.arange(6, dtype=torch.int32).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)}
    frames = [bytes(f) for f in encode(Message("act", "stage0", step=1, mb=2, meta={"k": [1, 2.5]},
                                               tensors=tensors), PLAN)]
    outcomes = {"ok": 0, "rejected": 0}
    for _ in range(600):
        header = bytearray(frames[0])
        for _ in range(rng.randint(1, 4)):
            header[rng.randrange(len(header))] = rng.randrange(256)
        if rng.random() < 0.2:
            header = header[: rng.randrange(len(header))]
        mutated = [bytes(header), *frames[1:]]
        if rng.random() < 0.2:
            mutated = mutated[: rng.randrange(len(mutated) + 1)]
        try:
            decode(mutated, PLAN)
            outcomes["ok"] += 1
        except WireError as exc:
            assert "\n" not in str(exc)
            outcomes["rejected"] += 1
    assert outcomes["rejected"] > 300  # most corruptions must be caught, not silently accepted
