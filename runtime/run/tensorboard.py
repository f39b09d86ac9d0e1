"""TensorBoard event files in the run directory (`tensorboard --logdir RUN_DIR/tensorboard`), written as steps end.

Written here without TensorBoard or TensorFlow installed: an event file is a sequence of TFRecords (a length,
its masked CRC-32C, the bytes, their masked CRC-32C), each holding one ``Event`` protocol buffer
(tensorflow/core/util/event.proto: wall_time = 1, step = 2, file_version = 3, summary = 5, session_log = 7;
``Summary.Value``: tag = 1, simple_value = 2). Only scalars are written, so a few fields encoded by hand do.

The x axis is the number of optimizer steps done (step 1 is the first), like the progress line. A resumed run,
and a run that recovered from a lost device, starts a new file with a SessionLog START at the step it resumes
from: TensorBoard then drops the earlier file's points from that step on, which were trained again.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

from hetero.runtime.run.metrics_file import EvalLine, StepLine, charted

SESSION_START = 1  # SessionLog.SessionStatus.START


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, reflected
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC-32C."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1  # int64 as protobuf writes it
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _field(number: int, wire: int) -> bytes:
    return _varint((number << 3) | wire)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _field(number, 2) + _varint(len(payload)) + payload


def event(step: int, *, scalars: dict[str, float] | None = None, file_version: str | None = None,
          session_start: bool = False, wall_time: float | None = None) -> bytes:
    """One serialized ``Event``."""
    out = _field(1, 1) + struct.pack("<d", time.time() if wall_time is None else wall_time)
    out += _field(2, 0) + _varint(step)
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalars:
        values = b"".join(_bytes_field(1, _bytes_field(1, tag.encode()) + _field(2, 5) + struct.pack("<f", value))
                          for tag, value in scalars.items())
        out += _bytes_field(5, values)
    if session_start:
        out += _bytes_field(7, _field(1, 0) + _varint(SESSION_START))
    return out


def record(data: bytes) -> bytes:
    """``data`` framed as a TFRecord."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data))


class EventWriter:
    """Appends scalar events to a new event file under ``folder``; each write is flushed (a run may be killed)."""

    def __init__(self, folder: Path, start_step: int = 0) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        stamp = time.time()
        name = f"events.out.tfevents.{int(stamp):010d}.{socket.gethostname()}.{os.getpid()}.{time.time_ns():020d}"
        self.path = folder / name
        self._file = open(self.path, "ab")  # noqa: SIM115 - kept open for the run, closed by close()
        self._write(event(0, file_version="brain.Event:2", wall_time=stamp))
        if start_step > 0:  # resumed: the points after this step in older files are stale
            self._write(event(start_step + 1, session_start=True))

    def _write(self, data: bytes) -> None:
        self._file.write(record(data))
        self._file.flush()

    def step(self, line: StepLine) -> None:
        """A metrics.jsonl step line's scalars at its step (numbered from 1, as in metrics.jsonl)."""
        if scalars := charted(line):
            self._write(event(line.step, scalars=scalars))

    def evaluation(self, answer: EvalLine) -> None:
        if scalars := charted(answer):
            self._write(event(answer.step, scalars=scalars))

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
