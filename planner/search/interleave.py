"""A planned pipeline in its schedule's chunked form: the same devices, each holding several chunks of layers,
where it simulates faster.

The schedule's step form names its chunked form (planner/schedule/step_form.py ``StepForm.chunked``: interleaved 1F1B
for 1F1B, none for GPipe). Under it device d of p holds chunks c = 0 .. v - 1, virtual stages c x p + d of a
pipeline of v p: a micro-batch passes every device v times, so the fill and drain shrink by v, for v times
the hand-offs (the last device hands on to the first) and more activations held at the first devices.
Whether that wins depends on the links and the memory: it mostly wins inside a host. Nothing here names a
schedule: the programs, the virtual-stage order and the micro-batches held come from the chunked form.

The devices stay the solver's, in its order. Each device's layers are first dealt into v chunks in
virtual-stage order (an even share of its decoders each), then a local search moves the cuts between consecutive virtual
stages a layer or two while the simulated step falls (planner/schedule/simulator.py, with per-chunk times from the
cost table), until the plan's deadline. ``planner.interleave``: ``auto`` plans them where they simulate at
least GAIN faster and fit in memory, ``off`` never, ``always`` wherever they can run. The plan's verdict
says which, and why.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, replace

from hetero.errors import ConfigError
from hetero.graph import LayerGraph
from hetero.plan import ChunkPlan, MemoryBreakdown, Prediction, StagePlan
from hetero.planner.model.cost import GB, CostTable, link_scheme
from hetero.planner.model.cost_model import expert_weight_bytes
from hetero.planner.model.objective import (
    Evaluation,
    evaluate,
    largest_recomputable,
    recompute_time_s,
    stage_activations,
    stage_fits,
)
from hetero.planner.model.predict import predict
from hetero.planner.schedule.simulator import Timeline, simulate
from hetero.planner.schedule.step_form import ChunkedForm, held_counts, peak_activations, weighted_peak
from hetero.program import Action, format_program
from hetero.specs import ModelSpec

__all__ = ["GAIN", "Candidate", "best_candidate", "chunk_recompute", "chunk_sizes", "chunk_spans", "interleave",
           "peak_activations", "price", "why_not"]

GAIN = 0.02  # under auto, interleave only where the step is predicted at least this much faster


@dataclass(frozen=True)
class Candidate:
    """The interleaved form of a pipeline: each device's chunk spans (virtual-stage order), their times, the step."""

    spans: list[list[tuple[int, int]]]  # per device, per chunk: (first node, last node)
    fwd_s: list[float]  # per virtual stage
    bwd_s: list[float]
    send_s: list[float]
    overhead_s: list[dict[str, float]]  # per device
    timeline: Timeline
    memory: list[MemoryBreakdown]  # per device
    reasons: list[str]  # why it cannot run (memory); empty: it can
    recompute: list[list[int]]  # per device, per chunk: how many of its first recomputable layers recompute
    recompute_s: list[float]  # per virtual stage: the seconds its backward re-runs forwards (in bwd_s)


def chunked(table: CostTable) -> ChunkedForm:
    """The chunked form of the table's schedule (a ConfigError for a schedule without one: why_not says so first)."""
    form = table.form.chunked
    if form is None:
        raise ConfigError(f"train.schedule={table.schedule} has no form with chunks of layers per device")
    return form


def why_not(table: CostTable, graph: LayerGraph, ev: Evaluation, stages: list[StagePlan]) -> str | None:
    """Why this pipeline cannot interleave (None: it can be tried)."""
    form = table.form.chunked
    if form is None:
        return (f"train.schedule={table.schedule} has no interleaved form (its step form names none: "
                "planner/schedule/step_form.py)")
    reason = form.why_not(len(stages), table.num_micro_batches)
    if reason is not None:
        return reason
    decoders = set(graph.decoder_indices())
    if any(s.stream_layers for s in stages):
        return "its stages stream weights, which interleaved chunks do not yet"
    if any(sum(1 for i in range(s.first_node, s.last_node + 1) if i in decoders) < form.chunks for s in stages):
        return f"a device holds fewer than {form.chunks} decoder layers"
    return None


