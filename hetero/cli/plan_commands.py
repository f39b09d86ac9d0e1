"""The commands that read a compiled plan.json: `hetero show`, `hetero simulate`, `hetero keys`.

None of them composes a config (no Hydra) or traces a model; `simulate` loads the planner, and the
compiler only to draw its picture.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from hetero.cli.console import console
from hetero.errors import ConfigError

if TYPE_CHECKING:
    from hetero.plan import Plan
    from hetero.planner.simulator import Timeline


def cmd_keys(plan_path: Path, mode: str | None) -> int:
    """New key files under the plan's artifacts/<host>/keys and the new public keys in plan.json."""
    from hetero.plan import Plan
    from hetero.security import generate, resolve_mode

    old = Plan.load(plan_path)
    addresses = [old.cluster.host(s.host).address for s in old.stages]
    chosen = resolve_mode(mode, addresses) if mode is not None else old.security.mode
    plan = replace(old, security=generate(chosen, [s.host for s in old.stages], plan_path.parent))
    plan.save(plan_path)
    out = console()
    if chosen == "none":
        out.print(f"{plan_path}: security none (no keys): only for a network you trust completely", highlight=False)
        return 0
    out.print(f"{plan_path}: new {chosen} keys for {len(plan.security.public_keys) or len(plan.stages) + 1} processes",
              highlight=False)
    for host in sorted({s.host for s in plan.stages}):
        out.print(f"  copy {plan_path.parent / 'artifacts' / host / 'keys'} and plan.json to host {host}",
                  highlight=False)
    return 0


def cmd_show(plan_path: Path, gantt: bool = True, width: int = 72) -> int:
    """Print a plan and (unless disabled) the Gantt of its simulated schedule."""
    from hetero.cli.show import print_plan
    from hetero.plan import Plan

    plan = Plan.load(plan_path)
    timeline = None
    if gantt:
        from hetero.planner.simulator import simulate_plan  # the planner only when there is a Gantt to draw

        timeline = simulate_plan(plan)
    print_plan(plan, console(), timeline, gantt_width=width)
    return 0


def run_versus_plan(plan: Plan, run_dir: Path) -> list[str]:
    """Lines comparing a finished run with its plan: measured, predicted, and the replay of the run's own times."""
    from hetero.planner.simulator import replay_run
    from hetero.runtime.tools.run_compare import median_step_s, stage_timings_from_metrics

    metrics = _run_metrics(plan, run_dir)
    timings = stage_timings_from_metrics(metrics)
    if not timings or len(timings) != len(plan.stages):
        raise ConfigError(f"{run_dir / 'metrics.jsonl'} has no per-stage timings for this {len(plan.stages)}-stage plan")
    measured = median_step_s(metrics)
    predicted = plan.prediction.step_time_s
    replayed = replay_run(plan, timings).step_time_s
    lines = [f"measured {measured:.4g} s/step (median over {len(metrics)} steps, the first left out); predicted {predicted:.4g} s "
             f"(measured/predicted {measured / predicted:.2f}); replayed with the run's own per-action times "
             f"{replayed:.4g} s (measured/replayed {measured / replayed:.2f})"]
    if abs(measured / replayed - 1) <= 0.10 < abs(measured / predicted - 1):
        lines.append("The schedule model holds (the replay is within 10%): the per-stage compute estimates were off. "
                     "Re-profile (`hetero profile`) on a quiet machine, or look for a device slower than profiled.")
    elif abs(measured / replayed - 1) > 0.10:
        lines.append("Even the run's own per-action times do not add up to its step: it lost time the simulator does "
                     "not model (transfer latency, stages sharing cores, other load on the hosts).")
    else:
        lines.append("The prediction held (within 10%).")
    return lines


