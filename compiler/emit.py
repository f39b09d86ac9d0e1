"""emit(plan, out_dir): write plan.json, one artifact directory per stage, and the two pictures.

Layout under ``out_dir``::

    plan.json
    artifacts/<host>/stage<k>/stage.json      # what stage k loads, receives, sends, runs
    artifacts/<host>/stage<k>/segment.py.txt  # stage k's slice of the traced fx graph, for a person
    placement.png, schedule.png               # unless the compile ran out of time (draw_pictures)

stage.json is a convenience view for the host that runs the stage (and for a person): the runtime's
source of truth stays plan.json, whose input_hash each stage.json repeats.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import fx

from hetero.errors import ConfigError, PlanError
from hetero.graph import LayerGraph, TensorSpec
from hetero.plan import Plan, StagePlan, check_plan
from hetero.planner.schedule.simulator import simulate_plan
from hetero.serde import to_dict
from hetero.specs import BYTES_PER_DTYPE

from .fxgraph import TracedModel, build_meta_model, trace_model

STAGE_SCHEMA_VERSION = 1
PICTURES = ("placement.png", "schedule.png")  # what emit draws after the artifacts, in this order
# Of the 5 s a compile may run past planner.time_limit_s (plus tracing, issue 22), the pictures may start
# within this many; the rest is for the last picture and the summary.
PICTURES_ALLOWANCE_S = 3.0
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def emit(plan: Plan, out_dir: str | Path, traced: TracedModel | None = None,
         pictures_by: float | None = None) -> list[Path]:
    """Write plan.json, per-stage artifacts and placement/schedule pictures; return the paths written.

    ``traced`` is the module `trace_with_module` returned for this plan's model; passing it spares
    building the meta model a second time (the slowest part of a compile). ``pictures_by``: a
    time.perf_counter() deadline past which no picture starts (draw_pictures).
    """
    out = Path(out_dir)
    _check_plan(plan)
    out.mkdir(parents=True, exist_ok=True)
    if traced is None:
        traced = trace_model(build_meta_model(plan.model, plan.graph.dtype))
    if len(traced.units) != len(plan.graph.nodes):
        raise PlanError(
            f"plan.json graph has {len(plan.graph.nodes)} nodes but model '{plan.model.name}' traces to "
            f"{len(traced.units)}: recompile with `hetero compile`"
        )
    written: list[Path] = []
    # A plan made by hand may leave a stage's folder out: it gets the one the planner would name.
    plan = replace(plan, stages=[s if s.artifact else replace(s, artifact=f"artifacts/{s.host}/stage{s.index}")
                                 for s in plan.stages])
    for stage in plan.stages:
        folder = out / stage.artifact
        folder.mkdir(parents=True, exist_ok=True)
        stage_json = folder / "stage.json"
        stage_json.write_text(json.dumps(stage_manifest(plan, stage.index), indent=1))
        segment = folder / "segment.py.txt"
        segment.write_text(segment_source(plan, stage.index, traced))
        written += [stage_json, segment]
    plan_path = out / "plan.json"
    plan.save(plan_path)
    return [plan_path, *written, *draw_pictures(plan, out, pictures_by)]


def draw_pictures(plan: Plan, out_dir: str | Path, by: float | None = None) -> list[Path]:
    """placement.png and schedule.png under ``out_dir``, each only if it would start before ``by`` (a
    time.perf_counter() deadline; None: always); returns the ones drawn.

    A picture not drawn leaves no older one behind: it would show another plan.
    """
    drawn: list[Path] = []
    for name in PICTURES:
        path = Path(out_dir) / name
        path.unlink(missing_ok=True)
        if by is not None and time.perf_counter() >= by:
            continue
        from . import pictures  # matplotlib only when drawing (its import alone takes a second)

        if name == "placement.png":
            pictures.draw_placement(plan, path)
        else:
            pictures.draw_schedule(plan, simulate_plan(plan), path)  # the one simulation of the emitted plan
        drawn.append(path)
    return drawn


def _check_plan(plan: Plan) -> None:
    """Every pipeline's stages tile the graph's nodes in order (plan.check_plan), and hosts must be
    usable as folder names."""
    for stage in plan.stages:
        if not _SAFE_NAME.match(stage.host) or stage.host in (".", ".."):
            raise ConfigError(
                f"host name {stage.host!r} cannot be a folder name: use letters, digits, '.', '_', '-'"
            )
    check_plan(plan, "plan")


def stage_params(graph: LayerGraph, stage: StagePlan) -> list[str]:
    """The state-dict names stage ``stage`` loads, in node order, each once (tied weights dedup)."""
    names: list[str] = []
    for i in stage.nodes():  # every chunk's, under an interleaved schedule
        names += [p for p in graph.nodes[i].param_names if p not in names]
    return names


def _wire(tensor: TensorSpec, wire_dtype: str) -> dict[str, Any]:
    """A boundary tensor as the wire carries it: the sender's compute dtype, bytes rescaled to it."""
    scale = BYTES_PER_DTYPE[wire_dtype] / BYTES_PER_DTYPE.get(tensor.dtype, BYTES_PER_DTYPE[wire_dtype])
    floating = tensor.dtype in ("float32", "bfloat16", "float16")
    return {
        "name": tensor.name,
        "shape": tensor.shape,
        "traced_dtype": tensor.dtype,
        "wire_dtype": wire_dtype if floating else tensor.dtype,
        "bytes_per_token": tensor.bytes_per_token * (scale if floating else 1.0),
    }