def chunk_sizes(graph: LayerGraph, stages: list[StagePlan], chunks: int) -> list[list[int]]:
    """Nodes per chunk of each device: as many layers as its stage holds, the decoders dealt evenly to its
    ``chunks`` chunks (the first chunks take the odd ones); the embedding stays first, the head last."""
    decoders = set(graph.decoder_indices())
    p = len(stages)
    sizes: list[list[int]] = []
    for k, s in enumerate(stages):
        nodes = range(s.first_node, s.last_node + 1)
        count = sum(1 for i in nodes if i in decoders)
        first_decoder = min(i for i in nodes if i in decoders)
        before = sum(1 for i in nodes if i < first_decoder)  # the embedding (the first stage)
        after = len(nodes) - count - before  # the final norm and the head (the last stage)
        shares = [count // chunks + (1 if c < count % chunks else 0) for c in range(chunks)]
        shares[0] += before if k == 0 else 0
        shares[-1] += after if k == p - 1 else 0
        sizes.append(shares)
    return sizes


def chunk_spans(sizes: list[list[int]]) -> list[list[tuple[int, int]]]:
    """Each device's chunk spans, the chunks tiling the graph in virtual-stage order (ChunkedForm.virtual_stage:
    chunk c of device k is virtual stage c x p + k)."""
    p, chunks = len(sizes), len(sizes[0])
    spans: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    first = 0
    for c in range(chunks):
        for k in range(p):
            spans[k].append((first, first + sizes[k][c] - 1))
            first += sizes[k][c]
    return spans


def best_candidate(table: CostTable, graph: LayerGraph, ev: Evaluation, stages: list[StagePlan],
                   rounds: int = 4, deadline: float | None = None) -> Candidate:
    """The fastest fitting chunking found from even shares of each device's layers by moving the cut between two
    consecutive virtual stages a layer or two at a time (layers of unequal cost, devices of unequal speed)."""
    form = chunked(table)
    flat = [n for c in range(form.chunks) for n in (sizes[c] for sizes in chunk_sizes(graph, stages, form.chunks))]
    p = len(stages)
    best = price(table, ev, chunk_spans(_by_device(flat, p)))

    def key(c: Candidate) -> tuple[bool, float]:
        return (bool(c.reasons), c.timeline.step_time_s)

    for _ in range(rounds):
        moved = False
        for j in range(len(flat) - 1):  # the cut after virtual stage j
            if deadline is not None and time.perf_counter() > deadline:
                return best
            for shift in (-2, -1, 1, 2):
                trial = list(flat)
                trial[j], trial[j + 1] = trial[j] + shift, trial[j + 1] - shift
                if min(trial[j], trial[j + 1]) < 1:
                    continue
                cand = price(table, ev, chunk_spans(_by_device(trial, p)))
                if key(cand) < key(best):
                    best, flat, moved = cand, trial, True
        if not moved:
            break
    return best


def _by_device(flat: list[int], p: int) -> list[list[int]]:
    """Per device, its chunks' sizes, from the sizes in virtual-stage order."""
    return [flat[k::p] for k in range(p)]


def price(table: CostTable, ev: Evaluation, spans: list[list[tuple[int, int]]]) -> Candidate:
    """Times, simulated step and memory of the interleaved pipeline with these chunk spans on ev's devices: each
    chunk recomputes the fewest layers with which its device fits (planner.recompute), where any must."""
    devices, form = list(ev.placement.devices), chunked(table)
    p = len(devices)
    programs = form.programs(p, table.num_micro_batches)
    fits = [chunk_recompute(table, d, spans[k], programs[k]) for k, d in enumerate(devices)]
    # (device index, chunk) in virtual-stage order
    order = sorted(((k, c) for c in range(form.chunks) for k in range(p)), key=lambda kc: form.virtual_stage(*kc, p))
    fwd = [sum(table.fwd_s[i][devices[k]] for i in range(spans[k][c][0], spans[k][c][1] + 1)) for k, c in order]
    again = [recompute_time_s(table, devices[k], *spans[k][c], fits[k].recompute[c]) for k, c in order]
    bwd = [sum(table.bwd_s[i][devices[k]] for i in range(spans[k][c][0], spans[k][c][1] + 1)) + again[j]
           for j, (k, c) in enumerate(order)]
    send = [table.transfer_s(spans[k][c][1], devices[k], devices[order[j + 1][0]]) if j + 1 < len(order) else 0.0
            for j, (k, c) in enumerate(order)]
    overhead = [_overheads(table, devices, spans, k) for k in range(p)]
    timeline = simulate(programs, fwd, bwd, send, overhead_s=overhead, sync_s=ev.sync_s or None, cores=ev.cores)
    memory, reasons = [], []
    for k, d in enumerate(devices):
        fit = fits[k]
        total = fit.weights + fit.lora + fit.acts + table.workspace_bytes
        memory.append(MemoryBreakdown(fit.weights / GB, fit.lora / GB, fit.acts / GB, table.workspace_bytes / GB,
                                      total / GB, table.usable_bytes[d] / GB,
                                      chunk_gb_per_mb=[u / GB for u in fit.units], working_gb=fit.working / GB))
        if not fit.fits:
            most = " even with every layer it may recompute recomputing" if any(fit.recompute) else ""
            reasons.append(f"{table.device_name(d)} would need {total / GB:.1f} GB with its chunks' activations at "
                           f"their peak ({timeline.peak_in_flight[k]} micro-batch chunks){most}, has "
                           f"{table.usable_bytes[d] / GB:.1f} GB")
    return Candidate(spans, fwd, bwd, send, overhead, timeline, memory, reasons,
                     [fit.recompute for fit in fits], again)


def _overheads(table: CostTable, devices: list[int], spans: list[list[tuple[int, int]]], k: int) -> dict[str, float]:
    """Device k's CPU seconds per op: its optimizer step, and each message's encode or decode."""
    p, d = len(devices), devices[k]
    ov: dict[str, float] = {}
    if table.opt_fixed_s:
        ov["STEP"] = table.opt_fixed_s[d] + sum(table.opt_s[i][d] for a, b in spans[k] for i in range(a, b + 1))
    before = spans[(k - 1) % p][0][1]  # a cut its activations come across: the previous device's first chunk's end
    encode, decode = table.message_s(before, devices[(k - 1) % p], d)
    ov["RA"], ov["SG"] = decode, encode
    ov["SA"], ov["RG"] = table.message_s(spans[k][0][1], d, d)
    return {op: max(0.0, t) for op, t in ov.items()}


@dataclass(frozen=True)
class ChunkFit:
    """A device's chunks in memory: each chunk's recomputing layers, the bytes it holds, and whether it fits."""

    recompute: list[int]  # per chunk: its first this many recomputable layers recompute
    weights: float
    lora: float
    acts: float  # activation bytes at the device's peak (held_counts), with one re-run's working bytes
    fits: bool
    units: tuple[float, ...] = ()  # per chunk: the bytes one micro-batch keeps through it
    working: float = 0.0  # the bytes one recomputing layer's re-run needs (0: none recomputes)


def chunk_recompute(table: CostTable, d: int, spans: list[tuple[int, int]], program: list[Action]) -> ChunkFit:
    """Device d's chunks with the fewest added seconds of recomputation (per chunk its first r recomputable
    layers, r allowed by planner.recompute) with which it fits; the most allowed where none does."""
    nodes = [i for a, b in spans for i in range(a, b + 1)]
    weights, lora = sum(table.weights[i][d] for i in nodes), sum(table.lora[i][d] for i in nodes)
    counts = held_counts(program, len(spans))
    choices = [table.recompute_choices(a, b) for a, b in spans]

    def fit_of(rs: tuple[int, ...]) -> ChunkFit:
        units, working = zip(*(_unit_bytes(table, d, a, b, r) for (a, b), r in zip(spans, rs, strict=True)),
                             strict=True)
        acts = weighted_peak(counts, units) + max(working)
        return ChunkFit(list(rs), weights, lora, acts, stage_fits(table, d, weights, lora, acts), units, max(working))

    best: tuple[float, ChunkFit] | None = None
    settled: set[tuple[int, ...]] = set()  # the other chunks' counts whose last chunk's fewest fitting is found
    for rs in itertools.product(*choices):  # a few hundred at two chunks (their recomputable layers); more grows fast
        if rs[:-1] in settled:
            continue  # more recomputing in the last chunk only adds seconds
        fit = fit_of(rs)
        if not fit.fits:
            continue
        settled.add(rs[:-1])
        added = sum(recompute_time_s(table, d, a, b, r) for (a, b), r in zip(spans, rs, strict=True))
        if best is None or added < best[0]:
            best = (added, fit)
        if not any(rs):
            break  # nothing recomputes: nothing is faster
    return best[1] if best is not None else fit_of(tuple(c[-1] for c in choices))


def _unit_bytes(table: CostTable, d: int, first: int, last: int, recompute: int) -> tuple[float, float]:
    """(bytes one micro-batch keeps in a chunk over first..last whose first ``recompute`` recomputable layers
    keep only their input, the bytes of one of them re-running its forward in the backward): as
    objective.stage_activations splits them."""
    if recompute <= 0:
        return stage_activations(table, d, first, last, 1, 0), 0.0
    working = largest_recomputable(table, d, first, last)
    return stage_activations(table, d, first, last, 1, recompute, working) - working, working


def interleave(table: CostTable, graph: LayerGraph, model: ModelSpec, ev: Evaluation, stages: list[StagePlan],
               prediction: Prediction, mode: str, manual: bool = False, deadline: float | None = None,
               compression: str = "none") -> tuple[list[StagePlan], Prediction, str]:
    """The stages and prediction to plan (interleaved where ``mode`` and the simulation say so) and the verdict line
    that says what was chosen and why ("" under ``off``). ``manual``: the spans are planner.split's, which auto
    leaves as they are; ``deadline``: when the chunking search stops (time.perf_counter); ``compression``:
    planner.compression, which the chunks' hand-offs follow as the table prices them (``ring_schemes``)."""
    if mode == "off" or (mode == "auto" and (len(stages) < 2 or manual or table.form.chunked is None)):
        return stages, prediction, ""
    reason = why_not(table, graph, ev, stages)
    if reason is not None:
        if mode == "always":
            raise ConfigError(f"planner.interleave=always, but this pipeline cannot interleave: {reason}")
        return stages, prediction, f"Interleaving not considered: {reason}."
    form = chunked(table)
    cand = best_candidate(table, graph, ev, stages, deadline=deadline)
    schemes = ring_schemes(table, compression, list(ev.placement.devices), cand.spans)
    why = cand.reasons[0] if cand.reasons else None if schemes is not None else (
        "a device's chunks would hand on across cuts that compress differently")
    if why is not None:
        if mode == "always":
            raise ConfigError(f"planner.interleave=always, but the interleaved pipeline cannot run: {why}")
        return stages, prediction, f"{form.name[0].upper()}{form.name[1:]} ({form.chunks} chunks per device): {why}."
    step = cand.timeline.step_time_s
    words = _words(form, step, prediction.step_time_s)
    # The gain is asked of the one-chunk pipeline with plain hand-offs, as compression=none asks it, so that where
    # auto compressed one of its links auto never plans a slower step than none.
    plain = (predict(table.uncompressed(), evaluate(table.uncompressed(), ev.placement))[0].step_time_s
             if table.link_compress and any(s.compress_out != "none" for s in stages) else prediction.step_time_s)
    if mode == "auto" and step > plain * (1 - GAIN):
        times = "twice" if form.chunks == 2 else f"{form.chunks} times"
        return stages, prediction, (f"Not interleaved: {words}; the smaller fill and drain do not pay for {times} the "
                                    f"hand-offs here (planned only from a {GAIN:.0%} gain).")
    if mode == "auto" and step >= prediction.step_time_s:
        return stages, prediction, f"Not interleaved: {words}; compressed hand-offs of one chunk per device gain more."
    experts = [sum(expert_weight_bytes(graph, i, table.devices[d], model) for a, b in cand.spans[k]
                   for i in range(a, b + 1)) / GB for k, d in enumerate(ev.placement.devices)]
    assert schemes is not None  # else ``why`` said so above
    chosen = _interleaved_stages(graph, form, stages, cand, table, experts, schemes)
    return chosen, _prediction(prediction, cand), (f"Interleaved: {words}. The chunk boundaries come from a local "
                                                   "search from even shares; a proof above covers placements of one "
                                                   "chunk per device.")


def ring_schemes(table: CostTable, compression: str, devices: list[int], spans: list[list[tuple[int, int]]]
                 ) -> list[str] | None:
    """Per device, the scheme of what it hands to the next device (the last device: to the first), as the table
    priced each of its chunks' cuts (planner/model/cost.py link_scheme); None where a device's cuts would differ (one scheme
    per link: runtime/stage/chunks.py)."""
    p, out = len(devices), []
    last_cut = spans[-1][-1][1]  # the head's: nothing is handed on after it
    for k, d in enumerate(devices):
        found = {link_scheme(table, compression, b, d, devices[(k + 1) % p]) for _, b in spans[k] if b != last_cut}
        if len(found) > 1:
            return None
        out.append(found.pop() if found else "none")
    return out


def _words(form: ChunkedForm, step: float, planned: float) -> str:
    """What the interleaved pipeline simulates at against one chunk per device."""
    return (f"{form.name} ({form.chunks} chunks per device, the last device handing on to the first) simulates at "
            f"{step:.3g} s/step against {planned:.3g} s for one chunk per device ({(planned - step) / planned:+.1%})")


def _interleaved_stages(graph: LayerGraph, form: ChunkedForm, stages: list[StagePlan], cand: Candidate,
                        table: CostTable, experts_gb: list[float], schemes: list[str]) -> list[StagePlan]:
    p = len(stages)
    programs = form.programs(p, table.num_micro_batches)
    out = []
    for k, s in enumerate(stages):
        names = [_recomputing(graph, table, f, g, r) for (f, g), r in zip(cand.spans[k], cand.recompute[k], strict=True)]
        (a, b), *more = cand.spans[k]
        at = [form.virtual_stage(k, c, p) for c in range(len(cand.spans[k]))]  # each chunk's virtual stage
        chunks = [ChunkPlan(f, g, [n.name for n in graph.nodes[f:g + 1]], cand.fwd_s[at[c]], cand.bwd_s[at[c]],
                            cand.send_s[at[c]], names[c]) for c, (f, g) in enumerate(more, start=1)]
        out.append(replace(s, first_node=a, last_node=b, node_names=[n.name for n in graph.nodes[a:b + 1]],
                           fwd_time_s=cand.fwd_s[at[0]], bwd_time_s=cand.bwd_s[at[0]], send_time_s=cand.send_s[at[0]],
                           memory=replace(cand.memory[k], experts_gb=experts_gb[k]), recompute_layers=names[0],
                           recompute_time_s=cand.recompute_s[at[0]], overhead_s=cand.overhead_s[k],
                           program=format_program(programs[k]), chunks=chunks, compress_out=schemes[k]))
    return out


def _recomputing(graph: LayerGraph, table: CostTable, first: int, last: int, count: int) -> list[str]:
    """The names of a chunk's first ``count`` recomputable layers (planner.recompute_layers' rule)."""
    return [graph.nodes[i].name for i in range(first, last + 1) if table.recomputable[i]][:count]


def _prediction(prediction: Prediction, cand: Candidate) -> Prediction:
    step = cand.timeline.step_time_s
    return replace(prediction, step_time_s=step,
                   tokens_per_s=prediction.tokens_per_step / step if step > 0 else 0.0,
                   bubble_fraction=cand.timeline.bubble_fraction, stage_busy=cand.timeline.busy_fraction,
                   stage_memory_gb=[mem.total_gb for mem in cand.memory])