def _run_metrics(plan: Plan, run_dir: Path) -> list[dict]:  # type: ignore[type-arg]
    """The training steps of a finished run of ``plan`` (metrics.jsonl); one line if it is not one."""
    from hetero.plan import Plan

    metrics_path = run_dir / "metrics.jsonl"
    try:
        metrics = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        raise ConfigError(f"{metrics_path} does not exist: pass the --run-dir of a finished `hetero run`") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{metrics_path} line {exc.lineno}: not JSON ({exc.msg}); is it a hetero run's metrics?") from None
    if (run_dir / "plan.json").is_file():
        ran = Plan.load(run_dir / "plan.json")
        shape = [(s.device, s.first_node, s.last_node, s.program) for s in ran.stages]
        if shape != [(s.device, s.first_node, s.last_node, s.program) for s in plan.stages]:
            raise ConfigError(f"{run_dir} ran another plan (other stages, spans or schedule) than this one: "
                              "compare a run with the plan it ran")
    return [m for m in metrics if "step_time_s" in m]  # training steps; eval_loss lines are the evaluator's


def cmd_simulate(plan_path: Path, width: int = 72, replan: bool = True, picture: Path | None = None,
                 run_dir: Path | None = None) -> int:
    """Print and draw a plan's predicted schedule, its bottleneck and what-if comparisons."""
    from hetero.cli.show import gantt_lines
    from hetero.compiler.pictures import draw_simulation
    from hetero.plan import Plan
    from hetero.planner.bottleneck import verdict as bottleneck
    from hetero.planner.simulator import simulate_plan
    from hetero.planner.whatif import memory_over_time

    plan = Plan.load(plan_path)
    timeline = simulate_plan(plan)
    out = console()
    out.print(f"[bold]{plan.model.name} on {plan.cluster.name}[/]: {len(plan.stages)} stage(s), {plan.train.schedule}, "
              f"{plan.train.num_micro_batches} micro-batches; predicted {timeline.step_time_s:.4g} s/step, "
              f"bubble {timeline.bubble_fraction:.0%}")
    for line in gantt_lines(timeline, len(plan.stages), width):
        out.print(line, highlight=False)
    memory = memory_over_time(plan, timeline)
    for line in _stage_lines(plan, timeline, memory):
        out.print(line, highlight=False)
    out.print("\n[bold]bottleneck[/]")
    for line in bottleneck(plan):
        out.print(f"  {line}", highlight=False)
    out.print("\n[bold]what if[/]")
    for line in _what_if_lines(plan, replan):
        out.print(f"  {line}", highlight=False)
    if run_dir is not None:
        out.print(f"\n[bold]run {run_dir}[/]")
        for line in run_versus_plan(plan, run_dir):
            out.print(f"  {line}", highlight=False)
    path = picture or plan_path.parent / "simulate.png"
    draw_simulation(plan, timeline, memory, path)
    out.print(f"\nwrote {path}", highlight=False)
    return 0


def _stage_lines(plan: Plan, timeline: Timeline, memory: list[list[tuple[float, float]]]) -> list[str]:
    """Per stage: its utilization, peak memory over the step, and what recomputation costs it."""
    lines = []
    for k, sp in enumerate(plan.stages):
        peak = max(gb for _, gb in memory[k])
        recompute = (f"; {len(sp.recompute_layers)} layers recompute ({', '.join(sp.recompute_layers[:2])}"
                     f"{', ...' if len(sp.recompute_layers) > 2 else ''}), +{sp.recompute_time_s:.3g} s of backward "
                     "per micro-batch" if sp.recompute_layers else "")
        lines.append(f"stage {k} {sp.device}: utilization {timeline.busy_fraction[k]:.0%}, peak memory {peak:.2f} GB "
                     f"of {sp.memory.available_gb:.1f} GB{recompute}")
    return lines


def _what_if_lines(plan: Plan, replan: bool) -> list[str]:
    """The what-ifs against this plan; re-planning with the plan's own profile when it was made with one."""
    from hetero.planner.whatif import what_ifs

    cost_model = None
    if replan and plan.cost_sources.get("profile"):
        from hetero.planner.cost_model import RooflineCostModel
        from hetero.planner.profile_cost import ProfileCostModel
        from hetero.profile import Profile

        cost_model = ProfileCostModel(Profile.load(plan.cost_sources["profile"]),
                                      RooflineCostModel(plan.planner.efficiency), path=plan.cost_sources["profile"])
    return [w.versus(plan) for w in what_ifs(plan, cost_model, replan)]