def _peer(plan: Plan, k: int | None) -> dict[str, Any] | None:
    if k is None:
        return None
    s = plan.stages[k]
    return {"stage": k, "host": s.host, "device": s.device, "endpoint": s.endpoint, "dtype": s.dtype}


def _neighbours(plan: Plan, k: int) -> tuple[int | None, int | None]:
    """The stages before and after stage k in its pipeline replica; under an interleaved schedule a ring (the last
    device hands on to the first device's next chunk)."""
    prev, nxt = plan.prev_stage(k), plan.next_stage(k)
    if plan.stages[k].chunks:
        prev = prev if prev is not None else len(plan.stages) - 1
        nxt = nxt if nxt is not None else 0
    return prev, nxt


def stage_manifest(plan: Plan, k: int) -> dict[str, Any]:
    """The stage.json contents of stage ``k``."""
    stage, graph = plan.stages[k], plan.graph
    receives = graph.edges[stage.first_node - 1].tensors if stage.first_node > 0 else []
    sends = graph.edges[stage.last_node].tensors if stage.last_node < len(graph.nodes) - 1 else []
    prev, nxt = _neighbours(plan, k)
    prev_dtype = plan.stages[prev].dtype if prev is not None else stage.dtype
    nodes = [graph.nodes[i] for i in stage.nodes()]
    params = stage_params(graph, stage)
    spans = stage.spans()
    return {
        "schema_version": STAGE_SCHEMA_VERSION,
        "input_hash": plan.input_hash,
        "hetero_version": plan.hetero_version,
        "stage": k,
        "num_stages": len(plan.stages),
        "host": stage.host,
        "device": stage.device,
        "device_type": stage.device_type,
        "backend": stage.backend,
        "threads": stage.threads,
        "dtype": stage.dtype,
        "quantization": stage.quantization,
        "model": {
            "name": plan.model.name,
            "model_type": plan.model.model_type,
            "pretrained": plan.model.pretrained,
        },
        "lora": to_dict(plan.model.lora),
        "nodes": [n.name for n in nodes],
        "first_node": stage.first_node,
        "last_node": stage.last_node,
        "params": params,
        "num_params": sum(n.num_params for n in nodes),
        "lora_params": sum(n.lora_params for n in nodes),
        # The stage reads the token ids (first stage) / labels (last stage) from the data itself.
        "reads_input_ids": stage.first_node == 0,
        "computes_loss": any(last == len(graph.nodes) - 1 for _, last in spans),
        # Under an interleaved schedule, the device's further chunks (receives and sends above: its first's).
        "chunks": [{"first_node": c.first_node, "last_node": c.last_node, "nodes": c.node_names} for c in stage.chunks],
        "receives": [_wire(t, prev_dtype) for t in receives if not t.recomputed],
        "sends": [_wire(t, stage.dtype) for t in sends if not t.recomputed],
        "rebuilds": sorted({t.name for t in receives if t.recomputed}),
        "endpoint": stage.endpoint,
        "prev": _peer(plan, prev),
        "next": _peer(plan, nxt),
        # The links' hand-offs on the wire (planner.compression): from the previous stage, and to the next.
        "compression": {"in": plan.stages[prev].compress_out if prev is not None
                        else plan.stages[-1].compress_out if stage.chunks else "none",  # the ring, interleaved
                        "out": stage.compress_out},
        "schedule": plan.train.schedule,
        "micro_batch_size": plan.train.micro_batch_size,
        "num_micro_batches": plan.micro_batches_of(k),
        "seq_len": plan.model.seq_len,
        "program": list(stage.program),
        "predicted": {"fwd_time_s": stage.fwd_time_s, "bwd_time_s": stage.bwd_time_s, "send_time_s": stage.send_time_s,
                      "memory_gb": stage.memory.total_gb, "available_gb": stage.memory.available_gb},
    }


