"""Declared inputs: the model (ModelSpec), the fleet (ClusterSpec), training and planner options.

These are frozen dataclasses, built once from the Hydra config at the CLI edge (hetero/config.py) and
stored verbatim in plan.json; a changed copy is made with ``dataclasses.replace``. No torch, no pulp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hetero.errors import ConfigError
from hetero.protocol import BASE_PORT
from hetero.serde import short_repr

Backend = Literal["cuda", "rocm", "mps", "cpu"]
Quantization = Literal["none", "nf4", "int8"]
DType = Literal["float32", "bfloat16", "float16"]

BYTES_PER_DTYPE: dict[str, float] = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "float64": 8.0}
# Bytes per quantized decoder Linear weight, shared by the compiler's LayerGraph and the planner's
# memory model. bitsandbytes NF4 packs two 4-bit codes per byte plus one fp32 absmax per block of 64
# weights (+4/64; double quantization would shave most of that, we do not count on it); LLM.int8
# keeps one byte per weight and an fp32 scale per row (negligible for rows of >= 1k weights).
QUANT_BYTES_PER_PARAM: dict[str, float] = {"nf4": 0.5 + 4 / 64, "int8": 1.0}


@dataclass(frozen=True)
class DeviceType:
    """Datasheet facts about one kind of device (one file in hardware_specs/)."""

    name: str  # key, the file's stem: "rtx5090"
    display_name: str  # "NVIDIA GeForce RTX 5090"
    vendor: str  # nvidia | amd | apple | cpu
    backend: Backend
    memory_gb: float  # decimal GB, as datasheets state it
    memory_bandwidth_gbs: float  # GB/s
    tflops_fp32: float  # dense, no sparsity
    tflops_fp16: float  # dense tensor-core fp16 with fp32 accumulate where the sheet says so
    tflops_bf16: float  # 0 when unsupported
    bf16: bool
    nf4: bool = True  # bitsandbytes 4-bit kernels available on this backend
    source: str = ""  # where the numbers come from
    # Host-to-device copy bandwidth, GB/s one way (PCIe generation x lanes as the sheet states it; 0: not stated).
    # What streaming a layer's frozen weights from host RAM costs (planner.offload, docs/memory.md).
    host_link_gbs: float = 0.0


@dataclass(frozen=True)
class DeviceSpec:
    """One device of the fleet: datasheet numbers, possibly overridden by the fleet file."""

    name: str  # unique within the fleet, e.g. "box1.gpu0"
    host: str
    type: str  # DeviceType.name
    index: int  # torch device index on its host (cpu: ordinal of the stage process)
    backend: Backend
    display_name: str
    memory_gb: float
    memory_bandwidth_gbs: float
    tflops: dict[str, float]  # {"float32": .., "float16": .., "bfloat16": ..}
    bf16: bool
    nf4: bool
    threads: int | None = None  # cpu stages: torch.set_num_threads
    # Host-to-device GB/s one way for weight streaming (datasheet, fleet file ``host_link_gbs:``, or a profile);
    # None: not known, and this device does not stream.
    host_link_gbs: float | None = None
    overrides: list[str] = field(default_factory=list)  # which numbers the fleet file overrode

    def compute_dtype(self, requested: str = "auto") -> str:
        """The dtype this device computes in: the requested one if it can, else its best."""
        if self.backend == "cpu":
            return "float32" if requested == "auto" else requested
        if requested == "bfloat16" and not self.bf16:
            return "float16"
        if requested != "auto":
            return requested
        return "bfloat16" if self.bf16 else "float16"

    def quantization(self, requested: str) -> str:
        """The quantization this device applies: nf4 falls back to none where unsupported."""
        if requested == "nf4" and not self.nf4:
            return "none"
        return requested


@dataclass(frozen=True)
class SshSpec:
    """How `hetero run` starts a host's `hetero worker` over ssh (docs/fleet.md). How to reach a host,
    not placement: outside the plan's input hash and the profile's fleet hash."""

    target: str  # [user@]host as `ssh` takes it (or a Host alias of ~/.ssh/config)
    port: int | None = None  # ssh -p
    identity: str | None = None  # ssh -i: a private key file on this host
    options: list[str] = field(default_factory=list)  # ssh -o KEY=VALUE, each
    python: str = "python3"  # the interpreter on that host that has hetero installed
    plan_dir: str | None = None  # that host's copy of the plan's directory (None: the same path as here)


def check_ssh(ssh: SshSpec, where: str, error: type[Exception]) -> None:
    """Raise ``error`` naming the first ssh setting ssh would misread (an option where a name belongs)."""
    if not ssh.target or ssh.target.startswith("-") or any(c.isspace() for c in ssh.target):
        raise error(f"{where}.target must be [user@]host (no spaces, not starting with '-'), "
                    f"got {short_repr(ssh.target)}")
    if ssh.port is not None and not (isinstance(ssh.port, int) and 1 <= ssh.port <= 65535):
        raise error(f"{where}.port must be a port number (1-65535), got {short_repr(ssh.port)}")
    for key in ("identity", "python", "plan_dir"):
        value = getattr(ssh, key)
        if value is not None and (not value or value.startswith("-") or "\n" in value or "\0" in value):
            raise error(f"{where}.{key} must be a path (not empty, not starting with '-'), got {short_repr(value)}")
    for i, option in enumerate(ssh.options):
        key, sep, _ = option.partition("=")
        if not sep or not key.isalnum():
            raise error(f"{where}.options[{i}] must be KEY=VALUE as for `ssh -o` (e.g. ConnectTimeout=5), "
                        f"got {short_repr(option)}")


@dataclass(frozen=True)
class HostSpec:
    name: str
    address: str = "127.0.0.1"  # where the other hosts reach this one
    port: int = BASE_PORT  # first port; stage k on this host listens on port + k
    devices: list[DeviceSpec] = field(default_factory=list)
    ssh: SshSpec | None = None  # `hetero run` starts this host's worker over ssh (None: by hand)
    # CPU cores its CPU stages share (fleet file ``cores:``; else this machine's count where a CPU stage took its
    # threads from it; None: not known). Stages whose threads exceed it compute in turns (planner/schedule/simulator.py).
    cores: int | None = None
    # Of those, what its CPU stages got in a measured run (a profile's ``host_cores``; the rest went to the OS, the
    # sockets' I/O threads and the coordinator). Set by the planner from a profile; None: all of them.
    usable_cores: float | None = None
    # Host memory hetero may use for streamed weights, GB (fleet file ``ram_gb:``; None: none, nothing streams
    # from this host). The frozen weights its stages keep in host RAM must fit in it.
    ram_gb: float | None = None


@dataclass(frozen=True)
class LinkSpec:
    """A network path between two hosts (symmetric)."""

    a: str
    b: str
    bandwidth_gbps: float  # gigabits per second, as NICs are sold
    latency_us: float = 100.0

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8


@dataclass(frozen=True)
class ClusterSpec:
    """The fleet: hosts with their devices, and the links between hosts."""

    name: str
    hosts: list[HostSpec]
    links: list[LinkSpec] = field(default_factory=list)
    # Two devices on one host talk over PCIe / shared memory; loopback for CPU stages.
    intra_host_bandwidth_gbps: float = 128.0
    intra_host_latency_us: float = 20.0

    @property
    def devices(self) -> list[DeviceSpec]:
        return [d for h in self.hosts for d in h.devices]

    def device(self, name: str) -> DeviceSpec:
        for d in self.devices:
            if d.name == name:
                return d
        raise KeyError(name)

    def host(self, name: str) -> HostSpec:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def link(self, host_a: str, host_b: str) -> LinkSpec:
        """The link between two hosts; same host gives the intra-host path."""
        if host_a == host_b:
            return LinkSpec(host_a, host_b, self.intra_host_bandwidth_gbps, self.intra_host_latency_us)
        for link in self.links:
            if {link.a, link.b} == {host_a, host_b}:
                return link
        raise KeyError(f"no link between hosts '{host_a}' and '{host_b}'")


@dataclass(frozen=True)
class LoraSpec:
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    init_from: str | None = None  # an existing PEFT adapter directory to start from


@dataclass(frozen=True)
class ModelSpec:
    """What to train: architecture (HF config dict), where weights live, dtype, quantization, LoRA."""

    name: str
    architecture: dict[str, Any]  # an HF config.json as a dict (must hold model_type)
    pretrained: str | None = None  # hub id or local dir; only `hetero run` reads weights
    dtype: str = "auto"  # auto = bf16 where supported, fp16 on older GPUs, fp32 on CPU
    quantization: Quantization = "none"
    lora: LoraSpec = field(default_factory=LoraSpec)
    seq_len: int = 2048
    # auto | sdpa | eager | flash_attention_2 | flex_attention (hetero/families.py ATTENTION_CHOICES; docs/data.md)
    attn_implementation: str = "auto"
    # A mixture of experts: grouped | eager (hetero/families.py EXPERTS_CHOICES; docs/models.md)
    experts_implementation: str = "grouped"

    @property
    def model_type(self) -> str:
        return str(self.architecture.get("model_type", ""))


@dataclass(frozen=True)
class TrainSpec:
    """Training keys. Those in RUNTIME_OVERRIDABLE may change at `hetero run` without recompiling."""

    micro_batch_size: int = 1
    num_micro_batches: int = 8
    schedule: str = "1f1b"  # a registered step form: hetero/program.py SCHEDULES (check_ranges checks it)
    steps: int = 100
    # Epochs over the data instead of a step count (0: train.steps counts): `hetero run` trains
    # epochs x steps per epoch (docs/data.md); train.steps is then not used.
    epochs: int = 0
    lr: float = 2e-4
    weight_decay: float = 0.0
    scheduler: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    seed: int = 0
    shuffle: bool = True
    checkpoint_every: int = 0  # optimizer steps between checkpoints, 0 = only at the end


RUNTIME_OVERRIDABLE = frozenset(
    {"steps", "epochs", "lr", "weight_decay", "scheduler", "warmup_steps", "max_grad_norm", "seed", "shuffle",
     "checkpoint_every"}
)


@dataclass(frozen=True)
class DataSpec:
    path: str | None = None  # JSONL / JSON / Parquet file; None = the bundled demo set (alpaca)
    format: Literal["text", "alpaca", "tokens", "chat"] = "alpaca"  # docs/data.md
    text_field: str = "text"  # text: the field holding the text (chat reads 'messages')
    train_on_prompt: bool = False  # alpaca, chat: also compute loss on the prompt (non-assistant) tokens
    packing: bool = True  # several records per row, attention kept inside each (false: one record per row, padded)


@dataclass(frozen=True)
class EvalSpec:
    """Evaluation on held-out data (docs/running.md): every ``every`` optimizer steps the training stages forward the
    held-out rows between steps, or, with ``device``, an evaluator process on that device (kept out of training)
    computes the held-out loss of the latest adapter while training goes on; metrics.jsonl gets an ``eval_loss``
    line for that step. All keys may change at `hetero run` (eval.every=N ...)."""

    every: int = 0  # evaluate every N optimizer steps (0: off); the last step is always evaluated
    path: str | None = None  # held-out data, in data.format (this or split when every > 0)
    split: float = 0.0  # instead of path: this fraction of data.path's records, held out of training (0: none)
    device: str | None = None  # a fleet device kept out of training (compile) / used to evaluate (run);
    # None: the training stages evaluate, between steps (runtime/run/stage_eval.py)
    max_batches: int = 8  # held-out micro-batches (of train.micro_batch_size sequences) per evaluation


@dataclass(frozen=True)
class PlannerOptions:
    num_stages: int | None = None  # force this many stages (None: the solver chooses)
    split: list[int] | None = None  # manual: number of decoder layers per stage, in device order
    devices: list[str] | None = None  # manual: device names in pipeline order (with split)
    time_limit_s: float = 30.0
    efficiency: float = 0.4  # fraction of datasheet TFLOPS a training step reaches (roofline)
    memory_headroom: float = 0.1  # fraction of device memory kept free (allocator, CUDA context)
    workspace_gb: float = 0.5  # per-device fixed overhead beyond weights/activations
    # Activation recomputation: auto (the solver chooses, per stage, how many decoder layers re-run
    # their forward in backward), none, or full (every decoder layer).
    recompute: Literal["auto", "none", "full"] = "auto"
    # Weight streaming: auto (the solver chooses, per stage, how many decoder layers keep their frozen weights in
    # host RAM and stream them to the device before each use), none, or full (every decoder layer of every stage).
    offload: Literal["auto", "none", "full"] = "auto"
    # Data x pipeline: how many pipeline replicas (None: the solver chooses; 1: one pipeline). With
    # num_stages, that many stages per replica.
    replicas: int | None = None
    # Hand-offs between stages (activations forward, their gradients back) in 8 or 4 bits: none, int8 (per-tile
    # scales) or int4 (Hadamard-rotated tiles) on every link; or auto: int8 on each link between hosts where the
    # planner predicts it faster (runtime/wire/compress.py).
    compression: Literal["none", "int8", "int4", "auto"] = "none"
    # The schedule's chunked form (1F1B: interleaved 1F1B, two chunks of layers per device; planner/schedule/step_form.py,
    # planner/search/interleave.py): auto (planned where it simulates faster and fits), off, or always (wherever it can
    # run; no replica search).
    interleave: Literal["auto", "off", "always"] = "auto"
    # Devices of the fleet left out of training (their names), without a manual split: a card worth under 5 %
    # that costs a network hop, a box you want for something else. The verdict names such cards.
    exclude: list[str] = field(default_factory=list)


# Upper bounds past any real run, that keep the planner's work and float arithmetic finite: each stage's
# program has a few actions per micro-batch, and costs scale with sequence length and batch size.
MAX_MICRO_BATCHES = 4096
MAX_TOKENS = 2**24  # seq_len, and micro_batch_size * seq_len
MAX_COUNT = 2**53  # steps and other counters: exact as floats


def check_ranges(model: ModelSpec, train: TrainSpec, planner: PlannerOptions, error: type[Exception]) -> None:
    """Raise ``error`` naming the first number out of its range: one rule book for configs and plan files."""
    from hetero.program import SCHEDULES  # each a step form of planner/schedule/step_form.py

    if train.schedule.lower() not in SCHEDULES:  # as step_form reads it
        raise error(f"train.schedule must be one of {list(SCHEDULES)}, got {short_repr(train.schedule)}")
    for key, value, high in [
        ("model.seq_len", model.seq_len, MAX_TOKENS),
        ("lora.r", model.lora.r, 2**16),
        ("train.micro_batch_size", train.micro_batch_size, MAX_TOKENS),
        ("train.num_micro_batches", train.num_micro_batches, MAX_MICRO_BATCHES),
    ]:
        _require(key, value, error, low=0, low_open=True, high=high)
    if train.micro_batch_size * model.seq_len > MAX_TOKENS:
        raise error(f"train.micro_batch_size * model.seq_len must be at most {MAX_TOKENS} tokens, got "
                    f"{train.micro_batch_size} * {model.seq_len}")
    for key, value in [("train.steps", train.steps), ("train.epochs", train.epochs),
                       ("train.warmup_steps", train.warmup_steps), ("train.checkpoint_every", train.checkpoint_every)]:
        _require(key, value, error, low=0, high=MAX_COUNT)
    _require("train.seed", train.seed, error, low=-MAX_COUNT, high=MAX_COUNT)
    for key, number in [("train.lr", train.lr), ("train.weight_decay", train.weight_decay),
                        ("train.max_grad_norm", train.max_grad_norm), ("planner.workspace_gb", planner.workspace_gb)]:
        _require(key, number, error, low=0, high=1e30)
    _require("lora.alpha", model.lora.alpha, error, low=-1e30, high=1e30)
    _require("lora.dropout", model.lora.dropout, error, low=0, high=1, high_open=True)
    _require("planner.time_limit_s", planner.time_limit_s, error, low=0, low_open=True, high=1e9)
    if planner.replicas is not None:
        _require("planner.replicas", planner.replicas, error, low=1, high=train.num_micro_batches,
                 hint=" (each replica needs at least one of train.num_micro_batches)")
        if planner.replicas > 1 and planner.interleave == "always":
            raise error(f"planner.interleave=always and planner.replicas={planner.replicas}: interleaved chunks do "
                        "not form replicas yet; set planner.interleave=auto (or off), or planner.replicas=1")
    _require("planner.efficiency", planner.efficiency, error, low=0, low_open=True, high=1,
             hint=" (a share of datasheet TFLOPS)")
    _require("planner.memory_headroom", planner.memory_headroom, error, low=0, high=1, high_open=True)
    if planner.num_stages is not None:
        _require("planner.num_stages", planner.num_stages, error, low=1, high=MAX_COUNT)
    for n in planner.split or []:
        _require(f"planner.split {short_repr(planner.split)}: each stage's layer count", n, error, low=1,
                 high=MAX_COUNT)


def _require(key: str, value: float, error: type[Exception], *, low: float, high: float, low_open: bool = False,
             high_open: bool = False, hint: str = "") -> None:
    if isinstance(value, float) and not math.isfinite(value):  # (an int of any size compares exactly)
        problem = "must be a finite number"
    elif value < low or (low_open and value == low):
        problem = "must be positive" if low == 0 and low_open else "must be zero or more" if low == 0 else \
            f"must be at least {low:g}"
    elif value > high or (high_open and value == high):
        bound = str(int(high)) if float(high).is_integer() and high < 1e16 else f"{high:g}"
        problem = f"must be below {bound}" if high_open else f"must be at most {bound}"
    else:
        return
    raise error(f"{key} {problem}{hint}, got {short_repr(value)}")


def check_run_length(train: TrainSpec, overrides: list[str], where: str = "") -> None:
    """train.epochs > 0 sets the run's length; train.steps given beside it on the same command line is a mistake
    (in a config file, epochs win: `hetero compile` says how many steps they make)."""
    steps = next((o for o in overrides if o.lstrip("+~").partition("=")[0].strip() in ("train.steps", "steps")), None)
    if train.epochs > 0 and steps is not None:
        raise ConfigError(f"{steps} and train.epochs={train.epochs}{where} both set the run's length: give one "
                          "(train.epochs=0 trains train.steps steps)")


def check_eval(evaluation: EvalSpec, cluster: ClusterSpec | None = None) -> None:
    """eval.* as one-line ConfigErrors: a step count, a held-out file when on, a device of the fleet."""
    if evaluation.every < 0 or evaluation.max_batches < 1:
        raise ConfigError(f"eval.every must be >= 0 and eval.max_batches >= 1, got {evaluation.every} and "
                          f"{evaluation.max_batches}")
    if not 0 <= evaluation.split <= 0.5:  # a fraction of the records: at most half held out
        raise ConfigError(f"eval.split must be in 0..0.5 (a fraction of the records), got {evaluation.split}")
    if evaluation.split > 0 and evaluation.path:
        raise ConfigError(f"eval.split={evaluation.split} and eval.path={evaluation.path}: hold out records of the "
                          "training data or evaluate on a file, not both")
    if evaluation.every > 0 and not evaluation.path and not evaluation.split:
        raise ConfigError(f"eval.every={evaluation.every} needs held-out data: set eval.split=0.1 (a tenth of the "
                          "training records, kept out of training) or eval.path=FILE (same format as data.format)")
    if evaluation.path and not Path(evaluation.path).expanduser().is_file():
        raise ConfigError(f"eval.path={evaluation.path}: no such file")
    if cluster is not None and evaluation.device is not None:
        names = [d.name for d in cluster.devices]
        if evaluation.device not in names:
            raise ConfigError(f"eval.device={evaluation.device} is not a device of fleet '{cluster.name}': "
                              f"choose one of {', '.join(names)}")
        if len(names) < 2:
            raise ConfigError(f"eval.device={evaluation.device} would leave fleet '{cluster.name}' no device to "
                              "train on")
