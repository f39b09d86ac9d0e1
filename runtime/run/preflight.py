"""What `hetero run` checks before it starts a stage process: each problem is one line within seconds,
not a stage error after the 15-45 s the stages take to import and build.

Cheapest first: the ``--resume`` checkpoint and the ``lora.init_from`` adapter (read whole, and
matched against the LoRA modules and shapes the plan's model has), this host's ports, whether the
run directory can be created, then the data (records, tokenizer, the first step's batch).
``prepare_run_dir`` then creates the run directory and writes plan.json and config.yaml.
"""

from __future__ import annotations

import errno
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hetero.errors import CheckpointError, ConfigError, HeteroError
from hetero.packing import steps_for_epochs
from hetero.plan import Plan
from hetero.runtime.base.rundir import check_creatable, check_free_space, create_run_dir, write_run_file
from hetero.runtime.wire.endpoints import EPHEMERAL_RANGE_FILE
from hetero.specs import MAX_COUNT

PEFT_PREFIX = "base_model.model."  # as in adapter.py (not imported: that module pulls in torch)
# Bytes per LoRA parameter: a checkpoint holds it in fp32 with AdamW's two fp32 moments; the adapter, fp32.
CHECKPOINT_BYTES_PER_PARAM, ADAPTER_BYTES_PER_PARAM = 12, 4


class PortBusyError(HeteroError):
    """A port this host must listen on is taken (by another run, usually)."""


@dataclass
class Checked:
    """What the checks read, handed on to the coordinator so that nothing is read twice."""

    resume: Path | None = None  # the checkpoint directory ``--resume`` means
    checkpoint: tuple[dict[str, Any], dict[str, Any]] | None = None  # its (tensors, meta), read whole
    batches: Any = None  # the run's StepBatches (data read and tokenized)
    plan: Plan | None = None  # the plan with train.steps counted from train.epochs (None: unchanged)


def preflight(plan: Plan, run_dir: Path, host: str | None = None, port: int | None = None,
              resume: Path | None = None, ports: bool = True) -> Checked:
    """Check everything that can fail before a stage starts; returns what was read on the way.

    ``ports``: the plan's ports are free (hetero's engine binds them; `--engine torch` binds none of them)."""
    from hetero.runtime.pretrained import resolve_dir

    model_dir = resolve_dir(plan.model)
    checked = Checked()
    if plan.train.epochs > 0:  # the run's length comes from the data: count it before anything compares with it
        checked.batches = make_batches(plan, model_dir)
        plan = checked.plan = with_epoch_steps(plan, checked.batches)
    if resume is not None:
        checked.resume, checked.checkpoint = _read_resume(resume, plan, model_dir)
    if plan.model.lora.init_from:
        check_init_from(plan, model_dir)
    if ports:
        check_ports(plan, host, port)
    check_creatable(run_dir)
    first_step = int(checked.checkpoint[1]["step"]) if checked.checkpoint is not None else 0
    checked.batches = check_data(plan, model_dir, first_step, checked.batches)
    return checked


def make_batches(plan: Plan, model_dir: Path) -> Any:
    """The run's StepBatches: its data read, its tokenizer loaded (records are tokenized as steps need them)."""
    from hetero.runtime.run.data import StepBatches

    train = plan.train
    return StepBatches(plan.data, model_dir, plan.model.seq_len, train.micro_batch_size, train.num_micro_batches,
                       train.seed, train.shuffle, hold_out=plan.eval.split)


def with_epoch_steps(plan: Plan, batches: Any) -> Plan:
    """train.epochs > 0: the plan with train.steps = the steps that train ``epochs`` passes over the data (its packed
    rows, or records, over micro_batch_size x num_micro_batches; hetero/packing.py steps_for_epochs), said in one
    line."""
    train = plan.train
    rows, per_step = int(batches.rows_per_epoch), batches.sequences_per_step
    steps = steps_for_epochs(train.epochs, rows, per_step)
    if steps > MAX_COUNT:
        raise ConfigError(f"train.epochs={train.epochs} of {rows} rows is {steps} steps, more than {MAX_COUNT}: lower "
                          "train.epochs")
    print(f"hetero run: train.epochs={train.epochs}: {train.epochs} x {rows} rows ({batches.num_records} records) at "
          f"{train.micro_batch_size} x {train.num_micro_batches} rows per step = {steps} steps", flush=True)
    return replace(plan, train=replace(train, steps=steps))


