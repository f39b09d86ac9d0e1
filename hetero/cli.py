"""The `hetero` command: compile, inspect, show, and the runtime's run / worker / generate.

argparse, not Hydra's CLI: Hydra only composes the config (hetero.config). Every HeteroError is
printed as one line, ``hetero: error: <message>``, with exit code 2; Ctrl-C exits with 130.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hetero import __version__
from hetero.errors import HeteroError

# Subcommands whose argv goes untouched to "package.module:function" under hetero.runtime (imported lazily
# so `hetero compile` never loads the runtime, and the runtime never loads Hydra or the compiler).
RUNTIME_COMMANDS = {
    "run": ("run.cli:main_run", "train a compiled plan: hetero run plan.json [key=value ...]"),
    "worker": ("run.cli:main_worker", "serve this host's stages of a plan (started by `hetero run` or by hand)"),
    "generate": ("run.cli:main_generate", "generate text with the base model plus a trained adapter"),
    "export": ("tools.export:main_export", "merge a run's adapter into its base model: a standalone model for serving "
               "(hetero export RUN_DIR --out DIR)"),
}

_OVERRIDES_HELP = (
    "Hydra overrides: model=<name> hardware=<fleet> train.<key>=<v> planner.<key>=<v> lora.<key>=<v> "
    "data.<key>=<v> eval.<key>=<v> profile=<file> output=<dir> (names and defaults below)"
)


_SWEEP_EXAMPLE = ("sweep example: hetero compile -m model=llama8b hardware=homelab,mixed_fleet "
                  "model.quantization=none,nf4 output=sweeps/llama8b")


class NotBuiltError(HeteroError):
    """A part of hetero this command needs is not installed or not written yet."""


def _lazy(module: str, name: str) -> Callable[..., Any]:
    """Import ``module.name`` when a command needs it; a missing piece is a one-line error."""
    try:
        return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]
    except (ImportError, AttributeError) as exc:
        raise NotBuiltError(f"{module}.{name} is not built yet ({exc})") from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and for docs)."""
    from hetero.config import choices_help

    parser = argparse.ArgumentParser(
        prog="hetero",
        description="Declarative pipeline compiler for LoRA/QLoRA fine-tuning across mixed GPUs.",
        epilog=f"{choices_help(commands=False)}\n\nexample: hetero compile model=llama8b hardware=homelab "
               "output=plans/llama8b\n`hetero compile --help` lists every key with its default.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"hetero {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def with_config(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "-cd", "--config-dir", help="your own config dir (e.g. ~/fleets with hardware/<fleet>.yaml)"
        )
        p.add_argument("overrides", nargs="*", help=_OVERRIDES_HELP)

    compile_parser = sub.add_parser(
        "compile", help="trace the model, place it on the fleet, write plan.json + artifacts",
        epilog=f"{choices_help()}\n\n{_SWEEP_EXAMPLE}", formatter_class=argparse.RawDescriptionHelpFormatter)
    compile_parser.add_argument(
        "-m", "--multirun", action="store_true",
        help="sweep: compile every combination of key=a,b / key=range(1,4) / key=choice(a,b) values, "
             "each into output/<key=value,...>/, and compare them in one table and output/sweep.csv "
             "(docs/quickstart.md)")
    with_config(compile_parser)
    with_config(sub.add_parser("inspect", help="trace the model and print its LayerGraph (no planning)"))
    show = sub.add_parser("show", help="print a compiled plan: stages, memory, baselines, verdict, schedule")
    show.add_argument("plan", type=Path, help="path to plan.json")
    show.add_argument("--no-gantt", action="store_true", help="skip the simulated schedule")
    show.add_argument("--width", type=int, default=72, help="Gantt width in characters (default 72)")
    with_config(sub.add_parser(
        "profile", help="measure every device and link of a fleet for a model: hetero profile hardware=F model=M "
        "[output=profile.json]", epilog=choices_help(commands=False),
        formatter_class=argparse.RawDescriptionHelpFormatter))
    sim = sub.add_parser("simulate", help="predicted schedule of a plan: Gantt, bubble, utilization, memory, what-ifs")
    sim.add_argument("plan", type=Path, help="path to plan.json")
    sim.add_argument("--width", type=int, default=72, help="Gantt width in characters (default 72)")
    sim.add_argument("--no-replan", action="store_true", help="skip the one-device-removed what-ifs (they re-plan)")
    sim.add_argument("--picture", type=Path, help="where to draw it (default: simulate.png next to plan.json)")
    sim.add_argument("--run", type=Path, metavar="RUN_DIR",
                     help="also compare a finished `hetero run` of this plan: measured, predicted, and replayed "
                          "with the run's own per-action times")
    keys = sub.add_parser("keys", help="make new keys for a plan's processes (rotation); old copies stop working")
    keys.add_argument("plan", type=Path, help="path to plan.json (rewritten with the new public keys)")
    keys.add_argument("--mode", choices=["auto", "curve", "token", "none"], default=None,
                      help="change the plan's security mode (default: keep it)")
    for name, (_, text) in RUNTIME_COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def cmd_keys(plan_path: Path, mode: str | None) -> int:
    """New key files under the plan's artifacts/<host>/keys and the new public keys in plan.json."""
    from hetero.plan import Plan
    from hetero.security import generate, resolve_mode

    plan = Plan.load(plan_path)
    addresses = [plan.cluster.host(s.host).address for s in plan.stages]
    chosen = resolve_mode(mode, addresses) if mode is not None else plan.security.mode
    plan.security = generate(chosen, [s.host for s in plan.stages], plan_path.parent)
    plan.save(plan_path)
    out = _console()
    if chosen == "none":
        out.print(f"{plan_path}: security none (no keys): only for a network you trust completely", highlight=False)
        return 0
    out.print(f"{plan_path}: new {chosen} keys for {len(plan.security.public_keys) or len(plan.stages) + 1} processes",
              highlight=False)
    for host in sorted({s.host for s in plan.stages}):
        out.print(f"  copy {plan_path.parent / 'artifacts' / host / 'keys'} and plan.json to host {host}",
                  highlight=False)
    return 0


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    # Pipes and CI logs get a wide fixed width so tables do not fold into unreadable columns.
    stream = sys.stderr if stderr else sys.stdout
    return Console(file=stream, width=None if stream.isatty() else 140, stderr=stderr)


def compile_config(cfg: Any, say: Callable[[str], None]) -> tuple[Any, list[Path]]:
    """Trace, plan and emit one composed config (a compile or a sweep's point); ``say`` gets progress."""
    from hetero import warnings_log

    warnings_log.log_to(Path(cfg.output) / "warnings.log")  # library warnings: the plan's dir, not the terminal
    say(f"tracing {cfg.model.name} on the meta device")
    trace = _lazy("hetero.compiler.trace", "trace_with_module")
    graph, traced = trace(cfg.model)
    say(f"planning {len(graph.nodes)} nodes on {len(cfg.cluster.devices)} devices "
        f"(solver limit {cfg.planner.time_limit_s:.0f} s)")
    make_plan = _lazy("hetero.planner", "plan")
    cost_model = profile_cost_model(cfg)
    plan = make_plan(cfg.model, graph, cfg.cluster, cfg.train, cfg.data, cfg.planner, cost_model=cost_model,
                     evaluation=cfg.eval)
    plan.config = cfg.raw
    if cost_model is not None:
        plan.cost_sources = {"profile": str(cfg.profile), **cost_model.sources}
        plan.verdict += cost_model.summary()
    say(f"writing plan and artifacts to {cfg.output}")
    from hetero.security import generate

    plan.security = generate(cfg.security, [s.host for s in plan.stages], Path(cfg.output))
    emit = _lazy("hetero.compiler.emit", "emit")
    return plan, emit(plan, cfg.output, traced)


def cmd_compile(config_dir: str | None, overrides: list[str], multirun: bool = False) -> int:
    """Config -> trace -> plan -> emit, with a progress line, then the plan summary; -m: hetero.sweep."""
    from hetero import config as config_mod
    from hetero import sweep
    from hetero.show import print_plan

    out, status_console = _console(), _console(stderr=True)
    if multirun:
        return sweep.run_sweep(overrides, config_dir, compile_config, out, status_console)
    sweep.refuse_sweeps(overrides)
    with status_console.status("composing config") as status:
        cfg = config_mod.load(overrides, config_dir)
        plan, paths = compile_config(cfg, status.update)
    print_plan(plan, out)
    out.print("\n[bold]wrote[/]")
    for path in paths:
        out.print(f"  {path}", highlight=False)
    plan_json = next((p for p in paths if Path(p).name == "plan.json"), Path(cfg.output) / "plan.json")
    out.print(f"\nnext: hetero run {plan_json}", highlight=False)
    return 0


def cmd_inspect(config_dir: str | None, overrides: list[str]) -> int:
    """Trace the model and print its LayerGraph."""
    from hetero import config as config_mod
    from hetero.show import graph_table

    cfg = config_mod.load(overrides, config_dir)
    with _console(stderr=True).status(f"tracing {cfg.model.name} on the meta device"):
        graph = _lazy("hetero.compiler.trace", "trace")(cfg.model)
    out = _console()
    out.print(graph_table(graph))
    for note in graph.notes:
        out.print(f"note: {note}", highlight=False)
    return 0


def cmd_show(plan_path: Path, gantt: bool = True, width: int = 72) -> int:
    """Print a plan and (unless disabled) the Gantt of its simulated schedule."""
    from hetero.plan import Plan
    from hetero.show import print_plan

    plan = Plan.load(plan_path)
    timeline, note = None, ""
    if gantt:
        try:
            simulate = _lazy("hetero.planner.simulator", "simulate_plan")
        except NotBuiltError as exc:
            note = str(exc)
        else:
            timeline = simulate(plan)
    print_plan(plan, _console(), timeline, note, gantt_width=width)
    return 0


def profile_cost_model(cfg: Any) -> Any:
    """The ProfileCostModel for ``profile=PATH`` (checked against this fleet and model), else None."""
    if cfg.profile is None:
        return None
    from hetero.hints import suggest
    from hetero.planner.cost import RooflineCostModel
    from hetero.planner.profile_cost import ProfileCostModel
    from hetero.profile import Profile

    profile = Profile.load(cfg.profile)
    rerun = suggest("profile", cfg.raw, fallback=[f"hardware={cfg.cluster.name}", f"model={cfg.model.name}"],
                    add=[f"output={cfg.profile}"])
    return ProfileCostModel(profile, RooflineCostModel(cfg.planner.efficiency), path=str(cfg.profile),
                            cluster=cfg.cluster, model=cfg.model, rerun=rerun)


def cmd_profile(config_dir: str | None, overrides: list[str]) -> int:
    """Measure every device and host pair of the fleet for the model; write the profile file."""
    from rich.progress import Progress

    from hetero import config as config_mod
    from hetero.profile import MEASURED_PARTS, Profile, fleet_hash, model_hash, now_iso
    from hetero.specs import BYTES_PER_DTYPE

    cfg = config_mod.load(overrides, config_dir)
    out_path = cfg.output if cfg.output.suffix == ".json" else cfg.output / "profile.json"
    from hetero import warnings_log

    warnings_log.log_to(out_path.parent / "profile-logs" / "warnings.log")
    measure = _lazy("hetero.runtime.tools.profile_worker", "measure_fleet")
    fhash, mhash = fleet_hash(cfg.cluster), model_hash(cfg.model)
    num_pairs = len(_lazy("hetero.runtime.tools.profile_worker", "_link_pairs")(cfg.cluster))
    err = _console(stderr=True)
    with Progress(console=err, transient=True) as bar:
        task = bar.add_task(f"profiling {cfg.model.name} on {cfg.cluster.name}",
                            total=len(cfg.cluster.devices) * (len(MEASURED_PARTS) + 1) + num_pairs)

        def on_event(line: str) -> None:
            if line.startswith("on host"):
                err.print(line, highlight=False)
                return
            bar.update(task, advance=1, description=line)

        devices, links = measure(cfg.cluster, cfg.model, cfg.train.micro_batch_size, fhash + mhash,
                                 log_dir=out_path.parent / "profile-logs", on_event=on_event)
    profile = Profile(fleet=cfg.cluster.name, fleet_hash=fhash, model=cfg.model.name, model_hash=mhash,
                      devices=devices, links=links, created=now_iso(),
                      notes=[f"micro_batch_size={cfg.train.micro_batch_size}, seq_len={cfg.model.seq_len}"])
    profile.save(out_path)
    out = _console()
    for d in devices:
        dec = d.layers["decoder"]
        tokens = cfg.train.micro_batch_size * cfg.model.seq_len
        out.print(f"{d.device}: decoder layer fwd {dec.fwd.at(tokens) * 1e3:.2f} ms + bwd {dec.bwd.at(tokens) * 1e3:.2f} ms "
                  f"at {tokens} tokens (r2 {dec.fwd.r2:.2f}/{dec.bwd.r2:.2f}), threads {d.threads}", highlight=False)
        extra = []
        if d.optimizer is not None:
            extra.append(f"optimizer step {d.optimizer.at(dec.lora_params) * 1e3:.2f} ms per decoder layer's LoRA")
        if d.message_send is not None and d.message_recv is not None:
            size = tokens * int(cfg.model.architecture.get("hidden_size", 0)) * BYTES_PER_DTYPE.get(d.dtype, 4)
            extra.append(f"a {size / 1e6:.2g} MB activation costs {d.message_send.at(size) * 1e3:.2f} ms to send, "
                         f"{d.message_recv.at(size) * 1e3:.2f} ms to receive")
        if extra:
            out.print(f"  {'; '.join(extra)}", highlight=False)
    for lk in links:
        out.print(f"link {lk.a}<->{lk.b}: {lk.bandwidth_gbps:.2f} Gbit/s, {lk.latency_us:.0f} us", highlight=False)
    from hetero.hints import suggest

    compile_next = suggest("compile", cfg.raw, fallback=[], add=[f"profile={out_path}"])
    out.print(f"wrote {out_path}\nnext: {compile_next}", highlight=False)
    return 0


def run_versus_plan(plan: Any, run_dir: Path) -> list[str]:
    """Lines comparing a finished run with its plan: measured, predicted, and the replay of the run's own times."""
    import json

    from hetero.errors import ConfigError
    from hetero.plan import Plan
    from hetero.planner.simulator import replay_run
    from hetero.runtime.tools.run_compare import median_step_s, stage_timings_from_metrics

    metrics_path = run_dir / "metrics.jsonl"
    try:
        metrics = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        raise ConfigError(f"{metrics_path} does not exist: pass the --run-dir of a finished `hetero run`") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{metrics_path} line {exc.lineno}: not JSON ({exc.msg}); is it a hetero run's metrics?") from None
    metrics = [m for m in metrics if "step_time_s" in m]  # training steps; eval_loss lines are the evaluator's
    if (run_dir / "plan.json").is_file():
        ran = Plan.load(run_dir / "plan.json")
        shape = [(s.device, s.first_node, s.last_node, s.program) for s in ran.stages]
        if shape != [(s.device, s.first_node, s.last_node, s.program) for s in plan.stages]:
            raise ConfigError(f"{run_dir} ran another plan (other stages, spans or schedule) than this one: "
                              "compare a run with the plan it ran")
    timings = stage_timings_from_metrics(metrics)
    if not timings or len(timings) != len(plan.stages):
        raise ConfigError(f"{metrics_path} has no per-stage timings for this {len(plan.stages)}-stage plan")
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


def cmd_simulate(plan_path: Path, width: int = 72, replan: bool = True, picture: Path | None = None,
                 run_dir: Path | None = None) -> int:
    """Print and draw a plan's predicted schedule, its bottleneck and what-if comparisons."""
    from hetero.plan import Plan
    from hetero.show import gantt_lines

    plan = Plan.load(plan_path)
    simulate = _lazy("hetero.planner.simulator", "simulate_plan")
    bottleneck = _lazy("hetero.planner.bottleneck", "verdict")
    whatif = _lazy("hetero.planner.whatif", "what_ifs")
    memory_over_time = _lazy("hetero.planner.whatif", "memory_over_time")
    timeline = simulate(plan)
    out = _console()
    out.print(f"[bold]{plan.model.name} on {plan.cluster.name}[/]: {len(plan.stages)} stage(s), {plan.train.schedule}, "
              f"{plan.train.num_micro_batches} micro-batches; predicted {timeline.step_time_s:.4g} s/step, "
              f"bubble {timeline.bubble_fraction:.0%}")
    for line in gantt_lines(timeline, len(plan.stages), width):
        out.print(line, highlight=False)
    memory = memory_over_time(plan, timeline)
    for k, sp in enumerate(plan.stages):
        peak = max(gb for _, gb in memory[k])
        recompute = (f"; {len(sp.recompute_layers)} layers recompute ({', '.join(sp.recompute_layers[:2])}"
                     f"{', ...' if len(sp.recompute_layers) > 2 else ''}), +{sp.recompute_time_s:.3g} s of backward "
                     "per micro-batch" if sp.recompute_layers else "")
        out.print(f"stage {k} {sp.device}: utilization {timeline.busy_fraction[k]:.0%}, peak memory {peak:.2f} GB "
                  f"of {sp.memory.available_gb:.1f} GB{recompute}", highlight=False)
    out.print("\n[bold]bottleneck[/]")
    for line in bottleneck(plan):
        out.print(f"  {line}", highlight=False)
    out.print("\n[bold]what if[/]")
    cost_model = None
    if replan and plan.cost_sources.get("profile"):
        from hetero.planner.cost import RooflineCostModel
        from hetero.planner.profile_cost import ProfileCostModel
        from hetero.profile import Profile

        cost_model = ProfileCostModel(Profile.load(plan.cost_sources["profile"]),
                                      RooflineCostModel(plan.planner.efficiency))
    for w in whatif(plan, cost_model, replan):
        out.print(f"  {w.versus(plan)}", highlight=False)
    if run_dir is not None:
        out.print(f"\n[bold]run {run_dir}[/]")
        for line in run_versus_plan(plan, run_dir):
            out.print(f"  {line}", highlight=False)
    path = picture or plan_path.parent / "simulate.png"
    draw_simulation = _lazy("hetero.compiler.pictures", "draw_simulation")
    draw_simulation(plan, timeline, memory, path)
    out.print(f"\nwrote {path}", highlight=False)
    return 0


def _run_runtime(command: str, argv: list[str]) -> int:
    module, _, func_name = RUNTIME_COMMANDS[command][0].rpartition(":")
    func = _lazy(f"hetero.runtime.{module}", func_name)
    code = func(argv)
    return int(code or 0)


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] in RUNTIME_COMMANDS:
        return _run_runtime(argv[0], argv[1:])
    if argv and argv[0] == "compile":
        # Hydra users write -m anywhere (`... key=a,b -m`); argparse takes it only before the overrides.
        sweep_flags = [a for a in argv[1:] if a in ("-m", "--multirun")]
        argv = ["compile", *sweep_flags, *(a for a in argv[1:] if a not in sweep_flags)]
    args = build_parser().parse_args(argv)
    if args.command == "compile":
        return cmd_compile(args.config_dir, args.overrides, multirun=args.multirun)
    if args.command == "inspect":
        return cmd_inspect(args.config_dir, args.overrides)
    if args.command == "profile":
        return cmd_profile(args.config_dir, args.overrides)
    if args.command == "simulate":
        return cmd_simulate(args.plan, width=args.width, replan=not args.no_replan, picture=args.picture,
                            run_dir=args.run)
    if args.command == "show":
        return cmd_show(args.plan, gantt=not args.no_gantt, width=args.width)
    if args.command == "keys":
        return cmd_keys(args.plan, args.mode)
    raise AssertionError(args.command)  # argparse rejects anything else


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hetero` console script."""
    from hetero import warnings_log

    warnings_log.route_to_log()
    try:
        return _dispatch(list(sys.argv[1:] if argv is None else argv))
    except HeteroError as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"hetero: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hetero: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
