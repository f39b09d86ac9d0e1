"""Terminal rendering of plans, layer graphs and schedule timelines (rich tables + a text Gantt)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from hetero.graph import LayerGraph
from hetero.plan import Plan, Prediction


class TimelineEvent(Protocol):
    """What the Gantt needs from a simulator event (hetero.planner.schedule.simulator.Event)."""

    stage: int
    op: str
    mb: int
    start_s: float
    end_s: float


class TimelineLike(Protocol):
    events: Sequence[Any]
    step_time_s: float


def fmt_time(seconds: float | None) -> str:
    """Human units: 850 us, 12.3 ms, 4.56 s, 3.2 min."""
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s"
    return f"{seconds / 60:.1f} min"


def fmt_rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1e3:.1f}k tok/s" if tokens_per_s >= 1e4 else f"{tokens_per_s:.0f} tok/s"


def fmt_duration(seconds: float) -> str:
    """fmt_time, with hours and days for an epoch or a run."""
    if seconds < 2 * 3600:
        return fmt_time(seconds)
    return f"{seconds / 3600:.1f} h" if seconds < 48 * 3600 else f"{seconds / 86400:.1f} days"


def trained_rate(p: Prediction) -> str:
    """A prediction's throughput: trained (label) tokens/s where the data was measured, else computed tokens/s,
    said so."""
    if p.trained_tokens_per_s is not None:
        return fmt_rate(p.trained_tokens_per_s)
    return f"{fmt_rate(p.tokens_per_s)} computed"


def describe_span(graph: LayerGraph, first: int, last: int) -> str:
    """``embed + layers 0-9`` style summary of nodes ``first..last`` (inclusive)."""
    parts: list[str] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            parts.append(f"layer {run[0]}" if len(run) == 1 else f"layers {run[0]}-{run[-1]}")
            run.clear()

    ordinal = decoder_count(graph, 0, first - 1) if first > 0 else 0  # decoder layers before the span
    for node in graph.nodes[first : last + 1]:
        if node.kind == "decoder":
            run.append(ordinal)
            ordinal += 1
        else:
            flush()
            parts.append(node.name)
    flush()
    return " + ".join(parts)


def decoder_count(graph: LayerGraph, first: int, last: int) -> int:
    return sum(1 for n in graph.nodes[first : last + 1] if n.kind == "decoder")


def stage_table(plan: Plan) -> Table:
    """One row per stage: where it runs, what it holds, its predicted times and memory."""
    table = Table(title="Stages", title_justify="left", header_style="bold")
    for col, justify in [
        ("#", "right"),
        ("host", "left"),
        ("device", "left"),
        ("holds", "left"),
        ("dtype", "left"),
        ("fwd/mb", "right"),
        ("bwd/mb", "right"),
        ("send", "right"),
        ("memory GB", "right"),
        ("busy", "right"),
    ]:
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    busy = plan.prediction.stage_busy
    replica_of = {k: r for r, rep in enumerate(plan.replicas) for k in rep.stages}
    for s in plan.stages:
        mem = s.memory
        share = mem.total_gb / mem.available_gb if mem.available_gb > 0 else float("inf")
        mem_style = "red" if share > 1 else ("yellow" if share > 0.9 else "")
        quant = "" if s.quantization == "none" else f"+{s.quantization}"
        holds = " + ".join(f"{describe_span(plan.graph, a, b)} ({decoder_count(plan.graph, a, b)}L)" for a, b in s.spans())
        if s.recompute_layers:
            holds += f", {len(s.recompute_layers)} recompute (+{fmt_time(s.recompute_time_s)} bwd)"
        if s.stream_layers:
            holds += f", {s.stream_summary()}"
        table.add_row(
            f"{s.index}" + (f" [dim]r{replica_of[s.index]}[/]" if replica_of else ""),
            s.host,
            f"{s.device} [dim]({s.device_type}, {s.backend})[/]",
            holds,
            f"{s.dtype}{quant}",
            fmt_time(s.fwd_time_s + sum(c.fwd_time_s for c in s.chunks)),  # every chunk's: the device's work
            fmt_time(s.bwd_time_s + sum(c.bwd_time_s for c in s.chunks)),
            (fmt_time(s.send_time_s) + (f" {s.compress_out}" if s.compress_out != "none" else "")) if s.send_time_s
            else "-",
            Text(f"{mem.total_gb:.1f} / {mem.available_gb:.1f}", style=mem_style),
            f"{busy[s.index]:.0%}" if s.index < len(busy) else "-",
        )
    return table


def memory_table(plan: Plan) -> Table:
    """Per-stage predicted peak memory broken into weights, LoRA state, activations, workspace; a mixture of
    experts' weights (of the weights) in their own column."""
    table = Table(title="Memory per stage (GB)", title_justify="left", header_style="bold")
    experts = any(s.memory.experts_gb for s in plan.stages)
    for col in ("#", "weights", *(("of which experts",) if experts else ()), "LoRA+optim", "activations",
                "workspace", "total", "available"):
        table.add_column(col, justify="right")
    for s in plan.stages:
        m = s.memory
        table.add_row(
            str(s.index),
            f"{m.weights_gb:.2f}",
            *((f"{m.experts_gb:.2f}",) if experts else ()),
            f"{m.lora_gb:.2f}",
            f"{m.activations_gb:.2f}",
            f"{m.workspace_gb:.2f}",
            f"{m.total_gb:.2f}",
            f"{m.available_gb:.2f}",
        )
    return table


