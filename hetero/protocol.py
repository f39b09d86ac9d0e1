"""The run's protocol: one frozen, validated record per message kind, and the constants every side shares.

A message on the wire (runtime/wire/frames.py) is a header with a kind, a step, a micro-batch, a small
``meta`` map and named tensors. The ``meta`` of each kind is one record here: ``Clip(coef=0.5,
grad_norm=2.0)``. A sender builds the record (a bad value fails where it is made) and hands it to
``Transport.send``, which sends ``record.to_wire()`` under ``record.KIND``; a receiver's rules
(runtime/wire/rules.py) accept a message only if ``record_type(kind).from_wire(meta)`` does, which
refuses anything else with a one-line WireError: a missing field, a wrong type (a bool is no number),
a NaN where a NaN can only be a bug or an attack, a value out of range, or, for a closed record, a key
it does not define. Open records (the lifecycle: hello, welcome, ...) keep unknown keys in ``extra``,
so a newer peer may add diagnostics. Tensors are not part of a record: their rules come from the plan.

Torch-free (the planner and the CLI import it): the torch side of the dtype names is
runtime/wire/frames.py.
"""

from __future__ import annotations

import math
import typing
from dataclasses import MISSING, dataclass, field, fields
from types import NoneType, UnionType
from typing import Any, ClassVar, TypeVar

from hetero.errors import WireError

# -- constants: defined here once, imported wherever they are used ------------------------------------

# bump on any change of the header or of a record below (5: snapshot; 6: stop with a re-plan; 7: act/grad name a chunk)
WIRE_VERSION: int = 7

# Liveness (runtime/wire/control.py; `hetero run runtime.failure_timeout_s=` / `runtime.load_timeout_s=`).
SLICE_S = 0.5  # a blocking receive wakes up this often to look at control messages
FAILURE_TIMEOUT_S = 10.0  # default bound on a working peer's silence
LOAD_TIMEOUT_S = 120.0  # default bound while a stage builds: loading may hold the GIL
LOST_GRACE_S = 2.0  # a dropped connection that stays down this long is a lost peer (ZeroMQ reconnects otherwise)

# Sizes: a header is small (names, shapes, a few scalars); anything bigger is not from a hetero peer. A
# process accepts messages up to its largest legitimate one times the margin, plus the overhead.
MAX_HEADER_BYTES = 1 << 20
MESSAGE_SIZE_MARGIN = 1.25
MESSAGE_OVERHEAD_BYTES = 4 << 20  # headers, tensor names, metadata

# A stage told to stop because the run goes on under a new plan (Stop.plan) exits with this code once it has written
# that plan where its `hetero worker` looks (runtime/run/host.py), which then starts the host's stages of it.
EXIT_REPLAN = 75

BASE_PORT = 29500  # a host's first port: stage k on it listens on BASE_PORT + k, the coordinator on - 1

# Names, stable across torch versions: what the wire carries, and what a stage computes in.
WIRE_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16", "int64", "int32", "uint8", "bool", "int8", "float64")
COMPUTE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")  # what model.dtype and a device may choose
# ... and what a plan's stage may name: float64 too, which `hetero compile` never chooses (no card is priced for it).
# A hand-made CPU plan in float64 checks the runtime's arithmetic against transformers+peft to 1e-9
# (tests/unit/test_families.py), where float32's rounding would hide a bug below 1e-4.
PLAN_DTYPES: tuple[str, ...] = (*COMPUTE_DTYPES, "float64")



# -- records --------------------------------------------------------------------------------------------


def check(*, finite: bool = False, low: float | None = None, high: float | None = None,
          optional: bool = False, default: Any = MISSING) -> Any:
    """A record field's rules beyond its type. ``optional``: may be absent on the wire (None here)."""
    rules = {"finite": finite, "low": low, "high": high, "optional": optional}
    return field(default=None if optional else default, metadata=rules)


@dataclass(frozen=True)
class FieldRule:
    """What one field of a record may hold on the wire: its types (from the annotation) and ``check()``."""

    name: str
    types: tuple[type, ...]  # float admits any number; a bool is a number only where bool is named
    finite: bool = False
    low: float | None = None
    high: float | None = None
    optional: bool = False  # may be absent (then None); an explicit None is refused unless annotated
    hint: Any = Any  # the annotation: a list's or a dict's elements must be what it says, too

    @staticmethod
    def of(f: Any, hint: Any) -> FieldRule:
        """The rule of dataclass field ``f`` annotated ``hint``."""
        types = _types_of(hint)
        optional = bool(f.metadata.get("optional"))
        if optional:
            types = tuple(t for t in types if t is not NoneType)
        return FieldRule(f.name, types, bool(f.metadata.get("finite")), f.metadata.get("low"),
                         f.metadata.get("high"), optional, hint)

    def problem(self, value: Any) -> str | None:
        """What is wrong with ``value`` for this field, or None."""
        if not isinstance(value, self.types) or (isinstance(value, bool) and bool not in self.types):
            return f"meta {self.name!r} is a {type(value).__name__}"
        if isinstance(value, (list, dict)) and not _conforms(value, self.hint):
            return f"meta {self.name!r} holds an element of the wrong type ({self.name} is {self.hint})"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if self.finite and not math.isfinite(value):
                return f"meta {self.name!r} is {value}, not a finite number"
            if (self.low is not None and value < self.low) or (self.high is not None and value > self.high):
                return f"meta {self.name!r} = {value} is out of range"
        return None


