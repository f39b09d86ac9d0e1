"""The closed-form step time the exact DP and the ILP minimize, and the evaluation of one placement.

``pipeline_step_time`` is the solvers' objective: the exact DP and the ILP encode exactly this
function, ``bruteforce.brute_force`` calls it, and the tests compare them. It is a linear proxy: the
plan's placement is then chosen by the simulator's step time (planner/search/simsearch.py starts from this
optimum and proves its answer with planner/search/simbound.py's lower bound), because no linear objective
follows the simulator's round trips and barrier. How the two relate (planner/schedule/simulator.py, whose step
time the plan reports):

- GPipe: sum_k (f_k + b_k) + 2 sum_k c_k + (m - 1) (max(f, c) + max(b, c)) is exactly the
  simulator's step time (forward phase then backward phase, each a classic flow line whose period
  is its slowest stage or link).
- 1F1B: sum_k (f_k + b_k) + 2 sum_k c_k + (m - 1) max(max_k (f_k + b_k), max_k 2 c_k): the first
  micro-batch's trip down and back, then one period per further micro-batch at the bottleneck.
  It equals the simulator for balanced stages with free links ((m + S - 1)(f + b), the textbook
  number). For unbalanced stages the simulator can be a little slower (1F1B caps the micro-batches
  in flight, so adjacent stages wait on each other's round trips) or faster (links are
  full-duplex); on random instances the median gap is ~2%, on slow links (1 GbE, PCIe x1 risers)
  up to ~25%, enough to rank placements the other way round.

What a stage pays outside its layers -- the CPU time of each message it sends or receives and
the optimizer step after the step's gradient-norm round trip through the coordinator -- is in
the simulator (``Evaluation.overhead_s`` / ``sync_s``), not in this objective: it is small next
to compute for real models and depends on where the cuts fall, which the linear ILP cannot see;
the simulated search and its lower bound count it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetero.plan import MemoryBreakdown
from hetero.planner.model.cost import GB, CostTable, in_flight
from hetero.planner.model.stream_costs import BUFFER_LAYERS
from hetero.planner.schedule.simulator import CoreShare, core_share
from hetero.planner.schedule.step_form import step_form


def pipeline_step_time(
    schedule: str, num_micro_batches: int, fwd_s: list[float], bwd_s: list[float], comm_s: list[float]
) -> float:
    """Closed-form step time; ``comm_s[k]`` is the link from stage k to k+1 (len S - 1)."""
    return step_form(schedule).closed_form(num_micro_batches, fwd_s, bwd_s, comm_s)


@dataclass(frozen=True)
class Placement:
    """Devices (indices into the fleet's device list) in pipeline order and their node spans."""

    devices: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]  # (first, last) node, inclusive, contiguous, covering all nodes
    # Per stage, how many of its decoder layers recompute (its first ones); None: the fewest that
    # fit under the table's recompute mode (fewest is fastest: see stage_recompute).
    recompute: tuple[int, ...] | None = None
    # Per stage, how many of its decoder layers stream their frozen weights from host RAM (its last ones);
    # None: with recompute given, none; else the pair of least added time that fits (see stage_choice).
    stream: tuple[int, ...] | None = None


@dataclass
class Evaluation:
    placement: Placement
    fwd_s: list[float]
    bwd_s: list[float]
    send_s: list[float]  # per stage: its activation to the next stage (0 for the last)
    memory: list[MemoryBreakdown]
    step_time_s: float  # pipeline_step_time of the above
    feasible: bool
    reasons: list[str] = field(default_factory=list)  # why not, one per stage that overflows
    # Per stage, seconds an action costs besides compute: "RA"/"SA"/"RG"/"SG" per message, "STEP"
    # the optimizer step; and the gradient-norm round trip to the coordinator before STEP.
    overhead_s: list[dict[str, float]] = field(default_factory=list)
    sync_s: list[float] = field(default_factory=list)
    recompute: list[int] = field(default_factory=list)  # per stage: decoder layers that recompute
    recompute_s: list[float] = field(default_factory=list)  # per stage: of bwd_s, the extra forward
    cores: CoreShare | None = None  # stages that compute in turns on a host with too few cores
    stream: list[int] = field(default_factory=list)  # per stage: decoder layers that stream (its last ones)
    stream_s: list[float] = field(default_factory=list)  # per stage: of fwd_s + bwd_s, the copies' seconds
    stream_bytes: list[float] = field(default_factory=list)  # per stage: frozen bytes kept in host RAM


