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

# Subcommands whose argv goes untouched to hetero.runtime.cli (written alongside; imported lazily so
# `hetero compile` never loads the runtime, and the runtime never loads Hydra or the compiler).
RUNTIME_COMMANDS = {
    "run": ("main_run", "train a compiled plan: hetero run plan.json [key=value ...]"),
    "worker": ("main_worker", "serve this host's stages of a plan (started by `hetero run` or by hand)"),
    "generate": ("main_generate", "generate text with the base model plus a trained adapter"),
}

_OVERRIDES_HELP = (
    "Hydra overrides: model=<name> hardware=<fleet> train.<key>=<v> planner.<key>=<v> output=<dir> "
    "(groups: model, hardware, train, planner)"
)


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
    parser = argparse.ArgumentParser(
        prog="hetero",
        description="Declarative pipeline compiler for LoRA/QLoRA fine-tuning across mixed GPUs.",
        epilog="example: hetero compile model=llama8b hardware=homelab output=plans/llama8b",
    )
    parser.add_argument("--version", action="version", version=f"hetero {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def with_config(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "-cd", "--config-dir", help="your own config dir (e.g. ~/fleets with hardware/<fleet>.yaml)"
        )
        p.add_argument("overrides", nargs="*", help=_OVERRIDES_HELP)

    with_config(
        sub.add_parser("compile", help="trace the model, place it on the fleet, write plan.json + artifacts")
    )
    with_config(sub.add_parser("inspect", help="trace the model and print its LayerGraph (no planning)"))
    show = sub.add_parser("show", help="print a compiled plan: stages, memory, baselines, verdict, schedule")
    show.add_argument("plan", type=Path, help="path to plan.json")
    show.add_argument("--no-gantt", action="store_true", help="skip the simulated schedule")
    show.add_argument("--width", type=int, default=72, help="Gantt width in characters (default 72)")
    for name, (_, text) in RUNTIME_COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    # Pipes and CI logs get a wide fixed width so tables do not fold into unreadable columns.
    stream = sys.stderr if stderr else sys.stdout
    return Console(file=stream, width=None if stream.isatty() else 140, stderr=stderr)


def cmd_compile(config_dir: str | None, overrides: list[str]) -> int:
    """Config -> trace -> plan -> emit, with a progress line, then the plan summary."""
    from hetero import config as config_mod
    from hetero.show import print_plan

    out, status_console = _console(), _console(stderr=True)
    with status_console.status("composing config") as status:
        cfg = config_mod.load(overrides, config_dir)
        status.update(f"tracing {cfg.model.name} on the meta device")
        trace = _lazy("hetero.compiler.trace", "trace")
        graph = trace(cfg.model)
        status.update(
            f"planning {len(graph.nodes)} nodes on {len(cfg.cluster.devices)} devices "
            f"(solver limit {cfg.planner.time_limit_s:.0f} s)"
        )
        make_plan = _lazy("hetero.planner", "plan")
        plan = make_plan(cfg.model, graph, cfg.cluster, cfg.train, cfg.data, cfg.planner)
        plan.config = cfg.raw
        status.update(f"writing plan and artifacts to {cfg.output}")
        emit = _lazy("hetero.compiler.emit", "emit")
        paths = emit(plan, cfg.output)
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


def _run_runtime(command: str, argv: list[str]) -> int:
    func_name = RUNTIME_COMMANDS[command][0]
    func = _lazy("hetero.runtime.cli", func_name)
    code = func(argv)
    return int(code or 0)


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] in RUNTIME_COMMANDS:
        return _run_runtime(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "compile":
        return cmd_compile(args.config_dir, args.overrides)
    if args.command == "inspect":
        return cmd_inspect(args.config_dir, args.overrides)
    if args.command == "show":
        return cmd_show(args.plan, gantt=not args.no_gantt, width=args.width)
    raise AssertionError(args.command)  # argparse rejects anything else


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hetero` console script."""
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