def _conforms(value: Any, hint: Any) -> bool:
    """Whether ``value`` is what ``hint`` says, elements of lists and dicts included (a bool is no number): a
    stage's ``op_time_s`` of strings or a ``spans`` of floats would fail in the process that takes it."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, UnionType):
        return any(_conforms(value, arg) for arg in args)
    if hint in (int, float):
        return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, list) and all(_conforms(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict) and all(_conforms(k, args[0]) and _conforms(v, args[1]) for k, v in value.items())
    return isinstance(value, origin or hint)


def _types_of(hint: Any) -> tuple[type, ...]:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, UnionType):
        return tuple(t for arg in typing.get_args(hint) for t in _types_of(arg))
    if hint is float:
        return (int, float)
    if hint is None:
        return (NoneType,)
    return (origin,) if origin is not None else (hint,)


@dataclass(frozen=True, kw_only=True)
class Record:
    """The ``meta`` of one message kind; subclasses set KIND (and OPEN / STEPPED where they differ)."""

    KIND: ClassVar[str] = ""
    OPEN: ClassVar[bool] = False  # unknown keys are kept in ``extra`` (lifecycle messages), not refused
    STEPPED: ClassVar[bool] = True  # belongs to a step (a receiver's step window applies)

    extra: dict[str, Any] = field(default_factory=dict)  # an open record's other keys, as received

    @classmethod
    def rules(cls) -> tuple[FieldRule, ...]:
        """The rules of this record's fields (worked out from the class once, then kept on it)."""
        cached = cls.__dict__.get("_rules")
        if cached is None:
            hints = typing.get_type_hints(cls)
            cached = tuple(FieldRule.of(f, hints[f.name]) for f in fields(cls) if f.name != "extra")
            cls._rules = cached  # type: ignore[attr-defined]
        return cached

    def __post_init__(self) -> None:
        for rule in self.rules():
            value = getattr(self, rule.name)
            if not (value is None and rule.optional) and (problem := rule.problem(value)) is not None:
                raise WireError(f"{self.KIND!r} record: {problem}")
        if self.extra and not self.OPEN:
            raise WireError(f"{self.KIND!r} record carries unexpected meta field {sorted(self.extra)[0]!r}")

    def to_wire(self) -> dict[str, Any]:
        """The message's meta map (optional fields that are None are left out)."""
        meta = {r.name: getattr(self, r.name) for r in self.rules()
                if not (r.optional and getattr(self, r.name) is None)}
        return {**self.extra, **meta}

    @classmethod
    def from_wire(cls: type[R], meta: Any, where: str = "") -> R:
        """The record a received meta map holds; raises WireError (one line) when it holds anything else."""
        where = where or f"{cls.KIND!r} message"
        if not isinstance(meta, dict):
            raise WireError(f"{where}: meta is a {type(meta).__name__}, not a map")
        values: dict[str, Any] = {}
        for rule in cls.rules():
            if rule.name not in meta:
                if rule.optional:
                    continue
                raise WireError(f"{where} lacks meta field {rule.name!r}")
            if (problem := rule.problem(meta[rule.name])) is not None:
                raise WireError(f"{where}: {problem}")
            values[rule.name] = meta[rule.name]
        names = {r.name for r in cls.rules()}
        extra = {k: v for k, v in meta.items() if k not in names}
        if extra and not cls.OPEN:
            raise WireError(f"{where} carries unexpected meta field {sorted(extra)[0]!r}")
        return cls(**values, extra=extra)


R = TypeVar("R", bound=Record)


# The lifecycle of a run: hello (stage -> coordinator), welcome, start (built), state (resume), stop, error.


@dataclass(frozen=True, kw_only=True)
class Hello(Record):
    """A stage is up: which plan it runs, as which stage, which wire it speaks, its environment."""

    KIND: ClassVar[str] = "hello"
    OPEN: ClassVar[bool] = True
    STEPPED: ClassVar[bool] = False
    stage: int = check(low=0)
    input_hash: str
    wire_version: int = WIRE_VERSION
    pid: int | None = check(optional=True)
    env: dict[str, Any] | None = check(optional=True)