def check_placement(table: CostTable, placement: Placement) -> None:
    """Raise ValueError if the spans are not contiguous, in order and covering every node."""
    if len(placement.devices) != len(placement.spans) or not placement.devices:
        raise ValueError("a placement needs one span per device")
    if len(set(placement.devices)) != len(placement.devices):
        raise ValueError("a device appears twice in the pipeline")
    expect = 0
    for first, last in placement.spans:
        if first != expect or last < first:
            raise ValueError(f"spans {placement.spans} are not contiguous from node 0")
        expect = last + 1
    if expect != table.num_nodes:
        raise ValueError(f"spans {placement.spans} do not cover all {table.num_nodes} nodes")


def stage_activations(table: CostTable, d: int, first: int, last: int, held: int, recompute: int,
                      working: float | None = None) -> float:
    """Activation bytes at a stage's peak: ``held`` micro-batches in flight, its first ``recompute``
    recomputable layers keeping only their input, plus (if any recompute) one recomputing layer's
    full activations while it re-runs its forward during backward (``working``: the largest of the
    stage's recomputable layers, computed here when not given).

    One formula over the table's prefix sums: the ILP's network, the split DP and evaluate all call
    it, so borderline stages agree everywhere.
    """
    acts, rank, saved = table.prefixes(d)
    total = acts[last + 1] - acts[first]
    if recompute <= 0:
        return held * total
    if working is None:
        working = largest_recomputable(table, d, first, last)
    k = rank[first]
    return held * (total - (saved[k + recompute] - saved[k])) + working


def largest_recomputable(table: CostTable, d: int, first: int, last: int) -> float:
    """The bytes one of the stage's recomputable layers needs while it re-runs its forward: the largest's."""
    return max(table.activations_per_mb[i][d] for i in range(first, last + 1) if table.recomputable[i])


def stage_fits(table: CostTable, d: int, weights: float, lora: float, acts: float) -> bool:
    """THE memory test (one expression, so every caller agrees on borderline stages)."""
    return weights + lora + acts + table.workspace_bytes <= table.usable_bytes[d]


def stage_recompute(table: CostTable, d: int, first: int, last: int, held: int, weights: float, lora: float,
                    mode: str | None = None, working: float | None = None) -> int | None:
    """The fewest recomputing layers (allowed by ``mode``) with which the stage fits next to
    ``weights`` + ``lora`` bytes; None if none do. Fewest is fastest: each adds a forward to the
    backward. From one layer on, memory only falls as more recompute, so this bisects."""
    def fits(r: int) -> bool:
        return stage_fits(table, d, weights, lora, stage_activations(table, d, first, last, held, r, working))

    choices = table.recompute_choices(first, last, mode)
    if choices[0] == 0 and fits(0):
        return 0
    ones = [r for r in choices if r > 0]
    if not ones or not fits(ones[-1]):
        return None
    lo, hi = 0, len(ones) - 1  # ones[hi] fits
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(ones[mid]):
            hi = mid
        else:
            lo = mid + 1
    return ones[hi]


def recompute_time_s(table: CostTable, d: int, first: int, last: int, recompute: int) -> float:
    """Backward seconds per micro-batch the stage's first ``recompute`` recomputable layers add."""
    extra, left = 0.0, recompute
    for i in range(first, last + 1):
        if left > 0 and table.recomputable[i]:
            extra += table.recompute_s[i][d]
            left -= 1
    return extra