def _read_resume(path: Path, plan: Plan, model_dir: Path) -> tuple[Path, tuple[dict[str, Any], dict[str, Any]]]:
    from hetero.runtime.run.checkpoint import (
        check_state_settings,
        lora_from_payload,
        read_checkpoint,
        resolve_resume,
    )
    from hetero.runtime.stage.state import LORA
    from hetero.serde import to_dict

    directory = resolve_resume(path)
    check_state_settings(directory, to_dict(plan.model.lora), plan.model.architecture)
    # Every file is read whole and checked (dtypes, AdamW moments against their LoRA tensor: checkpoint.py), then
    # every LoRA tensor against this plan's model: a stage never waits for a state it would refuse.
    tensors, meta, files = read_checkpoint(directory)
    step = int(meta["step"])
    if step >= plan.train.steps:
        raise CheckpointError(f"{directory} is after step {step}, train.steps is {plan.train.steps}: raise it "
                              f"(hetero run ... steps=N) to train on")
    sources = {name[len(LORA):]: file for name, file in files.items() if name.startswith(LORA)}
    check_lora_state(lora_from_payload(tensors), plan, model_dir, f"checkpoint {directory}", sources)
    return directory, (tensors, meta)


def check_resume(path: Path, plan: Plan, model_dir: Path) -> tuple[Path, int]:
    """The checkpoint ``path`` means, read whole and matched with the plan; and the step it continues from."""
    directory, (_, meta) = _read_resume(path, plan, model_dir)
    return directory, int(meta["step"])


def check_init_from(plan: Plan, model_dir: Path) -> None:
    """``lora.init_from`` is a readable PEFT adapter with the plan's rank, targets and this model's modules."""
    from hetero.runtime.stage.adapter import load_adapter_state

    lora = plan.model.lora
    assert lora.init_from is not None
    state = load_adapter_state(Path(lora.init_from), lora)
    check_lora_state(state, plan, model_dir, f"lora.init_from '{lora.init_from}'")


def lora_shapes(plan: Plan, model_dir: Path) -> dict[str, tuple[int, int] | None]:
    """PEFT key -> shape of every LoRA tensor the plan's model trains (None where the base shape is unknown).

    A module gets LoRA when its name ends in one of lora.target_modules (PEFT's rule for a list);
    A is [r, in] and B is [out, r] of the base weight, read from the safetensors headers only.
    """
    lora = plan.model.lora
    targets = set(lora.target_modules)
    names = [n for node in plan.graph.nodes for n in node.param_names
             if n.endswith(".weight") and n[: -len(".weight")].rsplit(".", 1)[-1] in targets]
    base = _header_shapes(model_dir, names)
    shapes: dict[str, tuple[int, int] | None] = {}
    for name in names:
        module = PEFT_PREFIX + name[: -len(".weight")]
        shape = base.get(name, ())
        two_d = len(shape) == 2  # pre-quantized weights store packed shapes: nothing to compare with
        shapes[module + ".lora_A.weight"] = (lora.r, shape[1]) if two_d else None
        shapes[module + ".lora_B.weight"] = (shape[0], lora.r) if two_d else None
    return shapes


def _header_shapes(model_dir: Path, names: list[str]) -> dict[str, tuple[int, ...]]:
    """Shapes of ``names`` in the model's safetensors files (headers only: no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    from hetero.runtime.pretrained import weight_index

    index = weight_index(model_dir)
    by_file: dict[str, list[str]] = defaultdict(list)
    for name in names:
        if name in index:
            by_file[index[name]].append(name)
    shapes: dict[str, tuple[int, ...]] = {}
    for file, wanted in by_file.items():
        try:
            with safe_open(file, framework="pt") as f:
                for name in wanted:
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"model weights {file}: unreadable ({str(exc).splitlines()[0][:160]})") from None
    return shapes


def check_lora_state(state: dict[str, Any], plan: Plan, model_dir: Path, where: str,
                     files: dict[str, Path] | None = None) -> None:
    """``state`` (PEFT keys -> tensors) has a LoRA tensor of the right shape for every module the plan trains.

    ``files``: the file each key was read from, named by a shape error instead of ``where``."""
    expected = lora_shapes(plan, model_dir)
    if not expected:
        return  # a graph that names no weights (hand-edited plans): the stages check their own keys
    missing = [k for k in expected if k not in state]
    if missing:
        raise CheckpointError(f"{where} has no {missing[0]} ({len(missing)} of {len(expected)} LoRA tensors missing): "
                              "it was trained for another model or other lora.target_modules")
    # Decoder modules beyond the plan's (a deeper model, more targets); others (a tied head) are let through.
    extra = sorted(k for k in state if k not in expected and k.startswith(f"{PEFT_PREFIX}model.layers."))
    if extra:
        raise CheckpointError(f"{where} has {extra[0]}, a LoRA module this plan does not train: it was trained "
                              "for another model or other lora.target_modules")
    for key, shape in expected.items():
        got = tuple(state[key].shape)
        if shape is not None and got != shape:
            source = f"{files[key]}: tensor lora/{key}" if files and key in files else f"{where}: {key}"
            raise CheckpointError(f"{source} has shape {got}, this model's is {shape}: it was trained for another "
                                  "model or another lora.r; resume from a checkpoint of this model and lora.r")


def check_ports(plan: Plan, host: str | None, port: int | None) -> None:
    """Every port this host's processes will listen on (coordinator + local stages) is free now."""
    import zmq

    from hetero.runtime.run.coordinator import coordinator_endpoint
    from hetero.runtime.wire.endpoints import bind_address

    name = host or plan.stages[0].host
    wanted = [("the coordinator", coordinator_endpoint(plan, name, port))]
    wanted += [(f"stage {s.index}", s.endpoint) for s in plan.stages if s.host == name]
    warn_ephemeral(plan, name, wanted[0][1])
    ctx = zmq.Context(io_threads=1)
    sockets = []
    try:
        for who, endpoint in wanted:
            sock = ctx.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IPV6, 1)
            sockets.append(sock)
            # Bound like Transport binds it (and kept bound: two of our own endpoints on one port collide too).
            try:
                sock.bind(bind_address(endpoint))
            except zmq.ZMQError as exc:
                fix = "pass another --port" if who == "the coordinator" else "recompile with another base port"
                code = exc.errno or 0
                reason = os.strerror(code) if code in errno.errorcode else exc.strerror  # without zmq's suffix
                if code == errno.EADDRNOTAVAIL:  # not "busy": this machine is not that address
                    address = plan.cluster.host(name).address
                    others = [h.name for h in plan.cluster.hosts if h.name != name]
                    where = (f"run `hetero run` on {name} itself, or pass --host NAME for the host this machine is"
                             f" ({', '.join(others)})" if others and host is None else
                             f"run it on {name}")
                    raise PortBusyError(f"{who} cannot listen on {endpoint} ({reason}): this machine does not have "
                                        f"{name}'s address {address} (the fleet file's hosts.address): {where}, "
                                        "or correct the address and recompile") from None
                raise PortBusyError(f"{who} cannot listen on {endpoint} ({reason}): another process (another "
                                    f"run?) holds the port; stop it or {fix}") from None
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()