def segment_source(plan: Plan, k: int, traced: TracedModel) -> str:
    """Stage ``k``'s slice of the traced fx graph as Python, with a header saying what crosses its edges (under an
    interleaved schedule, each of its chunks' slices in turn)."""
    stage = plan.stages[k]
    code = [_span_source(plan.graph, traced, first, last) for first, last in stage.spans()]
    manifest = stage_manifest(plan, k)
    header = [
        f"# Stage {k} of {len(plan.stages)} on {stage.host}/{stage.device} ({stage.device_type}), "
        f"{stage.dtype}, quantization {stage.quantization}",
        f"# Nodes: {', '.join(manifest['nodes'])}",
        f"# Receives: {', '.join(_describe(t) for t in manifest['receives']) or 'input_ids from the data'}",
        f"# Sends:    {', '.join(_describe(t) for t in manifest['sends']) or 'nothing (computes the loss)'}",
        f"# Rebuilds locally: {', '.join(manifest['rebuilds']) or 'nothing'}",
        "# Read-only view of the traced torch.fx graph (modules stay the Hugging Face ones).",
    ]
    if len(code) > 1:
        code = [f"# Chunk {c}: nodes {a}..{b}\n{src}" for c, ((a, b), src) in enumerate(zip(stage.spans(), code,
                                                                                           strict=True))]
    return "\n".join(header) + "\n" + "\n\n".join(code) + "\n"


def _span_source(graph: LayerGraph, traced: TracedModel, first: int, last: int) -> str:
    """Nodes ``first``..``last`` of the traced fx graph as Python: what they receive become placeholders."""
    nodes = list(traced.module.graph.nodes)
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    incoming: fx.Node | None = None
    if first > 0:
        # What the previous stage sends (the non-recomputed tensors of the cut) become placeholders.
        sent = {t.name for t in graph.edges[first - 1].tensors if not t.recomputed}
        for node in nodes:
            owner = traced.owner[node.name]
            if (
                owner < first
                and node.op == "call_module"
                and node.name not in traced.recomputed
                and _live_after(node, traced, first)
            ):
                name = "hidden_states" if "hidden_states" in sent else node.name
                env[node] = incoming = sub.placeholder(name)

    def needed(node: fx.Node) -> bool:
        owner = traced.owner[node.name]
        if node.op == "output" or node in env or (node.op == "placeholder" and first > 0):
            return False
        if first <= owner <= last:
            return True
        # Helpers made on an earlier stage that this stage rebuilds (rotary cos/sin).
        return node.name in traced.recomputed and any(
            first <= traced.owner[u.name] <= last or u.name in traced.recomputed for u in node.users
        )

    keep = [n for n in nodes if needed(n)]
    for node in keep:
        # A rebuilt helper reads earlier values only for shape/dtype/device: the received tensor has them.
        env[node] = sub.node_copy(node, lambda a: env[a] if a in env else incoming)
        env[node].type = None  # annotations would print as fx-internal names (_torch_Tensor_)
    outputs = [
        env[n]
        for n in keep
        if any(traced.owner[u.name] > last for u in n.users) and n.name not in traced.recomputed
    ]
    if last == len(graph.nodes) - 1:
        outputs = [env[next(n for n in keep if n.op == "call_module" and n.target == "head")]]
    sub.output(outputs[0] if len(outputs) == 1 else tuple(outputs))
    return sub.python_code(root_module="self").src.strip("\n")


def _live_after(node: fx.Node, traced: TracedModel, first: int) -> bool:
    return any(traced.owner[u.name] >= first for u in node.users)


def _describe(t: dict[str, Any]) -> str:
    shape = ", ".join(str(d) for d in t["shape"])
    return f"{t['name']} [{shape}] {t['wire_dtype']}"