def stream_terms(table: CostTable, d: int, last: int, stream: int) -> tuple[float, float]:
    """(bytes kept in host RAM, copy seconds per pass) per micro-batch of a stage ending at node ``last`` whose
    last ``stream`` streamable layers stream; the forward and the backward pass each pay the copy seconds once. A
    layer that also recomputes copies no third time: its re-run forward comes right before its backward and
    finds it in the buffer (hetero/stream_buffer.py). One formula over prefix sums: the exact DP computes it
    term by term."""
    if stream <= 0:
        return 0.0, 0.0
    srank, sbytes, sfetch = table.stream_prefixes(d)
    e = srank[last + 1]
    return sbytes[e] - sbytes[e - stream], (sfetch[e] - sfetch[e - stream]) + table.stream_start_s[d]


def resident_weights(table: CostTable, d: int, weights: float, streamed: float, stream: int) -> float:
    """Frozen bytes on the device: the stage's less what streams, plus the streaming buffer."""
    if stream <= 0:
        return weights
    return weights - streamed + min(stream, BUFFER_LAYERS) * table.stream_buffer[d]


def stage_choice(table: CostTable, d: int, first: int, last: int, held: int, weights: float, lora: float,
                 mode: str | None = None, working: float | None = None) -> tuple[int, int] | None:
    """The (recompute, stream) pair of least added seconds per micro-batch with which the stage fits (ties:
    fewer streaming); None if none does. Per streamed count the fewest recomputing layers that fit is the
    fastest (stage_recompute); the scan stops where more streaming can only cost more."""
    best: tuple[int, int] | None = None
    best_added = 0.0
    least_r = table.recompute_choices(first, last, mode)[0]
    for s in table.stream_choices(d, first, last):
        streamed, fwd = stream_terms(table, d, last, s)
        if best is not None and fwd + fwd > best_added:
            break  # the copies alone (forward and backward) already cost more
        r = stage_recompute(table, d, first, last, held, resident_weights(table, d, weights, streamed, s), lora,
                            mode, working)
        if r is None:
            continue
        added = (recompute_time_s(table, d, first, last, r) + fwd) + fwd
        if best is None or added < best_added:
            best, best_added = (r, s), added
        if r == least_r:
            break  # more streaming cannot recompute less
    return best


def ram_may_bind(table: CostTable) -> bool:
    """Whether some host's RAM could be short of what its devices may stream (else the per-stage choice
    ignores RAM exactly). Where it may, the ILP carries every Pareto pair per arc and one RAM row per host."""
    if table.stream_mode == "none":
        return False
    most: dict[int, float] = {}
    for d in range(table.num_devices):
        if table.can_stream[d]:
            h = table.host_of[d]
            most[h] = max(most.get(h, 0.0), sum(table.stream_bytes[i][d] for i in range(table.num_nodes)))
    return any(b > table.host_ram_bytes[h] for h, b in most.items())


def stage_pareto(table: CostTable, d: int, first: int, last: int, held: int, weights: float, lora: float,
                 working: float | None = None) -> list[tuple[int, int]]:
    """The (recompute, stream) pairs that fit and that no other beats in both added seconds and host RAM
    bytes (per stream count the fewest recomputing layers), fewest streaming first: what the ILP chooses
    among when host RAM may bind."""
    out: list[tuple[int, int]] = []
    best_added = float("inf")
    for s in table.stream_choices(d, first, last):
        streamed, fwd = stream_terms(table, d, last, s)
        r = stage_recompute(table, d, first, last, held, resident_weights(table, d, weights, streamed, s), lora,
                            None, working)
        if r is None:
            continue
        added = (recompute_time_s(table, d, first, last, r) + fwd) + fwd
        if added < best_added:  # more streaming keeps more in RAM: only worth it when faster
            out.append((r, s))
            best_added = added
    return out