def baseline_table(plan: Plan) -> Table:
    """The plan against simple alternatives: best single device, even split, TFLOPS-proportional."""
    table = Table(title="Baselines", title_justify="left", header_style="bold")
    for col, justify in [
        ("baseline", "left"),
        ("devices", "left"),
        ("layers", "left"),
        ("step", "right"),
        ("trained tokens" if plan.prediction.trained_tokens_per_s is not None else "throughput", "right"),
        ("plan speed-up", "right"),
    ]:
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    mine = plan.prediction.step_time_s
    table.add_row(
        "[bold]this plan[/]",
        ", ".join(s.device for s in plan.stages),
        "/".join(str(sum(decoder_count(plan.graph, a, b) for a, b in s.spans())) for s in plan.stages),
        fmt_time(mine),
        trained_rate(plan.prediction),
        "1.00x",
    )
    for b in plan.baselines:
        if not b.feasible or b.prediction is None:
            table.add_row(
                b.name,
                ", ".join(b.devices) or "-",
                "/".join(map(str, b.layer_counts)) or "-",
                "-",
                "[red]infeasible[/]",
                f"[dim]{b.reason}[/]",
            )
            continue
        p = b.prediction
        speedup = p.step_time_s / mine if mine > 0 else float("nan")
        table.add_row(
            b.name,
            ", ".join(b.devices),
            "/".join(map(str, b.layer_counts)) or "-",
            fmt_time(p.step_time_s),
            trained_rate(p),
            f"{speedup:.2f}x",
        )
    return table


def solver_line(plan: Plan) -> str:
    """One sentence on how the placement was found and how sure the solver is."""
    r = plan.solver
    certainty = "proven optimal" if r.proven_optimal else "not proven optimal"
    gap = "" if r.gap is None else f", gap {r.gap:.1%}"
    size = f", {r.num_variables} variables, {r.num_constraints} constraints" if r.num_variables else ""
    msg = f" ({r.message})" if r.message else ""
    return (
        f"{r.solver}: {r.status} / {r.sol_status}, {certainty}{gap}, "
        f"{r.solve_time_s:.1f} s of a {r.time_limit_s:.0f} s limit{size}{msg}"
    )


def settled_lines(plan: Plan) -> list[str]:
    """What the proof covers: each question the search settled or not (and why), and the best lower bound."""
    r = plan.solver
    if not r.settled:
        return []
    done = [part for part, ok in r.settled.items() if ok]
    out = [f"settled: {', '.join(done) if done else 'nothing'}"]
    out += [f"not settled: {part}: {r.unsettled.get(part, 'cut off')}" for part, ok in r.settled.items() if not ok]
    if r.lower_bound_s is not None:
        out.append(f"best lower bound: {r.lower_bound_s:.4g} s/step (the solvers' step model)")
    return out


