"""A plan's bottleneck, in words: memory-bound, compute-bound on a device, link-bound, bubble-bound (filling and
draining: more micro-batches help) or imbalance-bound (stages waiting for the slowest: they do not).

In a pipeline's steady state every micro-batch passes the slowest resource once per period:
a stage's forward + backward, or a link's activation + gradient transfer. The fill and drain
around it (the bubble) costs (S - 1) periods per step and shrinks relative to the step as the
micro-batches per step grow. Memory decides what else is possible (bigger micro-batches, GPipe).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero.plan import Plan

MEMORY_TIGHT = 0.9  # a stage using this share of its usable memory leaves no room to grow
BUBBLE_HIGH = 0.2  # idle share of device-time above which more micro-batches pay off


@dataclass
class Bottleneck:
    kind: str  # memory | compute | link | bubble | imbalance | balanced
    where: str  # device name, "hostA<->hostB", or ""
    sentence: str


def _period_parts(plan: Plan) -> tuple[list[float], list[float]]:
    """Per stage its compute per micro-batch, and its link to the next stage of its pipeline (0: none)."""
    compute = [s.compute_s() for s in plan.stages]  # every chunk's, where a device holds several
    # activation down + gradient back; a replica's last stage sends nothing (interleaved: each chunk's hand-off,
    # the last device's first chunk over the ring to the first device)
    links = [2.0 * (s.send_time_s + sum(c.send_time_s for c in s.chunks)) if plan.next_stage(k) is not None or s.chunks
             else 0.0 for k, s in enumerate(plan.stages)]
    return compute, links


def _micro_batches_for(plan: Plan, target_bubble: float = 0.1) -> int:
    """Micro-batches per step that bring the fill/drain share to ``target_bubble`` (1F1B rule of thumb)."""
    s = max(len(r.stages) for r in plan.pipelines)  # the longest pipeline (replica)
    v = len(plan.stages[0].spans())  # chunks per device: interleaved 1F1B fills and drains v times faster
    # Balanced 1F1B: bubble = (S - 1) / (v m + S - 1); solve for m (interleaved: a multiple of the S devices).
    m = max(plan.train.num_micro_batches + 1, int((s - 1) * (1 - target_bubble) / (target_bubble * v) + 0.999))
    return m if v == 1 else -(-m // s) * s


def diagnose(plan: Plan) -> list[Bottleneck]:
    """Every bottleneck that applies, the one that limits throughput first."""
    out: list[Bottleneck] = []
    compute, links = _period_parts(plan)
    k = max(range(len(compute)), key=lambda i: compute[i])
    worst_link = max(range(len(links)), key=lambda i: links[i]) if links else None
    slowest = plan.stages[k]
    others = sorted(compute[:k] + compute[k + 1:])
    second = f"; the next slowest stage needs {others[-1]:.3g} s" if others else ""
    if worst_link is not None and links[worst_link] > compute[k]:
        a, b = plan.stages[worst_link], plan.stages[plan.next_stage(worst_link) or 0]
        where = f"{a.host}<->{b.host}"
        hosts = f"hosts {a.host} and {b.host}" if a.host != b.host else f"devices {a.device} and {b.device} on {a.host}"
        out.append(Bottleneck("link", where, (
            f"Link-bound between {hosts}: each micro-batch spends {links[worst_link]:.3g} s on the link (activation "
            f"and gradient) against {compute[k]:.3g} s of compute on the slowest stage; fix: a faster link, or cut "
            "the model where fewer bytes cross (fewer cross-host stages).")))
    elif len(compute) > 1:
        out.append(Bottleneck("compute", slowest.device, (
            f"Compute-bound on {slowest.device} ({slowest.device_type}, stage {k}, {len(slowest.nodes())} "
            f"node(s)): {compute[k]:.3g} s of forward+backward per micro-batch{second}; it sets the pipeline's pace.")))
    else:
        out.append(Bottleneck("compute", slowest.device, (
            f"Compute-bound on {slowest.device} ({slowest.device_type}): it runs the whole model alone, "
            f"{compute[k]:.3g} s per micro-batch.")))
    bubble = plan.prediction.bubble_fraction
    if len(plan.stages) > 1 and bubble >= BUBBLE_HIGH:
        # The idle device-time is the fill and drain, which more micro-batches share out, and the stages waiting
        # for the slowest one in the steady state, which they do not.
        depth = max(len(r.stages) for r in plan.pipelines)
        chunks = len(plan.stages[0].spans())
        fill = (depth - 1) / (chunks * plan.train.num_micro_batches + depth - 1)
        uneven = max(0.0, bubble - fill)
        if fill >= uneven:
            m = _micro_batches_for(plan)
            rest = (f"; the other {uneven:.0%} is stages waiting for the slowest one, which more micro-batches do not "
                    "recover" if uneven >= 0.05 else "")
            out.append(Bottleneck("bubble", "", (
                f"Bubble-bound: the pipeline idles {bubble:.0%} of its device-time, {fill:.0%} filling and draining; "
                f"fix: more micro-batches (train.num_micro_batches={m} instead of {plan.train.num_micro_batches}), so "
                f"the fill/drain is shared by more work{rest}.")))
        else:
            out.append(Bottleneck("imbalance", slowest.device, (
                f"Imbalance-bound: the pipeline idles {bubble:.0%} of its device-time, {uneven:.0%} of it the other "
                f"stages waiting for stage {k} on {slowest.device} (whole layers do not split evenly over devices "
                f"this different); more micro-batches recover only the {fill:.0%} spent filling and draining. Fix: a "
                f"device closer in speed to the others for stage {k}, or a profile of the fleet (`hetero profile`) so "
                "the split follows the speeds the devices really have.")))
    tight = [(s.memory.total_gb / s.memory.available_gb, s) for s in plan.stages if s.memory.available_gb > 0]
    full = [(u, s) for u, s in tight if u >= MEMORY_TIGHT]
    if full:
        u, s = max(full, key=lambda x: x[0])
        out.insert(0, Bottleneck("memory", s.device, (
            f"Memory-bound: stage {s.index} on {s.device} uses {u:.0%} of its usable {s.memory.available_gb:.1f} GB "
            f"(weights {s.memory.weights_gb:.1f}, activations {s.memory.activations_gb:.1f}); larger micro-batches "
            "or GPipe will not fit, and the placement is shaped by memory as much as by speed.")))
    # The bubble outweighs an imbalance when it costs more of the step than the slowest stage's excess.
    if len(out) > 1 and out[-1].kind == "bubble" and bubble > 0.35 and out[0].kind != "memory":
        out.insert(0, out.pop())
    return out


def verdict(plan: Plan) -> list[str]:
    """The diagnosis as sentences, the limiting one first."""
    return [b.sentence for b in diagnose(plan)]
