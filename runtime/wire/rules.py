"""What a process of a run accepts: one typed record per message kind, checked at the edge.

The Transport decodes frames into a ``Message`` (runtime/wire/frames.py: header, dtypes, byte counts); a
``Rules`` object then decides whether that message can be part of this run, from this process's
point of view:

- the sender may send this kind to this process (``act`` only from the previous stage, ``grad``
  only from the next, ``clip``/``welcome``/``batch``/``labels``/``stop`` only from the coordinator);
- its metadata is the kind's record (hetero/protocol.py ``Clip``, ``GradNorm``, ...: every field present
  with its type, numbers finite where a NaN can only be a bug or an attack, clip coefficients in [0, 1]);
- its tensors are the ones the plan says, with the plan's shape and dtype (activations
  [micro_batch, seq, hidden] in the sending stage's dtype; token ids within the vocabulary);
- its step is one the program can have in flight (the current step or the next), its micro-batch
  one of the step's, and it is not a duplicate of a message still waiting.

A message that fails is dropped and logged by the Transport; the process keeps serving its real
peers. Together with the pending-queue cap this bounds what a peer can make a process hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hetero.errors import WireError
from hetero.protocol import MESSAGE_OVERHEAD_BYTES, MESSAGE_SIZE_MARGIN, RECORDS, UNSTEPPED, Record
from hetero.runtime.wire import compress
from hetero.runtime.wire.frames import DTYPES, Message, chunk_of
from hetero.security import COORDINATOR


def check_meta(msg: Message) -> Record:
    """The message's metadata as its kind's record (hetero/protocol.py); raises WireError (one line) otherwise."""
    if msg.kind not in RECORDS:
        raise WireError(f"{msg.describe()}: a run never sends this kind here")
    return RECORDS[msg.kind].from_wire(msg.meta, msg.describe())


@dataclass(frozen=True)
class TensorRule:
    shape: tuple[int, ...]
    dtype: str
    low: int | None = None  # integer tensors: allowed value range [low, high)
    high: int | None = None
    extra_low: int | None = None  # one more allowed value outside the range (labels' -100)
    positions: bool = False  # packed rows' position ids: each 0 (a record starts) or one more than the one before


@dataclass
class Rules:
    """What one process (``me``) accepts; built from the plan by ``stage_rules``/``coordinator_rules``."""

    me: str
    senders: dict[str, frozenset[str]]  # kind -> who may send it to me
    tensors: dict[str, dict[str, TensorRule]] = field(default_factory=dict)  # kind -> name -> rule
    # Kinds of named float32 tensors of any shape (checked against the stage's parameters where used).
    open_tensors: frozenset[str] = frozenset({"state", "checkpoint", "grads", "reduced"})
    num_micro_batches: int = 1
    step: int | None = None  # the step in progress; None before training (only duplicates are refused)
    # Compressed hand-offs (runtime/wire/compress.py): kind -> (tensor name, scheme, the uncompressed shape); the
    # parts (compress.wire_names) are in ``tensors``, and their levels and scales are checked here too.
    compressed: dict[str, tuple[str, str, tuple[int, ...]]] = field(default_factory=dict)
    max_pending: int = 64
    chunks: int = 1  # the chunks of layers this process holds (interleaved plans): acts and grads name one of them

    def check(self, msg: Message, pending: list[Message]) -> None:
        """Raise WireError (one line) when ``msg`` cannot be part of this run; see the module docstring."""
        allowed = self.senders.get(msg.kind)
        if allowed is None:
            raise WireError(f"{msg.describe()}: {self.me} never receives {msg.kind!r}")
        if msg.sender not in allowed:
            raise WireError(f"{msg.describe()}: {self.me} takes {msg.kind!r} only from {', '.join(sorted(allowed))}")
        msg.record = check_meta(msg)  # receivers read the record, not the meta it was checked from
        if msg.kind not in UNSTEPPED:
            if self.step is not None and not self.step <= msg.step <= self.step + 1:
                raise WireError(f"{msg.describe()}: {self.me} is at step {self.step} (accepts {self.step} and "
                                f"{self.step + 1})")
            if msg.kind in ("act", "grad") and not 0 <= msg.mb < self.num_micro_batches:
                raise WireError(f"{msg.describe()}: micro-batch out of range 0..{self.num_micro_batches - 1}")
            if msg.kind in ("act", "grad") and not chunk_of(msg) < self.chunks:
                raise WireError(f"{msg.describe()}: chunk {chunk_of(msg)}, but {self.me} holds {self.chunks}")
        self._check_tensors(msg)
        if msg.kind != "heartbeat":
            same = (msg.kind, msg.step, msg.mb, msg.sender, chunk_of(msg))
            if any((m.kind, m.step, m.mb, m.sender, chunk_of(m)) == same for m in pending):
                raise WireError(f"{msg.describe()} duplicates a message still waiting")
        if len(pending) >= self.max_pending:
            raise WireError(f"{msg.describe()}: {len(pending)} messages already wait (limit {self.max_pending})")

    def _check_tensors(self, msg: Message) -> None:
        if msg.kind in self.open_tensors:
            for name, t in msg.tensors.items():
                if t.dtype != torch.float32:
                    raise WireError(f"{msg.describe()}: tensor {name!r} is {t.dtype}, expected float32")
            return
        expected = self.tensors.get(msg.kind, {})
        if set(msg.tensors) != set(expected):
            raise WireError(f"{msg.describe()} carries tensors {sorted(msg.tensors)}, expected {sorted(expected)}")
        for name, rule in expected.items():
            t = msg.tensors[name]
            if tuple(t.shape) != rule.shape or t.dtype != DTYPES[rule.dtype]:
                raise WireError(f"{msg.describe()}: tensor {name!r} is {_dtype_name(t)}{list(t.shape)}, "
                                f"the plan says {rule.dtype}{list(rule.shape)}")
            if rule.low is not None and t.numel():
                lo, hi = int(t.min()), int(t.max())
                bad_low = lo < rule.low and not (rule.extra_low is not None and
                                                  bool(((t >= rule.low) | (t == rule.extra_low)).all()))
                if bad_low or (rule.high is not None and hi >= rule.high):
                    raise WireError(f"{msg.describe()}: tensor {name!r} holds ids outside [{rule.low}, {rule.high})")
                if rule.positions and not positions_well_formed(t):
                    raise WireError(f"{msg.describe()}: tensor {name!r} is not packed rows' positions (each 0 or one "
                                    "more than the position before it)")
            elif t.is_floating_point() and msg.kind in ("act", "grad") and not bool(torch.isfinite(t).all()):
                # A pipeline stage never emits inf/NaN activations or gradients from finite LoRA training
                # without the loss going NaN first, which the coordinator reports; drop, do not train on it.
                raise WireError(f"{msg.describe()}: tensor {name!r} holds NaN or inf")
        if msg.kind in self.compressed:
            name, scheme, shape = self.compressed[msg.kind]
            compress.check(compress.parts_of(msg.tensors, name, scheme), scheme, shape, msg.describe())


def positions_well_formed(position_ids: torch.Tensor) -> bool:
    """Whether ``[..., S]`` position ids are what packed rows have: 0 in the first column, and each other either 0 (a
    record starts) or one more than the position before it."""
    after = position_ids[..., 1:]
    return bool(position_ids[..., 0].eq(0).all()) and bool(((after == 0) | (after == position_ids[..., :-1] + 1)).all())


def _dtype_name(t: torch.Tensor) -> str:
    return next((k for k, v in DTYPES.items() if v == t.dtype), str(t.dtype))


def stage_rules(plan: Any, k: int) -> Rules:
    """What stage ``k`` of ``plan`` accepts (from its pipeline replica's neighbours and the coordinator)."""
    train, model = plan.train, plan.model
    hidden = int(plan.graph.hidden_size)
    vocab = int(model.architecture.get("vocab_size", 0)) if isinstance(model.architecture, dict) else 0
    shape = (train.micro_batch_size, model.seq_len, hidden)
    step_end = "reduced" if len(plan.pipelines) > 1 else "clip"
    senders: dict[str, frozenset[str]] = {
        kind: frozenset({COORDINATOR})
        for kind in ("welcome", "state", step_end, "snapshot", "stop", "heartbeat", "error")
    }
    if can_rebalance(plan):
        senders["rebalance"] = frozenset({COORDINATOR})
    tensors: dict[str, dict[str, TensorRule]] = {}
    compressed: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    m = plan.micro_batches_of(k)
    ids = (m, train.micro_batch_size, model.seq_len)
    prev, nxt = plan.prev_stage(k), plan.next_stage(k)
    # Packed rows: each token's position in its record comes with the input ids, and with every activation.
    packed = bool(plan.data.packing)
    if prev is None:
        senders["batch"] = frozenset({COORDINATOR})
        tensors["batch"] = {"input_ids": TensorRule(ids, "int64", 0, vocab or None)}
        if packed:
            tensors["batch"]["position_ids"] = TensorRule(ids, "int64", 0, model.seq_len, positions=True)
    ring = len(plan.stages) > 1 and bool(plan.stages[k].chunks)  # interleaved: the last device feeds the first's chunks
    if ring:
        prev = prev if prev is not None else len(plan.stages) - 1
        nxt = nxt if nxt is not None else 0
    if prev is not None:
        senders["act"] = frozenset({plan.stage_id(prev)})
        tensors["act"] = _handoff("h", shape, plan.stages[prev].dtype, plan.stages[prev].compress_out)
        if plan.stages[prev].compress_out != "none":
            compressed["act"] = ("h", plan.stages[prev].compress_out, shape)
        if packed:
            tensors["act"]["pos"] = TensorRule(shape[:2], "int64", 0, model.seq_len, positions=True)
    if plan.next_stage(k) is None:
        senders["labels"] = frozenset({COORDINATOR})
        tensors["labels"] = {"labels": TensorRule(ids, "int64", 0, vocab or None, extra_low=-100)}
    if nxt is not None:
        senders["grad"] = frozenset({plan.stage_id(nxt)})
        tensors["grad"] = _handoff("g", shape, plan.stages[nxt].dtype, plan.stages[k].compress_out)
        if plan.stages[k].compress_out != "none":
            compressed["grad"] = ("g", plan.stages[k].compress_out, shape)
    # Pending at most: both steps' micro-batches (through each chunk) from each neighbour, the step inputs, control.
    chunks = len(plan.stages[k].spans())
    return Rules(me=plan.stage_id(k), senders=senders, tensors=tensors, num_micro_batches=m,
                 max_pending=4 * m * chunks + 16, compressed=compressed, chunks=chunks)


def _handoff(name: str, shape: tuple[int, ...], dtype: str, scheme: str) -> dict[str, TensorRule]:
    """The rule for a hand-off tensor as its link carries it: itself, or its compressed parts."""
    if scheme == "none":
        return {name: TensorRule(shape, dtype)}
    parts = compress.part_shapes(shape, scheme)
    return {wire: TensorRule(parts[part][0], str(parts[part][1]).removeprefix("torch."))
            for part, wire in compress.wire_names(name, scheme).items()}


def coordinator_rules(plan: Any) -> Rules:
    """What the coordinator accepts: lifecycle and per-step reports from the plan's stages only."""
    stages = frozenset(plan.stage_ids())
    step_end = "grads" if len(plan.pipelines) > 1 else "gradnorm"
    kinds = ("hello", "start", step_end, "stepdone", "checkpoint", "evaldone", "error", "heartbeat")
    return Rules(me=COORDINATOR, senders={kind: stages for kind in kinds}, num_micro_batches=1,
                 max_pending=8 * len(plan.stages) + 16)


def can_rebalance(plan: Any) -> bool:
    """Whether layers of this plan may move between running stages, in place (one pipeline of two or more stages, no
    weight streaming: which layers stream, and the resident cap, were planned for each stage's own span; one chunk
    per device: a rebalance moves the edges of contiguous spans). Other plans move by a re-plan
    (runtime/run/replan_moves.py)."""
    return (len(plan.pipelines) == 1 and len(plan.stages) > 1
            and not any(s.stream_layers or s.chunks for s in plan.stages))


def max_message_bytes(plan: Any, k: int | None) -> int:
    """The largest message process ``k`` (None: the coordinator) can legitimately receive, with margin.

    Stages receive activations/gradients/token ids and, on resume, their LoRA + AdamW state (three
    float32 tensors per LoRA parameter); the coordinator receives every stage's checkpoint.
    """
    train, model = plan.train, plan.model
    boundary = train.micro_batch_size * model.seq_len * (int(plan.graph.hidden_size) * 4 + 8)  # h (+ positions)
    ids = 3 * train.num_micro_batches * train.micro_batch_size * model.seq_len * 8  # ids (+ positions), labels

    def state(stage: Any) -> int:
        return 3 * 4 * sum(plan.graph.nodes[i].lora_params for a, b in stage.spans() for i in range(a, b + 1))

    if can_rebalance(plan):  # layers may move: a stage's state may grow to all but one layer per other stage
        return int(3 * 4 * sum(n.lora_params for n in plan.graph.nodes) * MESSAGE_SIZE_MARGIN) + MESSAGE_OVERHEAD_BYTES \
            + int(max(boundary, ids) * MESSAGE_SIZE_MARGIN)
    if k is None:
        largest = max(state(s) for s in plan.stages)
    else:
        largest = max(boundary, ids, state(plan.stages[k]))
    return int(largest * MESSAGE_SIZE_MARGIN) + MESSAGE_OVERHEAD_BYTES
