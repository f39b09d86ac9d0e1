"""Entry points behind `hetero run`, `hetero worker` and `hetero generate` (argv lists in, exit codes out).

HeteroErrors propagate: hetero.cli prints them as one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from hetero.errors import CheckpointError, ConfigError, PlanError
from hetero.plan import Plan, plan_path
from hetero.protocol import FAILURE_TIMEOUT_S, LOAD_TIMEOUT_S
from hetero.runtime.run.options import (
    MAX_RECOVERIES,
    SNAPSHOT_EVERY_S,
    STEP_TIMEOUT_FACTOR,
    STEP_TIMEOUT_MIN_S,
)
from hetero.security import key_dirs
from hetero.serde import from_dict, to_dict
from hetero.specs import RUNTIME_OVERRIDABLE, EvalSpec, TrainSpec, check_eval, check_ranges, check_run_length

if TYPE_CHECKING:
    from hetero.runtime.run.coordinator import RunOptions, RunResult

PLACEMENT_SECTIONS = ("model", "lora", "hardware", "cluster", "planner", "data")
# `hetero run runtime.KEY=VALUE`: how the run watches its processes and devices (not training settings).
RUN_OPTIONS = {
    "elastic": "auto (default): when a stage's device is lost, re-plan on the devices left and go on from the last "
               "state copied off the stages; off: stop with the resume command",
    "failure_timeout_s": f"a working stage or coordinator silent this long is dead (default {FAILURE_TIMEOUT_S:g})",
    "load_timeout_s": f"the same while a stage loads its weights (default {LOAD_TIMEOUT_S:g})",
    "max_recoveries": f"lost devices a runtime.elastic=auto run goes on without before it stops (default "
                      f"{MAX_RECOVERIES})",
    "rebalance": "auto (default): move layers between stages when a device's speed changes for good; off: keep "
                 "the plan's split",
    "snapshot_every_s": f"seconds of training between the run's own checkpoints (default {SNAPSHOT_EVERY_S:g}; 0: "
                        "only train.checkpoint_every's and the last)",
    "step_timeout_s": f"the longest one optimizer step may take before the run stops with an error (default "
                      f"{STEP_TIMEOUT_FACTOR:g}x the plan's predicted step, at least {STEP_TIMEOUT_MIN_S:g})",
    "wandb": "a Weights & Biases project to log the steps to as well (needs `pip install wandb`; TensorBoard files "
             "are always written)",
}
REBALANCE_MODES = ("auto", "off")
MODES = {"rebalance": REBALANCE_MODES, "elastic": ("auto", "off")}


def _take_prefixed(pairs: list[str], prefix: str) -> tuple[list[str], list[tuple[str, str, str, str]]]:
    """Split ``pairs`` into the rest and the ``PREFIX.NAME=VALUE`` ones, as (key, name, sep, raw) each."""
    rest: list[str] = []
    taken: list[tuple[str, str, str, str]] = []
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if key.startswith(prefix):
            taken.append((key, key[len(prefix):], sep, raw))
        else:
            rest.append(pair)
    return rest, taken


def split_run_options(pairs: list[str]) -> tuple[list[str], dict[str, Any]]:
    """Take the ``runtime.KEY=VALUE`` pairs out of ``pairs``; returns the rest and their values."""
    rest, taken = _take_prefixed(pairs, "runtime.")
    values: dict[str, Any] = {}
    for key, name, sep, raw in taken:
        if name not in RUN_OPTIONS:
            raise ConfigError(f"unknown run option '{key}'; `hetero run` accepts "
                              f"{', '.join('runtime.' + n for n in sorted(RUN_OPTIONS))}")
        if name in MODES:
            if raw not in MODES[name]:
                raise ConfigError(f"{key} must be one of {', '.join(MODES[name])}, got {raw!r}")
            values[name] = raw
            continue
        if name == "wandb":
            from hetero.runtime.run.wandb_log import check_project

            values[name] = check_project(key, raw)
            continue
        if name == "max_recoveries":
            if not (raw.isdigit() and int(raw) <= 1000):
                raise ConfigError(f"{key} must be a whole number from 0 to 1000 (0: never recover), got {raw!r}")
            values[name] = int(raw)
            continue
        try:
            value = float(raw) if sep else math.nan
        except ValueError:
            value = math.nan
        if name == "snapshot_every_s" and value == 0:
            values[name] = 0.0  # off
            continue
        if not (math.isfinite(value) and value >= 1.0):
            off = " or 0 (off)" if name == "snapshot_every_s" else ""
            raise ConfigError(f"{key} must be a number of seconds >= 1{off} (e.g. {key}=10), got {raw!r}")
        values[name] = value
    return rest, values


def split_eval_options(pairs: list[str], evaluation: EvalSpec) -> tuple[list[str], EvalSpec]:
    """Take the ``eval.KEY=VALUE`` pairs out of ``pairs``; returns the rest and the plan's eval settings
    with them applied (held-out evaluation may change at every run)."""
    rest, taken = _take_prefixed(pairs, "eval.")
    known = to_dict(evaluation)
    values: dict[str, Any] = {}
    for key, name, sep, raw in taken:
        if not sep or name not in known:
            raise ConfigError(f"unknown eval option '{key}{sep}{raw}'; `hetero run` accepts "
                              f"{', '.join('eval.' + n + '=...' for n in known)}")
        try:
            values[name] = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise ConfigError(f"override '{key}{sep}{raw}': cannot parse the value {raw!r}") from None
    out = from_dict(EvalSpec, {**known, **values}, "eval", ConfigError)
    check_eval(out)
    return rest, out


def resume_train(train: TrainSpec, pairs: list[str], saved: dict[str, Any] | None) -> tuple[TrainSpec, str | None]:
    """The training settings of a resumed run: the checkpoint's, then the command line's overrides.

    Returns them and one line naming the keys the command line changed from the checkpoint (or None).
    """
    if saved is None:
        return parse_overrides(pairs, train), None
    settings = {k: v for k, v in saved.items() if k in RUNTIME_OVERRIDABLE}
    base = from_dict(TrainSpec, {**to_dict(train), **settings}, "checkpoint COMPLETE train", CheckpointError)
    out = parse_overrides(pairs, base)
    given = {}
    for pair in pairs:
        key, _, raw = pair.partition("=")
        given[key[len("train."):] if key.startswith("train.") else key] = raw
    changed = [f"{k}: checkpoint {settings[k]}, now {raw} (from the command line)" for k, raw in given.items()
               if k in settings and getattr(out, k) != settings[k]]
    return out, ("hetero run: resuming with settings that differ from the checkpoint: " + "; ".join(changed)
                 if changed else None)


def parse_overrides(pairs: list[str], train: TrainSpec) -> TrainSpec:
    """Apply ``key=value`` / ``train.key=value`` overrides; only RUNTIME_OVERRIDABLE keys may change."""
    values: dict[str, Any] = {}
    train_keys = set(to_dict(train))
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{pair}' is not key=value (e.g. lr=1e-4 or train.steps=50)")
        name = key[len("train."):] if key.startswith("train.") else key
        section = key.split(".", 1)[0] if "." in key else ""
        if name in RUNTIME_OVERRIDABLE and (not section or section == "train"):
            try:
                values[name] = yaml.safe_load(raw)
            except yaml.YAMLError:
                raise ConfigError(f"override '{pair}': cannot parse the value {raw!r}") from None
            continue
        if section == "data":  # not placement, but read from plan.json (docs/data.md)
            raise ConfigError(f"{key} is fixed in plan.json: recompile with `hetero compile ... {key}={raw}` "
                              "(same placement and plan hash, so other hosts' copies still match)")
        if section in PLACEMENT_SECTIONS or (section == "train" and name in train_keys) or name in train_keys:
            shown = key if "." in key else f"train.{key}"
            raise ConfigError(f"{shown} changes the placement: recompile with `hetero compile ... {shown}={raw}`")
        raise ConfigError(
            f"unknown override '{key}'; `hetero run` accepts {', '.join(sorted(RUNTIME_OVERRIDABLE))}"
        )
    merged = {**to_dict(train), **values}
    # YAML reads 1e-4 as a string; numbers in float fields are accepted as int or float.
    for name in ("lr", "weight_decay", "max_grad_norm"):
        if isinstance(merged[name], str):
            try:
                merged[name] = float(merged[name])
            except ValueError:
                raise ConfigError(f"train.{name} must be a number, got {merged[name]!r}") from None
    out = from_dict(TrainSpec, merged, "override", ConfigError)
    if out.steps < 1:
        raise ConfigError(f"train.steps must be at least 1, got {out.steps}")
    return out


def default_run_dir(plan: Plan) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{plan.model.name}"


def main_run(argv: list[str]) -> int:
    """`hetero run plan.json [key=value ...] [--run-dir D] [--host NAME] [--port P]`."""
    from hetero.runtime.base.rundir import RunDirWriteError
    from hetero.runtime.run.elastic import run_elastic
    from hetero.runtime.run.launcher import StageLauncher

    args = _run_parser().parse_intermixed_args(argv)  # overrides may come before or after the options
    plan, checkpoint, timeouts = _run_settings(Plan.load(args.plan), args)
    if args.engine == "torch":
        return _run_on_torch(plan, args, checkpoint, timeouts)
    # Stages import torch and the model's code in a forked launcher while the checks below run.
    launcher = StageLauncher.start(plan.model.architecture) if _local_stages(plan, args.host) else None
    try:
        plan, plan_path, options = _prepare_run(plan, args, checkpoint, timeouts)
        print(startup_line(plan, options.run_dir), flush=True)
        try:
            # runtime.elastic=auto: a lost device is left out and the run goes on, on a new plan (elastic.py).
            plan, plan_path, result = run_elastic(plan, plan_path, replace(options, launcher=launcher))
        except KeyboardInterrupt:  # a second Ctrl-C (or the first, before training): stopped at once
            print(_stopped_at_once(plan_path, options), file=sys.stderr)
            return 130
    finally:
        if launcher is not None:
            launcher.close()
    try:
        return _finish_run(plan, plan_path, options, result)
    except RunDirWriteError as exc:  # its resume command repeats this run's --host/--port
        raise exc.for_run(options.rerun) from None


def startup_line(plan: Plan, run_dir: Path) -> str:
    """What `hetero run` starts, before the stages load their weights (seconds to minutes of quiet otherwise):
    ``hetero run: 3 stages (box: 0 rtx4090, 1 rtx3090; nas: 2 cpu), loading weights; run directory runs/x (stage
    logs in runs/x/logs/)``."""
    hosts: dict[str, list[str]] = {}
    for s in plan.stages:
        hosts.setdefault(s.host, []).append(f"{s.index} {s.device_type}")
    where = "; ".join(f"{host}: {', '.join(stages)}" for host, stages in hosts.items())
    count = len(plan.stages)
    return (f"hetero run: {count} stage{'s' if count != 1 else ''} ({where}), loading weights; run directory "
            f"{run_dir} (stage logs in {run_dir / 'logs'}/)")


def _run_on_torch(plan: Plan, args: argparse.Namespace, checkpoint: Path | None, timeouts: dict[str, Any]) -> int:
    """`hetero run --engine torch`: the same checks, run directory and records, on torch.distributed.pipelining."""
    from hetero.runtime.run.options import step_timeout_s
    from hetero.runtime.torch_engine.support import check_supported

    backend = check_supported(plan, args.host)  # one line before anything starts
    from hetero.runtime.torch_engine.network import check_hosts

    check_hosts(plan, args.port, args.trusted_network)  # several hosts: addresses, the rendezvous port
    if timeouts.get("wandb"):
        raise ConfigError("runtime.wandb logs from hetero's own engine only: drop --engine torch, or watch the run "
                          "with TensorBoard (RUN_DIR/tensorboard)")
    if timeouts.get("rebalance") == "auto":  # asked for by name
        print("hetero run: --engine torch keeps the plan's split (layers move between stages only on "
              "--engine hetero)", file=sys.stderr)
    plan, plan_path, options = _prepare_run(plan, args, checkpoint, timeouts)
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from hetero.runtime.base.processes import StageFailedError
    from hetero.runtime.torch_engine.launch import run_torch

    # torch.distributed has one timeout for every wait, the first (every stage built) included.
    timeout = max(step_timeout_s(plan, options.step_timeout_s), options.load_timeout_s)
    try:
        result = run_torch(plan, plan_path, options.run_dir, backend, options.resume, options.progress, timeout,
                           port=args.port, ssh_hosts=options.ssh_hosts, trusted=args.trusted_network,
                           compiled=args.plan)
    except (KeyboardInterrupt, SignalException):  # torch's launcher stops its processes at once
        print(_stopped_at_once(plan_path, options), file=sys.stderr)
        return 130
    except StageFailedError as exc:  # one line: which rank failed, and how to go on (on either engine)
        raise StageFailedError(f"{exc}; {_continue_hint(plan_path, options)}") from None
    return _finish_run(plan, plan_path, options, result)


def _continue_hint(plan_path: Path, options: RunOptions) -> str:
    """How to go on after a failed run: from its newest complete checkpoint, or from the start."""
    from hetero.runtime.base.rundir import checkpoint_step, latest_checkpoint, run_command

    again, newest = run_command(plan_path, options.rerun), latest_checkpoint(options.run_dir)
    if newest is not None:
        return (f"continue after step {checkpoint_step(newest)} with "
                f"`{shlex.join(again + ['--resume', str(options.run_dir)])}`")
    return f"no checkpoint yet: start again with `{shlex.join(again + ['--run-dir', str(options.run_dir)])}`"


def _local_stages(plan: Plan, host: str | None) -> bool:
    """Whether the coordinator's host runs stages itself (otherwise nothing is worth preloading)."""
    return any(s.host == (host or plan.stages[0].host) for s in plan.stages)