@dataclass(frozen=True, kw_only=True)
class Welcome(Record):
    """The coordinator's answer: the run's training settings and where training starts."""

    KIND: ClassVar[str] = "welcome"
    OPEN: ClassVar[bool] = True
    STEPPED: ClassVar[bool] = False
    train: dict[str, Any]
    start_step: int = check(low=0)
    resume: bool
    failure_timeout_s: float | None = check(optional=True, finite=True, low=0.0)
    eval_every: int | None = check(optional=True, low=0)
    # Held-out evaluation on the training stages (runtime/run/stage_eval.py): after every Nth step and the last,
    # ``stage_eval_rounds`` forward passes of a step's micro-batches through the first pipeline. None: not here.
    stage_eval_every: int | None = check(optional=True, low=1, high=1_000_000)
    stage_eval_rounds: int | None = check(optional=True, low=1, high=4096)


@dataclass(frozen=True, kw_only=True)
class Start(Record):
    """A stage is built and ready: its LoRA parameters' checkpoint keys (what a resume sends it)."""

    KIND: ClassVar[str] = "start"
    OPEN: ClassVar[bool] = True
    STEPPED: ClassVar[bool] = False
    stage: int = check(low=0)
    keys: list[str]
    build_s: float | None = check(optional=True)
    lora_params: int | None = check(optional=True, low=0)


@dataclass(frozen=True, kw_only=True)
class State(Record):
    """A stage's LoRA and optimizer state to resume from (tensors; meta as the checkpoint wrote it)."""

    KIND: ClassVar[str] = "state"
    OPEN: ClassVar[bool] = True
    STEPPED: ClassVar[bool] = False


@dataclass(frozen=True, kw_only=True)
class Stop(Record):
    """End the run (``reason``), or with ``checkpoint`` = N first send the state after N steps.

    With ``plan`` (runtime.elastic): the run goes on under that plan (plan.json's text), the ``replan``-th plan of
    the run; a stage started by `hetero worker` leaves it to its worker, which starts this host's stages of it."""

    KIND: ClassVar[str] = "stop"
    OPEN: ClassVar[bool] = True
    STEPPED: ClassVar[bool] = False
    reason: str | None = check(optional=True)
    checkpoint: int | None = check(optional=True, low=0)
    plan: str | None = check(optional=True)
    replan: int | None = check(optional=True, low=1, high=1_000_000)


@dataclass(frozen=True, kw_only=True)
class Error(Record):
    """A process failed: its one-line reason."""

    KIND: ClassVar[str] = "error"
    OPEN: ClassVar[bool] = True
    STEPPED: ClassVar[bool] = False
    message: str
    stage: int | None = check(optional=True, low=0)


@dataclass(frozen=True, kw_only=True)
class Heartbeat(Record):
    """I am alive (from a thread, so a process busy in torch still beats)."""

    KIND: ClassVar[str] = "heartbeat"
    OPEN: ClassVar[bool] = True
    STEPPED: ClassVar[bool] = False


# One optimizer step: data in, activations and gradients between stages, the global clip, reports.


@dataclass(frozen=True, kw_only=True)
class Batch(Record):
    """The step's input ids for a pipeline's first stage (tensor ``input_ids``)."""

    KIND: ClassVar[str] = "batch"


@dataclass(frozen=True, kw_only=True)
class Labels(Record):
    """The step's labels for a pipeline's last stage, and the whole step's label-token count."""

    KIND: ClassVar[str] = "labels"
    num_label_tokens: int = check(low=1)


@dataclass(frozen=True, kw_only=True)
class Act(Record):
    """One micro-batch's activation to the next stage (tensor ``h``)."""

    KIND: ClassVar[str] = "act"
    # The sender's wall clock (time.time()) as it handed the message to the wire: the receiver times the link.
    sent: float | None = check(optional=True, finite=True)
    # Interleaved programs: the receiving device's chunk of layers it is for (hetero/program.py); absent otherwise.
    chunk: int | None = check(optional=True, low=0)


@dataclass(frozen=True, kw_only=True)
class Grad(Record):
    """One micro-batch's input gradient to the previous stage (tensor ``g``)."""

    KIND: ClassVar[str] = "grad"
    sent: float | None = check(optional=True, finite=True)  # as Act's
    chunk: int | None = check(optional=True, low=0)  # as Act's


@dataclass(frozen=True, kw_only=True)
class GradNorm(Record):
    """A stage's squared LoRA gradient norm, for the global clip."""

    KIND: ClassVar[str] = "gradnorm"
    sumsq: float = check(finite=True, low=0.0)


@dataclass(frozen=True, kw_only=True)
class Clip(Record):
    """The global gradient norm and the clip coefficient every stage scales its gradients by."""

    KIND: ClassVar[str] = "clip"
    coef: float = check(finite=True, low=0.0, high=1.0)
    grad_norm: float = check(low=0.0)


