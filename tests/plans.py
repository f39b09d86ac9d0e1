"""Support for the runtime tests (a module of helpers, not of tests): hand-built plans (no compiler or ILP
needed), free loopback ports, and a threaded driver that trains stages built in this process.

``make_plan`` places the tiny model on local CPU stages with a given split of decoder layers and
free loopback ports: the runtime is tested on exactly what it reads from a compiled plan.
"""

from __future__ import annotations

import json
import random
import socket
from dataclasses import replace
from pathlib import Path

import torch

from hetero.graph import CutEdge, LayerGraph, LayerNode, TensorSpec
from hetero.plan import (
    ChunkPlan,
    MemoryBreakdown,
    Plan,
    Prediction,
    ReplicaPlan,
    SolverReport,
    StagePlan,
    compute_input_hash,
)
from hetero.planner.schedule.schedules import interleaved_one_f_one_b
from hetero.planner.schedule.step_form import programs_for
from hetero.program import format_program
from hetero.protocol import BASE_PORT
from hetero.runtime.stage.memory import kept_bytes
from hetero.runtime.stage.model import Stage
from hetero.runtime.wire.endpoints import ephemeral_ports
from hetero.runtime.wire.transport import Transport
from hetero.specs import (
    ClusterSpec,
    DataSpec,
    DeviceSpec,
    HostSpec,
    LinkSpec,
    LoraSpec,
    ModelSpec,
    PlannerOptions,
    TrainSpec,
)

PORT_BLOCK = 64  # ports apart: a host's stage k listens on its first port + k, in a re-plan too