def _run_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hetero run", description="Train with a compiled plan.")
    ap.add_argument("plan", type=plan_path, help="plan.json, or the directory hetero compile wrote")
    ap.add_argument("overrides", nargs="*", help=f"run-time keys: {', '.join(sorted(RUNTIME_OVERRIDABLE))}; "
                    f"run options: {', '.join('runtime.' + k for k in sorted(RUN_OPTIONS))}")
    ap.add_argument("--run-dir", type=Path)
    ap.add_argument("--host", help="the plan host this coordinator runs on (default: stage 0's host)")
    ap.add_argument("--port", type=int, help="coordinator port (default: that host's base port - 1)")
    ap.add_argument("--handshake-timeout", type=float, default=600.0, help="seconds to wait for every stage to say hello")
    ap.add_argument("--resume", type=Path, metavar="RUN_DIR",
                    help="continue a run from its newest complete checkpoint (or from RUN_DIR/checkpoints/step-N, "
                         "any split of the same model), with its training settings; the run directory defaults to RUN_DIR")
    ap.add_argument("--engine", choices=("hetero", "torch"), default="hetero",
                    help="hetero (default): hetero's ZeroMQ runtime, any mix of devices, hosts and torch versions; "
                         "torch: torch.distributed.pipelining, one device kind and one torch on every host "
                         "(docs/running.md)")
    ap.add_argument("--trusted-network", action="store_true",
                    help="--engine torch: allow host addresses outside private and loopback ranges (torch.distributed "
                         "neither authenticates nor encrypts: docs/security.md)")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def _run_settings(plan: Plan, args: argparse.Namespace) -> tuple[Plan, Path | None, dict[str, Any]]:
    """The plan with the command line's training and eval settings (or a resumed checkpoint's), the
    checkpoint to resume from, and the ``runtime.KEY=SECONDS`` run options."""
    pairs, timeouts = split_run_options(args.overrides)
    pairs, evaluation = split_eval_options(pairs, plan.eval)
    checkpoint = None
    if args.resume is not None:
        from hetero.runtime.run.checkpoint import checkpoint_settings, resolve_resume

        checkpoint = resolve_resume(args.resume)
        train, changed = resume_train(plan.train, pairs, checkpoint_settings(checkpoint))
        if changed:
            print(changed, flush=True)
    else:
        train = parse_overrides(pairs, plan.train)
    check_ranges(plan.model, train, plan.planner, ConfigError)  # lr=nan, steps=1e9, ...: one line, now
    given = any(p.partition("=")[0] in ("epochs", "train.epochs") for p in pairs)
    origin = "the checkpoint's" if checkpoint is not None else "the plan's"
    check_run_length(train, pairs, "" if given else f" ({origin})")  # epochs: steps are counted at _prepare_run
    return replace(plan, train=train, eval=evaluation), checkpoint, timeouts