def prediction_lines(plan: Plan) -> list[str]:
    p: Prediction = plan.prediction
    t = plan.train
    return [
        f"model {plan.model.name} ({plan.graph.num_layers} decoder layers, seq {plan.model.seq_len}, "
        f"{plan.model.quantization}) on fleet {plan.cluster.name} ({len(plan.cluster.devices)} devices, "
        f"{len(plan.cluster.hosts)} hosts)",
        f"schedule {t.schedule}"
        + (f", interleaved ({len(plan.stages[0].spans())} chunks per device)" if plan.stages[0].chunks else "")
        + f": {t.num_micro_batches} micro-batches x {t.micro_batch_size} sequences "
        f"= {p.tokens_per_step} tokens per optimizer step",
        f"predicted step {fmt_time(p.step_time_s)}, {rate_line(p)}, pipeline bubble {p.bubble_fraction:.0%}",
        *replica_lines(plan),
        *state_copy_lines(p),
    ]


def state_copy_lines(p: Prediction) -> list[str]:
    """What keeping the run recoverable costs (runtime.elastic=auto), when the plan priced it."""
    if p.state_copy_every <= 0:
        return []
    every = "every step" if p.state_copy_every == 1 else f"every {p.state_copy_every} steps"
    return [f"runtime.elastic: the stages' state ({p.state_copy_bytes / 1e6:,.3g} MB) is copied to the coordinator's "
            f"memory {every}, {fmt_time(p.state_copy_s)} a copy (at most 1% of the steps' time); a lost device costs "
            f"at most the steps since"]


def rate_line(p: Prediction) -> str:
    """``1234 tok/s trained (5461 tok/s computed)``, or the computed rate with why nothing more is known."""
    if p.trained_tokens_per_s is not None:
        return f"{fmt_rate(p.trained_tokens_per_s)} trained ({fmt_rate(p.tokens_per_s)} computed)"
    return f"{fmt_rate(p.tokens_per_s)} computed (padding included: the data was not measured)"


# `hetero compile` warns when the longest record needs less than this share of model.seq_len, and when more than
# this share of the records is cut to it.
SEQ_LEN_WARN_SHARE, TRUNCATED_WARN_SHARE = 0.5, 0.05