def free_ports(n: int) -> list[int]:
    """n free TCP ports on loopback, PORT_BLOCK apart, below this machine's ephemeral range (bound then released;
    fine for tests). Each one's block is free: the port below it (a host's coordinator listens on its base port - 1)
    and the next n - 1 (a re-planned run puts stage k of the host on its first port + k).

    Below the ephemeral range: a port the kernel may hand to an outgoing connection can be taken by a peer dialing
    it before its stage listens (the peer connects to itself; CI met it in a rejoin)."""
    assert 0 < n < PORT_BLOCK, n
    span = ephemeral_ports()
    top = min(span[0] if span is not None else 32768, BASE_PORT - PORT_BLOCK)  # clear of BASE_PORT's runs too
    bottom = max(1024, top // 3)
    if top - PORT_BLOCK * n <= bottom + 1:  # a machine whose ephemeral range starts low: take the rare race
        bottom, top = 10_000, 60_000
    rng = random.Random()
    for _ in range(100):
        base = rng.randrange(bottom, top - PORT_BLOCK * n)
        ports = [base + 1 + PORT_BLOCK * i for i in range(n)]
        socks: list[socket.socket] = []
        try:
            for p in ports:
                for q in range(p - 1, p + n):
                    s = socket.socket()
                    socks.append(s)
                    s.bind(("127.0.0.1", q))  # OSError when taken
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return ports
    raise RuntimeError(f"no {n} free blocks of loopback ports below {top}")


def _graph(model: ModelSpec, state_keys: list[str]) -> LayerGraph:
    arch = model.architecture
    n_layers = int(arch["num_hidden_layers"])
    nodes = [LayerNode("embed", "embedding", [k for k in state_keys if "embed_tokens" in k], 0, 0, 0, 0, 0, 0, 0)]
    for i in range(n_layers):
        keys = [k for k in state_keys if k.startswith(f"model.layers.{i}.")]
        nodes.append(LayerNode(f"layers.{i}", "decoder", keys, 0, 0, 0, 0, 0, 0, 0))
    nodes.append(LayerNode("norm", "norm", ["model.norm.weight"], 0, 0, 0, 0, 0, 0, 0))
    nodes.append(LayerNode("head", "head", ["lm_head.weight"], 0, 0, 0, 0, 0, 0, 0))
    hidden = int(arch["hidden_size"])
    edges = [CutEdge(nd.name, [TensorSpec("hidden_states", ["batch", "seq", hidden], "float32", 4.0 * hidden)])
             for nd in nodes[:-1]]
    return LayerGraph(model.name, model.model_type, model.seq_len, "float32", model.quantization,
                      hidden, int(arch["vocab_size"]), n_layers, nodes, edges=edges)


def make_plan(
    model_dir: Path,
    architecture: dict,
    split: list[int],
    *,
    train: TrainSpec | None = None,
    lora: LoraSpec | None = None,
    seq_len: int = 32,
    quantization: str = "none",
    hosts: list[str] | None = None,
    dtypes: list[str] | None = None,
    recompute: str = "none",
    shares: list[int] | None = None,
    packing: bool = True,
) -> Plan:
    """A valid plan for the model in ``model_dir``: stage k holds ``split[k]`` decoder layers on CPU.

    ``recompute``: "full" makes every decoder layer recompute its forward in backward.
    ``shares``: data x pipeline replicas; ``split`` is then one split per replica, and replica r runs
    ``shares[r]`` of the step's micro-batches (summing to train.num_micro_batches). ``packing``: data.packing."""
    from safetensors import safe_open

    keys: list[str] = []
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            keys += list(h.keys())
    model = ModelSpec(name="tiny", architecture=dict(architecture), pretrained=str(model_dir), dtype="float32",
                      quantization=quantization, lora=lora or LoraSpec(), seq_len=seq_len)
    train = train or TrainSpec(micro_batch_size=2, num_micro_batches=4, steps=3)
    graph = _graph(model, keys)
    splits = [split] if shares is None else list(split)  # type: ignore[list-item]
    counts = [len(sp) for sp in splits]
    num_stages = sum(counts)
    host_of = hosts or ["localhost"] * num_stages
    ports = free_ports(num_stages)
    devices_of: dict[str, list[DeviceSpec]] = {}
    first_port: dict[str, int] = {}
    for k, h in enumerate(host_of):
        first_port.setdefault(h, ports[k])
        devices_of.setdefault(h, []).append(DeviceSpec(f"{h}.cpu{k}", h, "cpu", k, "cpu", "CPU", 8.0, 50.0,
                                                       {"float32": 1.0, "float16": 1.0, "bfloat16": 1.0}, False,
                                                       True, threads=1))
    host_specs = {h: HostSpec(h, "127.0.0.1", first_port[h], devices) for h, devices in devices_of.items()}
    names = list(host_specs)
    links = [LinkSpec(a, b, 10.0) for i, a in enumerate(names) for b in names[i + 1:]]
    cluster = ClusterSpec("test", list(host_specs.values()), links)
    stages: list[StagePlan] = []
    replicas: list[ReplicaPlan] = []
    micro = shares or [train.num_micro_batches]
    for r, rsplit in enumerate(splits):
        programs = programs_for(train.schedule, len(rsplit), micro[r])
        replicas.append(ReplicaPlan(list(range(len(stages), len(stages) + len(rsplit))), micro[r], sum(micro[:r]),
                                    0.1 * len(rsplit)))
        first = 0
        for pos, n in enumerate(rsplit):
            k = len(stages)
            last = first + n - (0 if pos < len(rsplit) - 1 else -2)  # the last stage also takes norm + head
            if pos == 0:
                last += 1  # the first stage also takes the embedding
            stages.append(StagePlan(
                index=k, host=host_of[k], device=f"{host_of[k]}.cpu{k}", device_type="cpu", backend="cpu",
                dtype=(dtypes or ["float32"] * num_stages)[k], quantization=quantization,
                first_node=first, last_node=last - 1, node_names=[nd.name for nd in graph.nodes[first:last]],
                endpoint=f"tcp://127.0.0.1:{ports[k]}", threads=1, fwd_time_s=0.01, bwd_time_s=0.02,
                send_time_s=0.001, memory=MemoryBreakdown(0.1, 0.01, 0.01, 0.5, 0.62, 7.0),
                program=format_program(programs[pos]),
                recompute_layers=[nd.name for nd in graph.nodes[first:last] if nd.kind == "decoder"]
                if recompute == "full" else []))
            first = last
        assert first == len(graph.nodes), "split must cover every decoder layer"
    prediction = Prediction(0.1 * num_stages, train.micro_batch_size * train.num_micro_batches * seq_len,
                            1000.0, 0.2, [0.8] * num_stages, [0.62] * num_stages)
    solver = SolverReport("manual", "Optimal", "Optimal Solution Found", True, 0.0, 0.1, 0.0, 0.0)
    plan = Plan(model, cluster, train, DataSpec(packing=packing), PlannerOptions(split=split if shares is None else None,
                                                                 recompute=recompute), graph, stages,
                prediction, [], solver, ["hand-built test plan"], replicas=replicas if shares is not None else [])
    return replace(plan, input_hash=compute_input_hash(plan))


def run_in_threads(stages: list, plan: Plan, batches, steps: int, on_step=None, prepare=None, start_step: int = 0,
                   executors_out: list | None = None, coefs_out: list | None = None) -> list[float]:
    """Train ``stages`` (built in this process) for ``steps`` steps, one thread per stage, over real
    Transports on loopback, with this thread as the coordinator; returns the per-step losses.

    ``on_step(k, executor)`` runs in stage k's thread just before its optimizer step (grads are there);
    ``prepare(k, executor)`` runs once before training (e.g. to restore a checkpoint); ``coefs_out`` gets each
    step's clip coefficient.
    """
    from hetero.runtime.stage.executor import COORDINATOR, Executor, stage_name

    n = len(stages)
    names = [stage_name(k) for k in range(n)]
    coord = Transport(COORDINATOR, "tcp://127.0.0.1:0", plan.input_hash, recv_timeout_s=120)
    wires = [Transport(names[k], "tcp://127.0.0.1:0", plan.input_hash, recv_timeout_s=120) for k in range(n)]
    for k, w in enumerate(wires):
        coord.connect(names[k], w.endpoint)
        w.connect(COORDINATOR, coord.endpoint)
        if k > 0:
            w.connect(names[k - 1], wires[k - 1].endpoint)
        if k < n - 1:
            w.connect(names[k + 1], wires[k + 1].endpoint)
    from hetero.program import parse_program

    executors = [Executor(s, parse_program(plan.stages[k].program), wires[k], plan.train) for k, s in enumerate(stages)]
    for k, ex in enumerate(executors):
        if prepare is not None:
            prepare(k, ex)
    if executors_out is not None:
        executors_out.extend(executors)
    if on_step is not None:
        for k, ex in enumerate(executors):
            if ex.optimizer is not None:
                ex.optimizer.register_step_pre_hook(lambda opt, a, kw, k=k, ex=ex: on_step(k, ex))
    try:
        losses, coefs = drive(executors, wires, coord, batches, steps, plan.train.max_grad_norm, start_step)
    finally:
        for w in [*wires, coord]:
            w.close()
    if coefs_out is not None:
        coefs_out.extend(coefs)
    return losses


def drive(executors: list, wires: list, coord, batches, steps: int, max_grad_norm: float,
          start: int = 0) -> tuple[list[float], list[float]]:
    """Train ready-made executors (anything with ``run_step``: an Executor, a ChunkedExecutor), one thread each,
    for steps ``start``..``steps``, with ``coord`` as the coordinator: the batch to the first, the labels to the
    last, the clip coefficient from every stage's gradient norm; returns (per-step losses, clip coefficients)."""
    import math
    import threading

    from hetero.protocol import Clip
    from hetero.runtime.stage.executor import COORDINATOR, stage_name

    names = [stage_name(k) for k in range(len(executors))]
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for step in range(start, steps):
                stats = executors[k].run_step(step)
                wires[k].send(COORDINATOR, "stepdone", step=step, meta=stats.to_meta())
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(len(executors))]
    for t in threads:
        t.start()
    losses, coefs = [], []
    try:
        for step in range(start, steps):
            batch = batches.step(step)
            inputs = {"input_ids": batch.input_ids}
            if batch.position_ids is not None:  # packed rows: as the coordinator sends them
                inputs["position_ids"] = batch.position_ids
            coord.send(names[0], "batch", step=step, tensors=inputs)
            coord.send(names[-1], "labels", step=step, tensors={"labels": batch.labels},
                       meta={"num_label_tokens": batch.num_label_tokens})
            sumsq = sum(coord.recv("gradnorm", step=step).meta["sumsq"] for _ in names)
            coef = min(1.0, max_grad_norm / (math.sqrt(sumsq) + 1e-6)) if max_grad_norm > 0 else 1.0
            coefs.append(coef)
            for name in names:  # as the coordinator sends it: the record the stages read (hetero.protocol.Clip)
                coord.send(name, Clip(coef=coef, grad_norm=math.sqrt(sumsq)), step=step)
            done = [coord.recv("stepdone", step=step) for _ in names]
            last = next(d for d in done if d.sender == names[-1])
            losses.append(last.meta["loss_sum"] / batch.num_label_tokens)
    finally:
        for t in threads:
            t.join(timeout=30 if not errors else 1)
    if errors:
        raise errors[0]
    return losses, coefs