def _prepare_run(plan: Plan, args: argparse.Namespace, checkpoint: Path | None,
                 timeouts: dict[str, Any]) -> tuple[Plan, Path, RunOptions]:
    """Every check that can fail before a stage starts (one line, before the run directory exists), then
    the run directory with plan.json and config.yaml; returns the plan as it runs (train.epochs > 0: with the
    steps they make), that plan.json and the RunOptions."""
    from hetero.runtime.run.coordinator import RunOptions, coordinator_endpoint
    from hetero.runtime.run.preflight import preflight, prepare_run_dir
    from hetero.runtime.run.ssh import check_ssh_hosts, ssh_hosts

    host = args.host or plan.stages[0].host
    coordinator_endpoint(plan, args.host, args.port)  # validates --host before anything is created
    if plan.eval.every > 0:
        from hetero.runtime.run.eval_client import eval_device_name
        from hetero.runtime.run.stage_eval import evaluates_on_stages, refusal

        if not evaluates_on_stages(plan):
            eval_device_name(plan, plan.eval, host)  # eval.device: one line if it cannot evaluate
        elif (why := refusal(plan)) is not None:
            raise ConfigError(why)
    run_dir = args.run_dir or default_run_dir(plan)
    if args.run_dir is None and checkpoint is not None and checkpoint != args.resume:
        run_dir = checkpoint.parent.parent  # --resume RUN_DIR goes on in RUN_DIR
    # The torch engine binds none of the plan's ports (its rendezvous takes a free one): only hetero's are checked.
    checked = preflight(plan, run_dir, args.host, args.port, checkpoint, ports=args.engine != "torch")
    plan = checked.plan or plan  # train.epochs: the steps they make, in the run's plan.json and every stage's welcome
    remote = ssh_hosts(plan, args.plan, host)
    check_ssh_hosts(plan, remote, host)  # each has hetero and this plan
    config = dict(plan.config) if plan.config else {}
    config["train"] = to_dict(plan.train)
    config["eval"] = to_dict(plan.eval)
    # plan.json has the overrides in it; the input hash is unchanged (they are not placement).
    plan_path = prepare_run_dir(plan, run_dir, yaml.safe_dump(config, sort_keys=False))
    from hetero.runtime.base import warnings_log

    warnings_log.log_to(run_dir / "logs" / "warnings.log")  # library warnings: the run's logs, not the terminal
    return plan, plan_path, RunOptions(run_dir=run_dir, host=args.host, port=args.port,
                                       handshake_timeout_s=args.handshake_timeout, progress=not args.no_progress,
                                       resume=checked.resume, checkpoint=checked.checkpoint, batches=checked.batches,
                                       key_dirs=key_dirs(args.plan, host), ssh_hosts=remote, **timeouts)