def data_lines(plan: Plan, note: str = "") -> list[str]:
    """What the measured data means for this plan: records, tokens per record, packing efficiency and label
    share, records per step, steps and predicted time per epoch; a warning when model.seq_len is far above what
    the data needs. Without statistics: ``note`` (why), and that tokens/s count computed tokens."""
    d, t, p = plan.data_stats, plan.train, plan.prediction
    if d is None:
        why = f": {note}" if note else ""
        out = [f"data: not measured{why}; tokens/s count computed tokens, padding included"]
        if t.epochs > 0:
            out.append(f"train.epochs={t.epochs}: `hetero run` counts the steps per epoch when it reads the data")
        return out
    sampled = (f"{d.total_records:,} records, {d.records:,} sampled (by a fixed seed; figures scaled to the file)"
               if d.sampled else f"{d.total_records:,} records")
    rows_per_step = t.micro_batch_size * t.num_micro_batches
    per_row = d.total_records / max(d.rows_per_epoch, 1)
    steps = d.steps_per_epoch(t)
    cut = (f"; {d.truncated:,} of the {d.records:,} measured are longer than seq_len {d.seq_len} and cut to it"
           if d.truncated else "")
    if d.cut_before_tokenizing:
        cut += (f" ({d.cut_before_tokenizing:,} of them far longer than a row: tokenized from their start only, "
                "their counts here are lower bounds)")
    if d.packed:
        packing = (f"packing on: {per_row:.1f} records per {d.seq_len}-token row, {d.efficiency:.0%} of computed "
                   f"tokens are record tokens (packing efficiency), {d.label_fraction:.0%} carry a label")
    else:
        packing = (f"packing off (one record per {d.seq_len}-token row): {d.efficiency:.0%} of computed tokens are "
                   f"record tokens (packing efficiency), {d.label_fraction:.0%} carry a label")
    epoch_s = steps * p.step_time_s
    out = [
        f"data: {d.source}: {sampled}",
        f"  tokens per record: median {d.median_tokens:,}, p95 {d.p95_tokens:,}, longest {d.longest_tokens:,}{cut}",
        f"  {packing}",
        f"  per step: {rows_per_step} rows, about {rows_per_step * per_row:,.0f} records; {steps:,} steps per epoch, "
        f"predicted {fmt_duration(epoch_s)} per epoch at {fmt_time(p.step_time_s)}/step",
    ]
    if p.trained_tokens_per_s is not None:
        out.append(f"  predicted {fmt_rate(p.trained_tokens_per_s)} trained of {fmt_rate(p.tokens_per_s)} computed "
                   f"({p.tokens_per_step:,} tokens per step, about {p.tokens_per_step * d.label_fraction:,.0f} "
                   "with a label)")
    if t.epochs > 0:
        configured = (plan.config.get("train") or {}).get("steps") if isinstance(plan.config, dict) else None
        unused = f"; train.steps={configured} is not used" if configured not in (None, t.steps) else ""
        out.append(f"  train.epochs={t.epochs}: {t.epochs} x {d.rows_per_epoch:,} rows at {rows_per_step} a step = "
                   f"{t.steps:,} steps, predicted "
                   f"{fmt_duration(t.steps * p.step_time_s)} (`hetero run` counts them again over the whole file"
                   f"{unused})")
    if d.truncated > TRUNCATED_WARN_SHARE * d.records:
        keep = 64 * math.ceil(d.p95_tokens / 64)
        out.append(f"warning: {d.truncated / d.records:.0%} of the records are longer than model.seq_len={d.seq_len} "
                   f"and lose their ends" + (f" (model.seq_len={keep} keeps 95% of them whole)" if keep > d.seq_len
                                             else ""))
    if d.longest_tokens < SEQ_LEN_WARN_SHARE * d.seq_len:
        out.append(f"warning: model.seq_len={d.seq_len} is more than twice the longest record "
                   f"({d.longest_tokens:,} tokens{', in the sample' if d.sampled else ''}): "
                   f"model.seq_len={d.suggested_seq_len} holds every {'sampled ' if d.sampled else ''}record"
                   + (f" (packing keeps {d.seq_len}-token rows full, but each micro-batch's memory grows with "
                      "seq_len)" if d.packed else f"; now {1 - d.efficiency:.0%} of every step is padding"))
    return out


def replica_lines(plan: Plan) -> list[str]:
    """Data x pipeline: one line per replica (its stages, share of the batch, own step time) and the reduction."""
    if not plan.replicas:
        return []
    out = [f"{len(plan.replicas)} pipeline replicas, LoRA gradients summed at each step "
           f"({fmt_time(plan.prediction.reduce_s)}):"]
    for r, rep in enumerate(plan.replicas):
        devices = " -> ".join(plan.stages[k].device for k in rep.stages)
        out.append(f"  replica {r}: stages {rep.stages[0]}..{rep.stages[-1]} on {devices}; micro-batches "
                   f"{rep.first_micro_batch}..{rep.first_micro_batch + rep.num_micro_batches - 1} "
                   f"({rep.num_micro_batches} of {plan.train.num_micro_batches}), alone {fmt_time(rep.step_time_s)}/step")
    return out


def gantt_lines(timeline: TimelineLike, num_stages: int, width: int = 72) -> list[str]:
    """A text Gantt: one row per stage; digit n = forward of micro-batch n, letter = its backward.

    Backward of micro-batch n is the n-th letter (a = 0), so ``0`` and ``a`` are the same
    micro-batch; ``#`` is the optimizer step, ``.`` idle. Waits (RA/RG) and link transfers (SA/SG)
    are not device compute, so they are left out: they show as idle time.
    """
    end = max([timeline.step_time_s, *(e.end_s for e in timeline.events)] or [0.0])
    if end <= 0:
        return [f"stage {k} |{'.' * width}|" for k in range(num_stages)]
    dt = end / width
    rows = [["."] * width for _ in range(num_stages)]
    for e in sorted(timeline.events, key=lambda e: e.start_s):
        if not 0 <= e.stage < num_stages or e.op not in ("F", "B", "STEP"):
            continue
        # The epsilon keeps float noise (0.7 / 0.1 = 6.999...) from shifting an op by a column.
        lo = min(width - 1, math.floor(e.start_s / dt + 1e-6))
        hi = max(lo + 1, min(width, math.ceil(e.end_s / dt - 1e-6)))
        for c in range(lo, hi):
            rows[e.stage][c] = _gantt_char(e.op, e.mb)
    label = max(len(f"stage {num_stages - 1}"), 7)
    axis = f"{'':{label}} 0{fmt_time(end):>{width}}"
    return [f"{f'stage {k}':{label}} |{''.join(r)}|" for k, r in enumerate(rows)] + [axis]