def _repeating_data(tmp_path: Path, n: int) -> DataSpec:
    """n short records: with M*B == n and no shuffle, every step sees the same batch (loss must fall)."""
    path = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": f"the number {i} is followed by {i + 1} and then {i + 2}"}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return DataSpec(path=str(path), format="text")


def kept_per_token(stage: Stage, hidden: int, seq: int) -> float:
    kept = {}
    for batch in (2, 4):
        x = torch.randn(batch, seq, hidden, dtype=stage.dtype)
        kept[batch] = kept_bytes(lambda x=x: stage.forward(x.clone().requires_grad_()))
    return (kept[4] - kept[2]) / (2 * seq) / len(stage.layout.layers)


def interleave(plan: Plan, num_devices: int) -> Plan:
    """A hand-built plan of p x v one-chunk stages (tests/plans.py make_plan) folded into p devices of v
    chunks: virtual stage c x p + d becomes device d's chunk c, each device runs its interleaved program."""
    virtual = plan.stages
    chunks = len(virtual) // num_devices
    programs = interleaved_one_f_one_b(num_devices, plan.train.num_micro_batches, chunks)
    stages = [replace(virtual[d], program=format_program(programs[d]), chunks=[
        ChunkPlan(s.first_node, s.last_node, list(s.node_names), s.fwd_time_s, s.bwd_time_s, s.send_time_s,
                  list(s.recompute_layers)) for s in virtual[d + num_devices::num_devices]]) for d in range(num_devices)]
    folded = replace(plan, stages=stages)
    return replace(folded, input_hash=compute_input_hash(folded))


SEQ_LEN = 32


TRAIN = TrainSpec(micro_batch_size=2, num_micro_batches=4, steps=4, lr=2e-3, scheduler="cosine", warmup_steps=1,
                  max_grad_norm=0.3, seed=3, shuffle=True)


RTOL = 1e-4