def _choice(table: CostTable, placement: Placement, k: int, d: int, first: int, last: int, held: int,
            weights: float, lora: float, mode: str | None) -> tuple[int, int]:
    """Stage k's (recompute, stream): the placement's, else stage_choice, else the most allowed."""
    if placement.recompute is not None:
        return placement.recompute[k], placement.stream[k] if placement.stream is not None else 0
    fit = stage_choice(table, d, first, last, held, weights, lora, mode)
    if fit is not None:
        return fit
    return table.recompute_choices(first, last, mode)[-1], table.stream_choices(d, first, last)[-1]


def ram_reasons(table: CostTable, devices: tuple[int, ...], streamed: list[float]) -> list[str]:
    """Why the hosts' RAM does not hold what their stages stream, one line per host short of it."""
    used: dict[int, float] = {}
    for d, b in zip(devices, streamed, strict=True):
        if b > 0:
            used[table.host_of[d]] = used.get(table.host_of[d], 0.0) + b
    out = []
    for h, b in sorted(used.items()):
        if b > table.host_ram_bytes[h]:
            name = next((table.devices[d].host for d in devices if table.host_of[d] == h and d < len(table.devices)),
                        f"host {h}")
            out.append(f"host {name} keeps {b / GB:.1f} GB of streamed weights in RAM, its ram_gb is "
                       f"{table.host_ram_bytes[h] / GB:.1f}")
    return out


def evaluate(table: CostTable, placement: Placement, mode: str | None = None) -> Evaluation:
    """Per-stage times, memory and the closed-form step time of one placement.

    Recomputation and streaming per stage are the placement's, or else the pair of least added time that
    fits under ``mode`` (default: the table's planner.recompute) and planner.offload (stage_choice); a stage
    that fits under none uses the most allowed. The hosts' RAM must hold what their stages stream.
    """
    check_placement(table, placement)
    num_stages = len(placement.devices)
    for given in (placement.recompute, placement.stream):
        if given is not None and len(given) != num_stages:
            raise ValueError("a placement's recompute and stream need one count per stage")
    ev = Evaluation(placement, [], [], [], [], 0.0, True)
    for k, (d, (first, last)) in enumerate(zip(placement.devices, placement.spans, strict=False)):
        nodes = range(first, last + 1)
        held = in_flight(table.schedule, num_stages - 1 - k, table.num_micro_batches)
        weights = sum(table.weights[i][d] for i in nodes)
        lora = sum(table.lora[i][d] for i in nodes)
        r, s = _choice(table, placement, k, d, first, last, held, weights, lora, mode)
        extra = recompute_time_s(table, d, first, last, r)
        streamed, copy_s = stream_terms(table, d, last, s)
        ev.fwd_s.append(sum(table.fwd_s[i][d] for i in nodes) + copy_s)
        ev.bwd_s.append(sum(table.bwd_s[i][d] for i in nodes) + extra + copy_s)
        ev.recompute.append(r)
        ev.recompute_s.append(extra)
        ev.stream.append(s)
        ev.stream_s.append(copy_s + copy_s)
        ev.stream_bytes.append(streamed)
        ev.send_s.append(table.transfer_s(last, d, placement.devices[k + 1]) if k < num_stages - 1 else 0.0)
        _stage_memory(table, ev, k, d, resident_weights(table, d, weights, streamed, s), lora,
                      stage_activations(table, d, first, last, held, r))
    ev.reasons += ram_reasons(table, placement.devices, ev.stream_bytes)
    ev.feasible = not ev.reasons
    ev.step_time_s = pipeline_step_time(table.schedule, table.num_micro_batches, ev.fwd_s, ev.bwd_s, ev.send_s[:-1])
    ev.overhead_s, ev.sync_s = stage_overheads(table, placement)
    ev.cores = placement_cores(table, placement.devices)
    return ev