@dataclass(frozen=True, kw_only=True)
class Grads(Record):
    """Replicas: a stage's LoRA gradients to the coordinator (float32 tensors under their PEFT keys)."""

    KIND: ClassVar[str] = "grads"


@dataclass(frozen=True, kw_only=True)
class Reduced(Record):
    """Replicas: the gradients summed across replicas (tensors), with the global norm and clip."""

    KIND: ClassVar[str] = "reduced"
    coef: float = check(finite=True, low=0.0, high=1.0)
    grad_norm: float = check(low=0.0)


@dataclass(frozen=True, kw_only=True)
class StepDone(Record):
    """What a stage measured in one step (the coordinator's metrics.jsonl line is made of these)."""

    KIND: ClassVar[str] = "stepdone"
    OPEN: ClassVar[bool] = True
    step: int = check(low=0)
    loss_sum: float | None  # last stage: the step's summed token cross-entropy
    num_label_tokens: int | None
    grad_sumsq: float = check(low=0.0)
    lr: float = check(finite=True)
    busy_s: float = check(finite=True)
    wall_s: float = check(finite=True)
    op_time_s: dict[str, float]
    op_cpu_s: dict[str, float] | None = check(optional=True)  # a CPU stage's process CPU seconds per op
    # Per received kind ("act", "grad"): the median seconds from the sender's hand-off to this stage holding the
    # message, over the step's messages it was already waiting for (runtime/stage/executor.py).
    link_s: dict[str, float] | None = check(optional=True)
    # The device's SM clock, temperature, power, throttle reasons after the step (runtime/stage/telemetry.py);
    # absent where there is no NVML/amdsmi (a CPU stage).
    telemetry: dict[str, Any] | None = check(optional=True)
    # A stage that streams weights from host RAM (plan stream_layers): the step's bytes copied host-to-device and
    # the most frozen-weight bytes it held on the device at once (runtime/stage/streaming.py); absent otherwise.
    streamed_bytes: int | None = check(optional=True, low=0)
    frozen_resident_peak_bytes: int | None = check(optional=True, low=0)


@dataclass(frozen=True, kw_only=True)
class Checkpoint(Record):
    """A stage's LoRA and optimizer state (tensors) with the checkpoint's meta."""

    KIND: ClassVar[str] = "checkpoint"
    OPEN: ClassVar[bool] = True


@dataclass(frozen=True, kw_only=True)
class Rebalance(Record):
    """Coordinator to every stage, before the step's clip: after this step, hold the node spans ``spans`` (one
    [first, last] per stage) with ``recompute`` (per stage, its recomputing layers' node names); send the state,
    rebuild, take the new state (runtime.rebalance; runtime/run/moves.py)."""

    KIND: ClassVar[str] = "rebalance"
    spans: list[list[int]]
    recompute: list[list[str]]
    reason: str


@dataclass(frozen=True, kw_only=True)
class Snapshot(Record):
    """Coordinator to every stage, before the step's clip (or reduced): after this step, send the state (the run's
    time-based checkpoint, runtime.snapshot_every_s), as after a step that ``payload_due`` names."""

    KIND: ClassVar[str] = "snapshot"


@dataclass(frozen=True, kw_only=True)
class EvalDone(Record):
    """A pipeline's last stage to the coordinator: one round of held-out rows forwarded after a step (evaluation on
    the training stages): their summed token cross-entropy and label tokens."""

    KIND: ClassVar[str] = "evaldone"
    loss_sum: float = check(finite=True, low=0.0)
    num_label_tokens: int = check(low=0)
    round: int = check(low=0, high=4096)


@dataclass(frozen=True, kw_only=True)
class Loss(Record):
    """A loss report (tests and tools; a run's loss travels in ``stepdone``)."""

    KIND: ClassVar[str] = "loss"
    OPEN: ClassVar[bool] = True


RECORDS: dict[str, type[Record]] = {r.KIND: r for r in (
    Hello, Welcome, Start, State, Stop, Error, Heartbeat,
    Batch, Labels, Act, Grad, GradNorm, Clip, Grads, Reduced, StepDone, Checkpoint, Rebalance, Snapshot, EvalDone,
    Loss,
)}
KINDS: frozenset[str] = frozenset(RECORDS)  # every kind a hetero process may send
UNSTEPPED: frozenset[str] = frozenset(kind for kind, r in RECORDS.items() if not r.STEPPED)


def record_type(kind: str) -> type[Record]:
    """The record of message kind ``kind``; WireError (one line) for a kind the protocol does not define."""
    try:
        return RECORDS[kind]
    except (KeyError, TypeError):
        raise WireError(f"unknown message kind {kind!r} (hetero.protocol defines {', '.join(sorted(KINDS))})") from None