def warn_ephemeral(plan: Plan, host: str, coordinator: str | None = None, span: tuple[int, int] | None = None,
                   prog: str = "hetero run") -> list[int]:
    """Say on stderr, in one line, which ports ``host`` may listen on lie in this machine's ephemeral range (the ports
    returned; nothing said when none does): its stages' (in this plan, and in a re-plan: stage k of the host on its
    base port + k) and the ``coordinator`` endpoint's. A port in that range can be taken by a peer on this machine
    that dials it before the stage listens: the kernel hands the peer that port, it connects to itself, and the port
    stays taken for a minute (TIME_WAIT) after the failed handshake."""
    from hetero.runtime.wire.endpoints import endpoint_port, ephemeral_ports, ports_in

    span = span if span is not None else ephemeral_ports()
    base = plan.cluster.host(host).port
    stages = [endpoint_port(s.endpoint) for s in plan.stages if s.host == host]
    stages += [base + k for k in range(len(plan.stages))]
    listens = endpoint_port(coordinator or "tcp://*:*")  # base port - 1 unless `hetero run --port` moved it
    moved = [] if listens is None or listens == base - 1 else [listens]
    ours = ports_in([p for p in [*stages, listens] if p is not None and p not in moved], span)
    theirs = ports_in(moved, span)
    if span is None or not ours + theirs:
        return []
    fixes = ([f"the fleet file's hosts.{host}.port (then recompile)"] if ours else []) + (
        ["the coordinator's port (`hetero run --port`)"] if theirs else [])
    listed = ", ".join(map(str, sorted(set(ours + theirs))))
    print(f"{prog}: warning: port(s) {listed} of {host} lie in this machine's ephemeral range ({span[0]}-{span[1]}, "
          f"{EPHEMERAL_RANGE_FILE}): a peer here dialing one before its stage listens can be handed that very port "
          f"and hold it, so the stage may fail to listen; give {' and '.join(fixes)} a value below {span[0]} "
          f"(29500, the default, is)", file=sys.stderr, flush=True)
    return sorted(set(ours + theirs))


def check_data(plan: Plan, model_dir: Path, first_step: int, batches: Any = None) -> Any:
    """The data file reads, every record has the format's fields, and every step to run has a label token.

    Returns the checked StepBatches (``batches``, when already made), which the coordinator then feeds from."""
    train = plan.train
    batches = batches if batches is not None else make_batches(plan, model_dir)
    vocab = plan.model.architecture.get("vocab_size")
    batches.check(first_step, train.steps, vocab if isinstance(vocab, int) else None)
    return batches


def prepare_run_dir(plan: Plan, run_dir: Path, config_yaml: str) -> Path:
    """Create the run directory (logs/, checkpoints/), check its free space, write plan.json + config.yaml."""
    create_run_dir(run_dir)
    lora_params = sum(node.lora_params for node in plan.graph.nodes)
    checkpoint = CHECKPOINT_BYTES_PER_PARAM * lora_params
    adapter = ADAPTER_BYTES_PER_PARAM * lora_params
    check_free_space(run_dir, checkpoint + adapter + 2**20, "one checkpoint and the adapter")
    plan_path = write_run_file(run_dir, "plan.json", plan.to_json())
    write_run_file(run_dir, "config.yaml", config_yaml)
    return plan_path
