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

if TYPE_CHECKING:
    from hetero.plan import Plan
    from hetero.planner.schedule.simulator import Timeline


def cmd_keys(plan_path: Path, mode: str | None) -> int:
    """New key files under the plan's artifacts/<host>/keys and the new public keys in plan.json."""
    from hetero.plan import Plan, has_security
    from hetero.security import COORDINATOR, generate_for, resolve_mode

    old = Plan.load(plan_path, require_security=False)  # a plan that lost its security section is repaired here
    addresses = [old.cluster.host(s.host).address for s in old.stages]
    lost = not has_security(json.loads(Path(plan_path).read_text()))
    chosen = resolve_mode(mode or "auto", addresses) if mode is not None or lost else old.security.mode
    # Each stage's key under its process name (a re-planned run's plan keeps the names its devices had).
    names = {COORDINATOR: old.stages[0].host, **{old.stage_id(k): s.host for k, s in enumerate(old.stages)}}
    plan = replace(old, security=generate_for(chosen, names, plan_path.parent))
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


def cmd_show(plan_path: Path, gantt: bool = True, width: int = 72, pictures: bool = False, hosts: bool = False) -> int:
    """Print a plan and (unless disabled) the Gantt of its simulated schedule; ``pictures``: also draw
    placement.png and schedule.png next to plan.json, as `hetero compile` does; ``hosts``: only what each host
    needs (hetero/cli/hosts_view.py)."""
    from hetero.cli.show import data_lines, print_plan
    from hetero.plan import Plan

    plan = Plan.load(plan_path)
    if hosts:
        from hetero.cli.hosts_view import host_lines

        for line in host_lines(plan, plan_path):
            console().print(line, highlight=False, markup=False, soft_wrap=True)
        return 0
    timeline = None
    if gantt:
        from hetero.planner.schedule.simulator import (
            simulate_plan,  # the planner only when there is a Gantt to draw
        )

        timeline = simulate_plan(plan)
    out = console()
    print_plan(plan, out, timeline, gantt_width=width)
    out.print()
    for line in data_lines(plan):
        out.print(line, highlight=False, markup=False, soft_wrap=True)
    if pictures:
        from hetero.compiler.emit import draw_pictures

        for path in draw_pictures(plan, plan_path.parent):
            out.print(f"wrote {path}", highlight=False)
    return 0


def skipped_pictures_line(plan_json: Path, written: list[Path], time_limit_s: float) -> str | None:
    """The line a compile prints when it left pictures out to keep to its time limit: which, and how to
    draw them; None when it drew them all."""
    from hetero.compiler.emit import PICTURES, PICTURES_ALLOWANCE_S

    skipped = [name for name in PICTURES if plan_json.parent / name not in written]
    if not skipped:
        return None
    return (f"not drawn, to keep to planner.time_limit_s={time_limit_s:g} (+{PICTURES_ALLOWANCE_S:g} s for "
            f"pictures, tracing aside): {', '.join(skipped)}; draw them with: hetero show {plan_json} --pictures")


def _steps_picture(plan: Plan, run_dir: Path) -> str:
    """The run's steps.png: the one `hetero run` drew, else drawn now from its metrics.jsonl."""
    from hetero.runtime.run.run_compare import finished_run
    from hetero.runtime.run.steps_picture import draw_steps

    path = run_dir / "steps.png"
    if path.is_file():
        return str(path)
    try:
        return str(draw_steps(plan, finished_run(plan, run_dir).lines, path))
    except OSError as exc:  # a run directory one may read but not write
        return f"not drawn ({path}: {exc.strerror or exc})"


def cmd_simulate(plan_path: Path, width: int = 72, replan: bool = True, picture: Path | None = None,
                 run_dir: Path | None = None) -> int:
    """Print and draw a plan's predicted schedule, its bottleneck and what-if comparisons."""
    from hetero.cli.show import gantt_lines
    from hetero.compiler.pictures import draw_simulation
    from hetero.plan import Plan
    from hetero.planner.explain.bottleneck import verdict as bottleneck
    from hetero.planner.replan.whatif import memory_over_time
    from hetero.planner.schedule.simulator import simulate_plan

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
        from hetero.runtime.run.run_compare import versus_plan

        for line in versus_plan(plan, run_dir):
            out.print(f"  {line}", highlight=False)
        out.print(f"  step times over the run: {_steps_picture(plan, run_dir)}", highlight=False)
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
        stream = (f"; {sp.stream_summary()}, {sp.memory.host_gb:.1f} GB of it in RAM ({sp.stream_layers[0]}.."
                  f"{sp.stream_layers[-1]})" if sp.stream_layers else "")
        lines.append(f"stage {k} {sp.device}: utilization {timeline.busy_fraction[k]:.0%}, peak memory {peak:.2f} GB "
                     f"of {sp.memory.available_gb:.1f} GB{recompute}{stream}")
    return lines


def _what_if_lines(plan: Plan, replan: bool) -> list[str]:
    """The what-ifs against this plan; re-planning with the plan's own profile when it was made with one."""
    from hetero.planner.replan.whatif import what_ifs

    cost_model = None
    if replan and plan.cost_sources.get("profile"):
        from hetero.planner.model.cost_model import plan_roofline
        from hetero.planner.model.profile_cost import ProfileCostModel
        from hetero.profile import load_merged

        cost_model = ProfileCostModel(load_merged(plan.cost_sources["profile"]),
                                      plan_roofline(plan), path=plan.cost_sources["profile"])
    return [w.versus(plan) for w in what_ifs(plan, cost_model, replan)]
