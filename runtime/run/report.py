"""The run's report: measured vs predicted step time and per-stage busy time (report.json + a terminal table)."""

from __future__ import annotations

import statistics
from typing import Any

from hetero.plan import Plan
from hetero.runtime.tools.run_compare import compare_run


def build_report(plan: Plan, steps: list[dict[str, Any]], build_s: dict[int, float], run_dir: str) -> dict[str, Any]:
    """Summarize metrics.jsonl lines against the plan's predictions (first step left out when possible)."""
    measured = steps[1:] if len(steps) > 1 else steps
    step_time = statistics.median(s["step_time_s"] for s in measured) if measured else None
    stages = []
    for k, sp in enumerate(plan.stages):
        busy = statistics.median(s["stage_busy"][k] for s in measured) if measured else None
        predicted_busy = plan.micro_batches_of(k) * (sp.fwd_time_s + sp.bwd_time_s)  # its replica's share
        stages.append({
            "stage": k, "host": sp.host, "device": sp.device, "layers": sp.node_names,
            "measured_busy_s": busy, "predicted_busy_s": predicted_busy,
            "measured_busy_fraction": (busy / step_time) if busy is not None and step_time else None,
            "predicted_busy_fraction": plan.prediction.stage_busy[k] if k < len(plan.prediction.stage_busy) else None,
            "build_s": build_s.get(k),
        })
    tokens = steps[0]["tokens"] if steps else 0
    return {
        "run_dir": run_dir,
        "plan_hash": plan.input_hash,
        "steps": len(steps),
        "first_loss": steps[0]["loss"] if steps else None,
        "final_loss": steps[-1]["loss"] if steps else None,
        "measured_step_time_s": step_time,
        "predicted_step_time_s": plan.prediction.step_time_s,
        "measured_over_predicted": (step_time / plan.prediction.step_time_s)
        if step_time and plan.prediction.step_time_s > 0 else None,
        "tokens_per_step": tokens,
        "measured_tokens_per_s": (tokens / step_time) if step_time else None,
        "predicted_tokens_per_s": plan.prediction.tokens_per_s,
        "stages": stages,
        # Measured vs predicted per stage, stages >20% off flagged, and the bottleneck in words.
        "comparison": compare_run(plan, steps) if steps else [],
    }


def print_report(report: dict[str, Any]) -> None:
    """A short table: predicted vs measured step time and per-stage busy time."""
    from rich.console import Console
    from rich.table import Table

    def fmt(x: float | None, unit: str = "s") -> str:
        return "-" if x is None else f"{x:.3f} {unit}".strip()

    def rate(x: float | None) -> str:
        return "-" if x is None else f"{x:,.0f}"

    import sys

    # The compile summary's width policy: the terminal's width, 140 columns when piped.
    console = Console(width=None if sys.stdout.isatty() else 140)
    console.print(f"[bold]run[/bold] {report['run_dir']}: {report['steps']} steps, loss "
                  f"{fmt(report['first_loss'], '')} -> {fmt(report['final_loss'], '')}", highlight=False)
    console.print(f"step time: measured {fmt(report['measured_step_time_s'])} (median), predicted "
                  f"{fmt(report['predicted_step_time_s'])}; tokens/s measured "
                  f"{rate(report['measured_tokens_per_s'])} vs predicted {rate(report['predicted_tokens_per_s'])}",
                  highlight=False)
    table = Table("stage", "host", "device", "busy measured", "busy predicted", "busy share", "build")
    for s in report["stages"]:
        share = s["measured_busy_fraction"]
        table.add_row(str(s["stage"]), s["host"], s["device"], fmt(s["measured_busy_s"]), fmt(s["predicted_busy_s"]),
                      "-" if share is None else f"{100 * share:.0f}%", fmt(s["build_s"]))
    console.print(table)
    for line in report.get("comparison", []):
        console.print(line, highlight=False, markup=False)