def _stage_memory(table: CostTable, ev: Evaluation, k: int, d: int, weights: float, lora: float,
                  acts: float) -> None:
    """Stage k's memory breakdown (``weights``: the resident frozen bytes) and why it does not fit."""
    usable = table.usable_bytes[d]
    total = weights + lora + acts + table.workspace_bytes
    ev.memory.append(MemoryBreakdown(weights_gb=weights / GB, lora_gb=lora / GB, activations_gb=acts / GB,
                                     workspace_gb=table.workspace_bytes / GB, total_gb=total / GB,
                                     available_gb=usable / GB, host_gb=ev.stream_bytes[k] / GB))
    if not stage_fits(table, d, weights, lora, acts):
        r, s = ev.recompute[k], ev.stream[k]
        how = " with " + " and ".join(([f"{r} of its layers recomputing"] if r else [])
                                      + ([f"{s} streaming from host RAM"] if s else [])) if r or s else ""
        ev.reasons.append(f"stage {k} on {table.device_name(d)} needs {total / GB:.1f} GB{how}, "
                          f"has {usable / GB:.1f} GB usable")


def placement_cores(table: CostTable, devices: tuple[int, ...] | list[int]) -> CoreShare | None:
    """The cores these stages share where their host has fewer than their threads (None: nowhere)."""
    if not any(table.host_cores) or not any(table.core_need[d] for d in devices):
        return None
    hosts = [str(table.host_of[d]) for d in devices]
    cores = {str(h): c for h, c in enumerate(table.host_cores) if c > 0}
    usable = {str(h): c for h, c in enumerate(table.host_usable_cores) if c > 0}
    return core_share(hosts, [table.core_need[d] for d in devices], cores, usable)


def stage_overheads(table: CostTable, placement: Placement) -> tuple[list[dict[str, float]], list[float]]:
    """Per stage: message and optimizer seconds by action, and the gradient-norm round trip."""
    devices, spans = placement.devices, placement.spans
    last = len(devices) - 1
    overhead: list[dict[str, float]] = []
    sync: list[float] = []
    for k, (d, (first, end)) in enumerate(zip(devices, spans, strict=True)):
        ov: dict[str, float] = {}
        if table.opt_fixed_s:
            ov["STEP"] = table.opt_fixed_s[d] + sum(table.opt_s[i][d] for i in range(first, end + 1))
        if k > 0:  # activations in from stage k-1, gradients back to it
            prev_end = spans[k - 1][1]
            send, recv = table.message_s(prev_end, devices[k - 1], d)
            ov["RA"], ov["SG"] = recv, send
        if k < last:  # activations out to stage k+1, gradients in from it
            send, recv = table.message_s(end, d, d)
            ov["SA"], ov["RG"] = send, recv
        overhead.append({op: max(0.0, t) for op, t in ov.items()})
        sync.append(table.sync_s(d, devices[0]))
    return overhead, sync


def hop_messages_s(table: CostTable, node: int, sender: int, receiver: int) -> float:
    """The CPU seconds of one hop's four messages per micro-batch, across the cut after ``node``: the sender's
    SA and RG, the receiver's RA and SG (``stage_overheads``' terms)."""
    send, recv = table.message_s(node, sender, receiver)
    out_send, out_recv = table.message_s(node, sender, sender)
    return sum(max(0.0, t) for t in (send, recv, out_send, out_recv))


def split_spans(num_nodes: int, decoder_counts: list[int], decoder_indices: list[int]) -> list[tuple[int, int]]:
    """Node spans for a split in decoder layers per stage (each >= 1; embedding first, norm/head last)."""
    spans: list[tuple[int, int]] = []
    start_node = 0
    taken = 0
    for k, count in enumerate(decoder_counts):
        taken += count
        if k == len(decoder_counts) - 1:
            end_node = num_nodes - 1
        else:
            end_node = decoder_indices[taken - 1]
        spans.append((start_node, end_node))
        start_node = end_node + 1
    return spans