def _gantt_char(op: str, mb: int) -> str:
    if op == "F":
        return "0123456789"[mb % 10]
    if op == "B":
        return "abcdefghij"[mb % 10]
    return "#"


def plan_renderables(
    plan: Plan, timeline: TimelineLike | None = None, note: str = "", gantt_width: int = 72
) -> list[RenderableType]:
    """Everything `hetero show` prints, in reading order."""
    out: list[RenderableType] = [Text(line) for line in prediction_lines(plan)]
    out += [Text(""), stage_table(plan), memory_table(plan), baseline_table(plan)]
    out.append(Text("solver  " + solver_line(plan)))
    out += [Text(f"        {line}") for line in settled_lines(plan)]
    if plan.verdict:
        out.append(Text("\nverdict", style="bold"))
        out += [Text(f"  - {v}") for v in plan.verdict]
    if timeline is not None:
        out.append(
            Text(
                f"\nschedule ({plan.train.schedule}, one optimizer step; digits = forward of "
                "micro-batch n, letters = backward, a = 0, # = optimizer step)",
                style="bold",
            )
        )
        out += [Text(line) for line in gantt_lines(timeline, len(plan.stages), gantt_width)]
    elif note:
        out.append(Text(f"\nschedule: {note}", style="dim"))
    return out


def print_plan(
    plan: Plan,
    console: Console | None = None,
    timeline: TimelineLike | None = None,
    note: str = "",
    gantt_width: int = 72,
) -> None:
    """Print the plan summary (and, given a simulated timeline, its Gantt)."""
    (console or Console()).print(Group(*plan_renderables(plan, timeline, note, gantt_width)))


def graph_table(graph: LayerGraph) -> Table:
    """The LayerGraph as a table: per node its parameters, FLOPs and the bytes crossing the cut after it."""
    table = Table(
        title=f"{graph.model_name} ({graph.model_type}): {len(graph.nodes)} nodes, seq {graph.seq_len}, "
        f"{graph.dtype}, {graph.quantization}",
        title_justify="left",
        header_style="bold",
    )
    for col, justify in [
        ("#", "right"),
        ("node", "left"),
        ("kind", "left"),
        ("params", "right"),
        ("weights", "right"),
        ("LoRA", "right"),
        ("fwd FLOP/tok", "right"),
        ("bwd FLOP/tok", "right"),
        ("act B/tok", "right"),
        ("cut B/tok", "right"),
    ]:
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for i, n in enumerate(graph.nodes):
        cut = graph.edges[i].bytes_per_token if i < len(graph.edges) else None
        table.add_row(
            str(i),
            n.name,
            n.kind + (f" [dim]{n.layer_type.removesuffix('_attention')}[/]" if n.layer_type else ""),
            _si(n.num_params),
            f"{n.param_bytes / 1e9:.3f} GB",
            _si(n.lora_params),
            _si(n.fwd_flops_per_token),
            _si(n.bwd_flops_per_token),
            _si(n.activation_bytes_per_token),
            "-" if cut is None else _si(cut),
        )
    total_params = sum(n.num_params for n in graph.nodes)
    total_bytes = sum(n.param_bytes for n in graph.nodes)
    table.caption = (
        f"total {_si(total_params)} parameters, {total_bytes / 1e9:.2f} GB of weights, "
        f"{_si(sum(n.lora_params for n in graph.nodes))} LoRA parameters"
    )
    return table


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"
