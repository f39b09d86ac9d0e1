"""The `hetero` command: compile, inspect, show, simulate, profile, keys, and the runtime's run / worker /
generate / export.

argparse, not Hydra's CLI: Hydra only composes the config (hetero.config). Every HeteroError is
printed as one line, ``hetero: error: <message>``, with exit code 2; Ctrl-C exits with 130.

Importing this package loads no compiler, planner, runtime or Hydra: each command imports what it needs
inside its function, so `hetero compile` never loads the runtime and `hetero run` never loads Hydra or
the compiler.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from hetero import __version__
from hetero.cli.config_commands import (
    cmd_compile,
    cmd_inspect,
    cmd_profile,
    compile_config,
    profile_cost_model,
)
from hetero.cli.plan_commands import cmd_keys, cmd_show, cmd_simulate
from hetero.errors import HeteroError
from hetero.plan import plan_path
from hetero.runtime.base import warnings_log

__all__ = [
    "RUNTIME_COMMANDS", "build_parser", "cmd_compile", "cmd_inspect", "cmd_keys", "cmd_profile", "cmd_show",
    "cmd_simulate", "compile_config", "main", "profile_cost_model",
]

# Subcommands whose argv goes untouched to a function of the runtime: (module, function, help).
RUNTIME_COMMANDS = {
    "run": ("hetero.runtime.cli", "main_run", "train a compiled plan: hetero run plan.json [key=value ...]"),
    "worker": ("hetero.runtime.cli", "main_worker",
               "serve this host's stages of a plan (started by `hetero run` or by hand)"),
    "generate": ("hetero.runtime.cli", "main_generate", "generate text with the base model plus a trained adapter"),
    "profile-worker": ("hetero.runtime.tools.profile_worker", "main", "measure this host's device for a `hetero "
                       "profile` started on another host (the command it prints)"),
    "export": ("hetero.runtime.tools.export", "main_export", "merge a run's adapter into its base model: a standalone "
               "model for serving (hetero export RUN_DIR --out DIR)"),
}

_OVERRIDES_HELP = (
    "Hydra overrides: model=<name> hardware=<fleet> train.<key>=<v> planner.<key>=<v> lora.<key>=<v> "
    "data.<key>=<v> eval.<key>=<v> profile=<file> output=<dir> (names and defaults below)"
)

_SWEEP_EXAMPLE = ("sweep example: hetero compile -m model=llama8b hardware=homelab,mixed_fleet "
                  "model.quantization=none,nf4 output=sweeps/llama8b")


class NotBuiltError(HeteroError):
    """A part of hetero this command needs is not installed or not written yet."""


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
    show.add_argument("plan", type=plan_path, help="plan.json, or the directory hetero compile wrote")
    show.add_argument("--no-gantt", action="store_true", help="skip the simulated schedule")
    show.add_argument("--width", type=int, default=72, help="Gantt width in characters (default 72)")
    show.add_argument("--hosts", action="store_true",
                      help="only what each host needs: what to install, the ports to open, what to copy there")
    show.add_argument("--pictures", action="store_true",
                      help="(re)draw placement.png and schedule.png next to plan.json (a compile that ran out of "
                           "time leaves them out)")
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
    for name, (_, _, text) in RUNTIME_COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def _runtime_entry(command: str) -> Callable[[list[str]], int | None]:
    """The runtime function behind ``command``, imported only now (the runtime loads torch; only its own
    commands pay for that); a runtime that is not installed is a one-line error."""
    module, name, _ = RUNTIME_COMMANDS[command]
    try:
        return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]
    except (ImportError, AttributeError) as exc:
        raise NotBuiltError(f"{module}.{name} is not built yet ({exc})") from None


def _options_first(args: list[str]) -> list[str]:
    """Hydra users write -m and -cd DIR anywhere (`... key=a,b -m`, `... -cd ~/fleets output=x`); argparse takes
    options only before the overrides: move them there, in their order."""
    options: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-cd", "--config-dir") and i + 1 < len(args):
            options += args[i:i + 2]
            i += 2
            continue
        (options if arg in ("-m", "--multirun") or arg.startswith("--config-dir=") else rest).append(arg)
        i += 1
    return options + rest


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] in RUNTIME_COMMANDS:
        return int(_runtime_entry(argv[0])(argv[1:]) or 0)
    if argv and argv[0] in ("compile", "inspect", "profile"):
        argv = [argv[0], *_options_first(argv[1:])]
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
        return cmd_show(args.plan, gantt=not args.no_gantt, width=args.width, pictures=args.pictures,
                        hosts=args.hosts)
    if args.command == "keys":
        return cmd_keys(args.plan, args.mode)
    raise AssertionError(args.command)  # argparse rejects anything else


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hetero` console script."""
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
