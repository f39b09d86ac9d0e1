"""What a run measured, as a profile (hetero/profile.py's schema): RUN_DIR/profile.json, torch-free.

Written at every checkpoint and at the end of `hetero run`; `hetero compile ... profile=RUN_DIR` plans
with it. What a run can measure, and how each number is made:

- **Layer times per device and kind.** A stage runs its span of layers as one forward and one
  backward per micro-batch; the executor times those (metrics.jsonl ``stage_ops``: F and B per
  step), not each layer. Timing each layer inside the stage would take hooks on every module and on
  the autograd graph of every micro-batch; the stage totals are free and are exactly what the
  planner's per-stage sums must reproduce. So per device the forward and backward per micro-batch
  (trimmed mean over the steps after the first) are divided among the layers the stage ran in the
  proportions of a prior — the profile the plan was compiled with where it covers the device (the
  relative cost of an embedding, a decoder layer, a norm and the head was measured there), else the
  roofline — i.e. one measured speed factor per device and direction scales the prior's per-kind
  fits. The stage's own sum is then exact; what is assumed is only the ratio between kinds on one
  device. A kind the device did not run is the prior scaled by the same factor, and says so.
- **Messages.** The CPU time to send one (SA, SG: asynchronous sends, timed alone) per device. A
  receive's wall time includes the wait for its sender; its process CPU time does not (a blocked
  wait takes none), so on a CPU stage one receive's cost is the CPU time in RA and RG per receive.
  Elsewhere it comes from the prior profile when it has one (else the roofline), and the file says so.
- **Links.** Every activation and gradient carries its sender's hand-off time (``sent``, wall clock);
  a stage that was already waiting when it came notes how long it took to arrive (metrics.jsonl
  ``stage_links``). Less the sender's encode and the receiver's decode (charged by the simulator as
  SA/SG and RA/RG), that is the link's transfer. Hosts' clocks differ by an unknown offset, but it
  adds to one direction what it takes from the other: activations and gradients of one cut are the
  same bytes over the same (symmetric) link, so the mean of the two directions is the transfer with
  the offset gone. One message size per cut gives one point per link: the prior's (profile, else the
  fleet file's) latency and bandwidth are scaled together to pass through it.
- **The optimizer step.** STEP minus the wait for the global clip coefficient, against the stage's
  LoRA parameters.
- **A host with fewer cores than its CPU stages' threads** (the plan's fleet says so: three one-thread
  stages on two cores): the stages compute in turns, and a wall time includes the waits for a core. The
  simulator adds those waits itself (planner/schedule/simulator.py, CoreShare), so for such a stage F, B and the
  optimizer come from the process CPU time the stage records (``stage_cpu_ops``) divided by its threads,
  when that is the smaller: the stage's own work, as on a host of its own. The file says so.

Each part of a device is labelled (``DeviceProfile.sources``) so a plan's ``cost_sources`` says
"run RUN_DIR, step N" for what came from this run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hetero.plan import Plan, StagePlan
from hetero.profile import (
    LAYER_KINDS,
    SHARED_CORES_NOTE,
    DeviceProfile,
    LayerProfile,
    LinearFit,
    LinkProfile,
    Profile,
    ProfileError,
    check_profile,
    fleet_hash,
    merge_profiles,
    model_hash,
    now_iso,
    typical,
)
from hetero.runtime.base.rundir import write_run_file
from hetero.runtime.run.metrics_file import StepLine

PROFILE_FILE = "profile.json"
SEND_OPS = ("SA", "SG")
RECV_OPS = ("RA", "RG")
MIN_CORE_SHARE = 0.25  # a shared host's stages are never said to get less than this share of its cores
CORE_BISECTIONS = 16
MIN_TRANSFER_S = 1e-6  # a link's transfer is never taken below this (hand-off minus encode and decode can be ~0)


def write_run_profile(plan: Plan, run_dir: Path, result: Any) -> Path | None:
    """RUN_DIR/profile.json from the steps so far (``result``: the coordinator's RunResult); a failure is a
    warning on stderr, never the run's end."""
    try:
        profile = run_profile(plan, run_dir, list(result.steps), dict(result.environments))
        if profile is None:
            return None
        import json

        from hetero.serde import to_dict

        return write_run_file(run_dir, PROFILE_FILE, json.dumps(to_dict(profile), indent=1))
    except Exception as exc:  # the profile is a by-product: training and its records come first
        print(f"hetero run: could not write {run_dir / PROFILE_FILE}: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)
        return None


def run_profile(plan: Plan, run_dir: Path, steps: list[StepLine],
                environments: dict[str, Any] | None = None) -> Profile | None:
    """The profile of what these metrics.jsonl lines measured (None: no step with per-stage times)."""
    split = _split(plan)  # a rebalanced run: only the steps run with the plan's current split
    lines = [s for s in steps if len(s.stage_ops) == len(plan.stages) and (s.split is None or s.split == split)]
    if not lines:
        return None
    done = lines[-1].step
    origin = f"run {Path(run_dir).resolve()}, step {done}"
    prior = prior_profile(plan)
    warm = lines[1:] if len(lines) > 1 else lines  # the first step warms allocators and caches up
    shared = shared_core_stages(plan)
    timed_cpu = {k for k in shared if cpu_ops(warm, k) is not None}  # own_ops: CPU time per thread there
    devices = [_device_profile(plan, k, own_ops(warm, k, plan.stages[k].threads) if k in shared else _stage_ops(warm, k),
                               cpu_ops(warm, k), prior, origin + (SHARED_NOTE if k in timed_cpu else ""),
                               (environments or {}).get(f"stage{k}", {}), k in timed_cpu)
               for k in range(len(plan.stages))]
    measured = run_links(plan, warm, prior, origin)
    links = measured + ([replace_method(lk, prior) for lk in prior.links
                         if not any({lk.a, lk.b} == {m.a, m.b} for m in measured)] if prior is not None else [])
    tokens = plan.train.micro_batch_size * plan.model.seq_len
    return Profile(
        fleet=plan.cluster.name, fleet_hash=fleet_hash(plan.cluster), model=plan.model.name,
        model_hash=model_hash(plan.model), devices=devices, links=links, created=now_iso(), origin=origin,
        host_cores=usable_cores(plan, warm, shared),
        notes=[f"measured by `hetero run` over steps {warm[0].step}-{done} ({len(warm)} steps), "
               f"micro_batch_size={plan.train.micro_batch_size}, seq_len={plan.model.seq_len} ({tokens} tokens)",
               f"kind split from: {prior.origin or 'a profile file' if prior else 'the roofline (no profile)'}; links the "
               "run timed: from its messages' hand-off times"],
    )


def run_links(plan: Plan, lines: list[StepLine], prior: Profile | None, origin: str) -> list[LinkProfile]:
    """Per host pair whose messages the run timed, the link as measured (see the module docstring)."""
    points: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for rep in plan.pipelines:
        for a, b in zip(rep.stages, rep.stages[1:], strict=False):
            both = [t for t in (_delivery(lines, b, "act"), _delivery(lines, a, "grad")) if t is not None]
            if not both:
                continue
            sa, sb = plan.stages[a], plan.stages[b]
            if sa.compress_out != "none":  # its messages carry other bytes, and encode/decode in their CPU times
                continue
            num_bytes = _message_bytes(plan, sa)
            own = (_per_message(lines, a, sa, ("SA", "RG")) + _per_message(lines, b, sb, ("SG", "RA"))) / 2
            key = (min(sa.host, sb.host), max(sa.host, sb.host))
            points.setdefault(key, []).append((num_bytes, max(MIN_TRANSFER_S, sum(both) / len(both) - own)))
    links = []
    for (ha, hb), pts in points.items():
        num_bytes, seconds = pts[0][0], typical([t for _, t in pts])
        shape = prior.link(ha, hb) if prior is not None else None
        bandwidth, latency_us = ((shape.bandwidth_gbps, shape.latency_us) if shape is not None and shape.bandwidth_gbps > 0
                                 else (plan.cluster.link(ha, hb).bandwidth_gbps, plan.cluster.link(ha, hb).latency_us))
        before = latency_us * 1e-6 + num_bytes * 8 / (bandwidth * 1e9)
        s = seconds / before if before > 0 else 1.0
        links.append(LinkProfile(ha, hb, bandwidth / s, latency_us * s, [[float(num_bytes), float(seconds)]],
                                 f"{origin} (message hand-off times, both directions averaged)"))
    return links


def _of_stage(values: list[Any] | None, k: int) -> Any:
    """Stage k's entry of a per-stage list of a step line (None where the line has none)."""
    return values[k] if values is not None and k < len(values) else None


def _delivery(lines: list[StepLine], k: int, kind: str) -> float | None:
    """Stage k's typical hand-off-to-held seconds for received ``kind`` over the steps that timed one."""
    got = [float(links[kind]) for line in lines
           if (links := _of_stage(line.stage_links, k)) is not None and kind in links]
    return typical(got) if got else None


def _per_message(lines: list[StepLine], k: int, sp: StagePlan, ops: tuple[str, str]) -> float:
    """Stage k's own seconds for one message: its send (``ops[0]``, wall: an asynchronous send is CPU) plus one
    receive of the other direction (``ops[1]``, CPU time where recorded, else nothing)."""
    count = {op: sum(1 for a in sp.actions() if a.op == op) for op in ops}
    wall, cpu = _stage_ops(lines, k), cpu_ops(lines, k) or {}
    send = wall.get(ops[0], 0.0) / count[ops[0]] if count[ops[0]] else 0.0
    recv = cpu.get(ops[1], 0.0) / count[ops[1]] if count[ops[1]] else 0.0
    return send + recv


def replace_method(link: LinkProfile, prior: Profile) -> LinkProfile:
    """A prior profile's link, saying where it came from (a run's totals do not separate transfers from waits)."""
    from dataclasses import replace

    where = prior.origin or "the profile the plan was compiled with"
    method = link.method if "(from " in link.method else f"{link.method} (from {where})"
    return replace(link, method=method)


def prior_profile(plan: Plan) -> Profile | None:
    """The profile(s) the plan was compiled with, merged, when still readable and of this fleet and model."""
    found: list[Profile] = []
    for path in str(plan.cost_sources.get("profile", "")).split(" + "):
        if not path:
            continue
        try:
            profile = Profile.load(path)
            check_profile(profile, plan.cluster, plan.model, path)
        except ProfileError:
            continue  # moved or of another fleet: the roofline stands in
        found.append(profile)
    return merge_profiles(found) if found else None


def _split(plan: Plan) -> list[int]:
    """Decoder layers per stage (what metrics.jsonl's ``split`` records for each step)."""
    nodes = plan.graph.nodes
    return [sum(1 for i in s.nodes() if nodes[i].kind == "decoder") for s in plan.stages]


def _stage_ops(lines: list[StepLine], k: int) -> dict[str, float]:
    """Stage k's typical seconds per op per step over these metrics lines."""
    ops = {op for line in lines for op in line.stage_ops[k]}
    return {op: typical([float(line.stage_ops[k].get(op, 0.0)) for line in lines]) for op in ops}


SHARED_NOTE = SHARED_CORES_NOTE  # in the sources, for a reader; DeviceProfile.cpu_time for the planner


def shared_core_stages(plan: Plan) -> set[int]:
    """The stages whose host has fewer cores than its stages' threads (they compute in turns)."""
    from hetero.planner.schedule.simulator import plan_core_share

    out: set[int] = set()
    for rep in plan.pipelines:
        share = plan_core_share(plan, list(rep.stages))
        if share is not None:
            out |= {k for k, g in zip(rep.stages, share.group, strict=True) if g >= 0}
    return out


def cpu_ops(lines: list[StepLine], k: int) -> dict[str, float] | None:
    """Stage k's typical process CPU seconds per op per step (None: some step has none: not a CPU stage, or an
    older stage)."""
    cpu = [c for line in lines if (c := _of_stage(line.stage_cpu_ops, k)) is not None]
    if not cpu or len(cpu) < len(lines):
        return None
    return {op: typical([float(c.get(op, 0.0)) for c in cpu]) for op in {op for c in cpu for op in c}}


def own_ops(lines: list[StepLine], k: int, threads: int | None) -> dict[str, float]:
    """Stage k's ops with its compute, sends and optimizer as its own work: the process CPU time per thread where
    the stage recorded it and it is below the wall time (which includes waiting for a core)."""
    ops, cpu = _stage_ops(lines, k), cpu_ops(lines, k)
    if cpu is None:
        return ops  # no CPU times: the wall times stand
    n = max(1, threads or 1)
    for op in ("F", "B", *SEND_OPS):
        if op in ops and op in cpu:
            ops[op] = min(ops[op], cpu[op] / n)
    if "STEP" in ops and "STEP" in cpu:  # the optimizer's own time: the wall minus the clip wait, or the CPU time
        own = ops["STEP"] - ops.get("clip_wait", 0.0)
        ops["STEP"] = ops.get("clip_wait", 0.0) + min(own, cpu["STEP"] / n)
    ops.update({f"{op}_own": cpu[op] for op in RECV_OPS if op in cpu})  # a receive's own CPU (planner's replay_run)
    return ops


def usable_cores(plan: Plan, lines: list[StepLine], shared: set[int]) -> dict[str, float]:
    """Per host whose stages share too few cores, the cores they got: the capacity at which the simulator, replaying
    each stage's own work from these steps, takes as long as the steps took (the rest of the host went to the OS,
    the sockets' I/O threads and the coordinator). A host where the replay is not faster than the run keeps all."""
    from hetero.planner.schedule.simulator import replay_run

    steps = [line.step_time_s for line in lines]
    if not shared or not steps:
        return {}
    measured = typical(steps)
    timings = [own_ops(lines, k, plan.stages[k].threads) if k in shared else _stage_ops(lines, k)
               for k in range(len(plan.stages))]
    out: dict[str, float] = {}
    for host in sorted({plan.stages[k].host for k in shared}):
        cores = float(next(h.cores for h in plan.cluster.hosts if h.name == host) or 1)

        def step(c: float, host: str = host) -> float:
            return replay_run(plan, timings, decontended=True, usable={host: c}).step_time_s

        lo, hi = cores * MIN_CORE_SHARE, cores
        if step(hi) >= measured or step(lo) <= measured:
            out[host] = hi if step(hi) >= measured else lo
            continue
        for _ in range(CORE_BISECTIONS):  # the step grows as the cores shrink
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if step(mid) > measured else (lo, mid)
        out[host] = round((lo + hi) / 2, 3)
    return out


def _receive_fit(plan: Plan, sp: StagePlan, cpu: dict[str, float] | None, before: DeviceProfile | None
                 ) -> LinearFit | None:
    """One receive's CPU time (decode, and the socket's I/O thread) against its bytes: measured where the stage
    recorded its CPU time in RA and RG (a blocked wait takes none), else the prior profile's."""
    prior = before.message_recv if before is not None else None
    ops = [a.op for a in sp.actions() if a.op in RECV_OPS]
    if cpu is None or not ops or not any(op in cpu for op in ops):
        return prior
    per_recv = sum(cpu.get(op, 0.0) for op in set(ops)) / len(ops)
    return scaled(prior, _message_bytes(plan, sp), per_recv, through_origin=False)


def _micro_batches(plan: Plan, k: int) -> int:
    """Micro-batches stage k runs per step (its replica's share)."""
    return max(1, plan.replica_of(k)[1].num_micro_batches)


def scaled(prior: LinearFit | None, x: float, y: float, *, through_origin: bool) -> LinearFit:
    """A line through the measured point (x, y): the prior's shape scaled to it when there is one, else a
    line through the origin (compute: proportional to tokens) or a flat one (fixed costs)."""
    if prior is not None and prior.at(x) > 0:
        s = y / prior.at(x)
        return LinearFit(prior.a_s * s, prior.b_s_per_token * s, prior.r2, [[float(x), float(y)]])
    if through_origin and x > 0:
        return LinearFit(0.0, y / x, 1.0, [[float(x), float(y)]])
    return LinearFit(y, 0.0, 1.0, [[float(x), float(y)]])


def _device_profile(plan: Plan, k: int, ops: dict[str, float], cpu: dict[str, float] | None, prior: Profile | None,
                    origin: str, env: dict[str, Any], cpu_time: bool) -> DeviceProfile:
    """Stage k's device as this run measured it (see the module docstring); ``cpu_time``: ``ops`` are process CPU
    time per thread."""
    sp = plan.stages[k]
    tokens = plan.train.micro_batch_size * plan.model.seq_len
    before = prior.device(sp.device) if prior is not None else None
    if before is not None and (before.dtype, before.quantization) != (sp.dtype, sp.quantization):
        before = None  # measured in another dtype/quantization: its kind split is not this stage's
    m = _micro_batches(plan, k)
    layers, sources = _layers(plan, sp, before, ops.get("F", 0.0) / m, ops.get("B", 0.0) / m, origin)
    optimizer, send = _stage_overheads(plan, sp, ops, before)
    sources.update({"optimizer": origin, "message_send": origin})
    recv = _receive_fit(plan, sp, cpu, before)
    if recv is not None and cpu is not None and any(op in cpu for op in RECV_OPS):
        sources["message_recv"] = origin + " (CPU time)"
    elif recv is not None and prior is not None:
        sources["message_recv"] = prior.origin or "profile"
    prev = plan.prev_stage(k)
    if prev is None and sp.chunks:  # interleaved: the first device's later chunks take the last device's hand-offs
        prev = len(plan.stages) - 1
    if sp.compress_out != "none" or (prev is not None and plan.stages[prev].compress_out != "none"):
        # Its messages were compressed: their CPU times hold encode/decode and their bytes are not a plain send's.
        # What a plain message costs stays what was known before this run (the planner adds the codec itself).
        send, recv = (before.message_send, before.message_recv) if before is not None else (None, None)
        kept = (prior.origin or "profile") if before is not None and prior is not None else "not measured"
        sources.update({"message_send": f"{kept} (this run's hand-offs were compressed)",
                        "message_recv": f"{kept} (this run's hand-offs were compressed)"})
    return DeviceProfile(
        device=sp.device, host=sp.host, type=sp.device_type, backend=sp.backend, dtype=sp.dtype,
        quantization=sp.quantization, threads=sp.threads, usable_memory_gb=None, seq_len=plan.model.seq_len,
        token_counts=[tokens], layers=layers, optimizer=optimizer, message_send=send, message_recv=recv,
        environment=dict(env), seconds=sum(float(v) for op, v in ops.items() if op in ("F", "B", "STEP")),
        cpu_time=cpu_time,
        measured_with=list(dict.fromkeys(  # its host's CPU stages ran beside it (every replica's)
            s.device for s in plan.stages if sp.backend == "cpu" and s.backend == "cpu" and s.host == sp.host
            and s.device != sp.device)),
        sources={**sources, **({"codec_encode": prior.origin or "profile"}
                               if prior is not None and before and before.codec_encode else {})},
        # A run does not time the codec apart from its messages: the prior profile's figures stay.
        codec_encode=dict(before.codec_encode) if before is not None else {},
        codec_decode=dict(before.codec_decode) if before is not None else {},
    )


def _node_priors(plan: Plan, sp: StagePlan, before: DeviceProfile | None) -> dict[str, tuple[LinearFit, LinearFit]]:
    """Per layer kind, the prior's (forward, backward) fits on this stage's device: the profile's, else the
    roofline's as a line through the origin at this micro-batch size."""
    from hetero.planner.model.cost_model import RooflineCostModel

    tokens = plan.train.micro_batch_size * plan.model.seq_len
    roofline = RooflineCostModel(plan.planner.efficiency)
    device = plan.cluster.device(sp.device)
    out: dict[str, tuple[LinearFit, LinearFit]] = {}
    for i, node in enumerate(plan.graph.nodes):
        if node.kind in out:
            continue
        layer = before.layers.get(node.kind) if before is not None else None
        if layer is not None:
            out[node.kind] = (layer.fwd, layer.bwd)
        else:
            f, b = roofline.node_time_s(plan.graph, plan.model, i, device, tokens)
            out[node.kind] = (LinearFit(0.0, f / tokens, 1.0), LinearFit(0.0, b / tokens, 1.0))
    return out


def _layers(plan: Plan, sp: StagePlan, before: DeviceProfile | None, fwd_mb: float, bwd_mb: float,
            origin: str) -> tuple[dict[str, LayerProfile], dict[str, str]]:
    """Per kind, the prior's fits scaled so the stage's layers sum to its measured forward and backward."""
    tokens = plan.train.micro_batch_size * plan.model.seq_len
    priors = _node_priors(plan, sp, before)
    nodes = [plan.graph.nodes[i] for i in sp.nodes()]
    recompute = set(sp.recompute_layers).union(*(c.recompute_layers for c in sp.chunks))
    prior_f = sum(priors[n.kind][0].at(tokens) for n in nodes)
    # A recomputing layer runs its forward again inside the backward: the measured B includes it.
    prior_b = sum(priors[n.kind][1].at(tokens) + (priors[n.kind][0].at(tokens) if n.name in recompute
                                                   else 0.0) for n in nodes)
    speed_f = fwd_mb / prior_f if prior_f > 0 and fwd_mb > 0 else 1.0
    speed_b = bwd_mb / prior_b if prior_b > 0 and bwd_mb > 0 else 1.0
    ran = {n.kind for n in nodes}
    layers: dict[str, LayerProfile] = {}
    sources: dict[str, str] = {}
    for kind in LAYER_KINDS:
        if kind not in priors:
            continue
        f, b = priors[kind]
        fit_f = scaled(f, tokens, f.at(tokens) * speed_f, through_origin=True)
        fit_b = scaled(b, tokens, b.at(tokens) * speed_b, through_origin=True)
        layers[kind] = _layer_profile(plan, kind, fit_f, fit_b, before)
        sources[kind] = origin if kind in ran else f"{origin} (scaled: no {kind} layer ran on this device)"
    return layers, sources


def _layer_profile(plan: Plan, kind: str, fwd: LinearFit, bwd: LinearFit, before: DeviceProfile | None) -> LayerProfile:
    """One kind's times with the prior profile's memory numbers (a run does not measure saved bytes)."""
    node = next(n for n in plan.graph.nodes if n.kind == kind)
    old = before.layers.get(kind) if before is not None else None
    if old is not None:
        return LayerProfile(kind, fwd, bwd, old.weight_bytes, old.lora_params, old.activation_bytes_per_token,
                            old.peak_bytes_per_token, old.memory_method, old.recompute_bytes_per_token)
    return LayerProfile(kind, fwd, bwd, 0.0, int(node.lora_params), 0.0, 0.0, "not measured by a run")


def _stage_overheads(plan: Plan, sp: StagePlan, ops: dict[str, float], before: DeviceProfile | None
                     ) -> tuple[LinearFit | None, LinearFit | None]:
    """The stage's optimizer step (against its LoRA parameters) and one send's CPU time (against its bytes)."""
    lora = float(sum(plan.graph.nodes[i].lora_params for i in sp.nodes()))
    step = max(0.0, ops.get("STEP", 0.0) - ops.get("clip_wait", 0.0))
    optimizer = scaled(before.optimizer if before else None, lora, step, through_origin=True) if step > 0 else None
    sends = sum(1 for a in sp.actions() if a.op in SEND_OPS)
    if sends == 0:
        return optimizer, None
    per_send = sum(ops.get(op, 0.0) for op in SEND_OPS) / sends  # the program is one step's actions
    num_bytes = _message_bytes(plan, sp)
    return optimizer, scaled(before.message_send if before else None, num_bytes, per_send, through_origin=False)


def _message_bytes(plan: Plan, sp: StagePlan) -> float:
    """Bytes of one activation (or gradient) this stage sends: the hidden states of a micro-batch."""
    from hetero.planner.model.cost_model import dtype_bytes

    edge = plan.graph.edges[min(sp.last_node, len(plan.graph.edges) - 1)] if plan.graph.edges else None
    if edge is None:
        return 0.0
    tokens = plan.train.micro_batch_size * plan.model.seq_len
    return edge.bytes_per_token * tokens * dtype_bytes(sp.dtype) / dtype_bytes(plan.graph.dtype)