def _stopped_at_once(plan_path: Path, options: RunOptions) -> str:
    """The line after a run stopped at once: how to continue from its newest complete checkpoint, if any."""
    from hetero.runtime.base.rundir import checkpoint_step, latest_checkpoint, run_command

    run_dir, again = options.run_dir, run_command(plan_path, options.rerun)
    newest = latest_checkpoint(run_dir)  # complete ones only: one cut short by the second Ctrl-C is not there
    if newest is not None:
        return (f"hetero: stopped at once; newest checkpoint {newest} (after step {checkpoint_step(newest)}): continue "
                f"with `{shlex.join(again + ['--resume', str(run_dir)])}`")
    if options.resume is not None:
        return (f"hetero: stopped at once, before a new checkpoint: continue with "
                f"`{shlex.join(again + ['--resume', str(options.resume), '--run-dir', str(run_dir)])}`")
    return (f"hetero: stopped at once, before any checkpoint was complete: nothing to keep; start again with "
            f"`{shlex.join(again + ['--run-dir', str(run_dir)])}`")


def _finish_run(plan: Plan, plan_path: Path, options: RunOptions, result: RunResult) -> int:
    """After the run: how to continue an interrupted one (exit 130), else the report (exit 0)."""
    from hetero.runtime.base.rundir import run_command
    from hetero.runtime.run.metrics_file import NAME
    from hetero.runtime.run.report import print_report, write_report

    run_dir = options.run_dir
    if result.interrupted_after is not None:
        again = run_command(plan_path, options.rerun)
        if result.checkpoint is None:
            print(f"hetero: interrupted before the first step finished: nothing to keep; start again with "
                  f"`{shlex.join(again + ['--run-dir', str(run_dir)])}`", file=sys.stderr)
        else:
            print(f"hetero: interrupted after step {result.interrupted_after}: checkpoint {result.checkpoint}; "
                  f"continue with `{shlex.join(again + ['--resume', str(run_dir)])}`", file=sys.stderr)
        return 130
    report = write_report(plan, result.steps, result.build_s, run_dir, result.events)  # + steps.png
    print_report(report)
    print(f"adapter: {run_dir / 'adapter'}   metrics: {run_dir / NAME}   "
          f"tensorboard --logdir {run_dir / 'tensorboard'}")
    if (run_dir / "profile.json").is_file():  # the run is a profile: plan the next one from it (docs/profiling.md)
        from hetero.hints import suggest

        hint = suggest("compile", plan.config, fallback=[f"model={plan.model.name}", f"hardware={plan.cluster.name}"],
                       add=[f"profile={run_dir}"])
        print(f"plan the next run from what this one measured: {hint}")
    return 0


def _worker_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hetero worker", description="Run this host's stages of a plan.")
    ap.add_argument("plan", type=plan_path, help="plan.json, or the directory hetero compile wrote")
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--host", help="run every stage the plan places on this host")
    group.add_argument("--stage", type=int, help="run one stage (what --host starts per device)")
    ap.add_argument("--coordinator", help="tcp://ADDRESS:PORT of `hetero run` (default: stage 0's host, base port - 1)")
    ap.add_argument("--run-dir", type=Path, help="where this host writes its stage logs (default runs/worker-<host>-<time>)")
    ap.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--check", action="store_true",
                    help="with --host: print one line (hetero's version, the plan's hash, or what is missing) and exit; "
                         "`hetero run` asks this of the hosts it starts over ssh")
    ap.add_argument("--watch-stdin", action="store_true",
                    help="with --host: stop this host's stages when stdin closes (how `hetero run` ends workers it "
                         "started over ssh)")
    ap.add_argument("--engine", choices=("hetero", "torch"), default="hetero",
                    help="torch: this host's torch launcher of a `hetero run --engine torch` on several hosts")
    ap.add_argument("--rendezvous", metavar="ADDRESS:PORT", help="--engine torch: node 0's rendezvous")
    ap.add_argument("--timeout", type=float, default=600.0, help="--engine torch: seconds any collective may wait")
    ap.add_argument("--trusted-network", action="store_true", help="--engine torch: as `hetero run --trusted-network`")
    return ap


def main_worker(argv: list[str]) -> int:
    """`hetero worker plan.json --host NAME` (or --stage k): serve this host's stages of a plan."""
    args = _worker_parser().parse_args(argv)
    if args.check:
        if args.host is None:
            raise PlanError("--check goes with --host NAME")
        from hetero.runtime.run.ssh import check_report, said_problems

        report = check_report(args.plan, args.host)
        problems = said_problems(report)  # a person reads these lines; `hetero run` over ssh reads the last
        for problem in problems:
            print(f"hetero worker --check: host {args.host}: {problem}", file=sys.stderr, flush=True)
        if not problems:
            print(f"hetero worker --check: host {args.host} is ready to run its stages", file=sys.stderr, flush=True)
        print(report, flush=True)
        return 2 if problems else 0
    from hetero.runtime.run.coordinator import coordinator_endpoint

    plan = Plan.load(args.plan)
    coordinator = args.coordinator or coordinator_endpoint(plan)
    if args.stage is not None:
        from hetero.runtime.stage.process import serve_stage

        return serve_stage(args.plan, plan, args.stage, coordinator, args.parent_pid)
    run_dir = args.run_dir or Path("runs") / f"worker-{args.host}-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.engine == "torch":
        if args.host is None or args.rendezvous is None:
            raise PlanError("--engine torch goes with --host NAME and --rendezvous ADDRESS:PORT (as `hetero run` "
                            "prints them)")
        from hetero.runtime.torch_engine.launch import serve_torch_node

        return serve_torch_node(args.plan, plan, args.host, run_dir, args.rendezvous, args.timeout, args.watch_stdin,
                                args.trusted_network)
    from hetero.runtime.run.host import check_host, serve_host

    check_host(args.plan, plan, args.host)  # before the run directory exists
    from hetero.runtime.run.preflight import warn_ephemeral

    warn_ephemeral(plan, args.host, prog="hetero worker")
    return serve_host(args.plan, plan, args.host, run_dir, coordinator, watch_stdin=args.watch_stdin)


def main_generate(argv: list[str]) -> int:
    """`hetero generate RUN_DIR --prompt "..." [--max-new-tokens N]`."""
    from hetero.runtime.tools.generate import main_generate as run

    return run(argv)
