"""Entry points behind `hetero run`, `hetero worker` and `hetero generate` (argv lists in, exit codes out).

HeteroErrors propagate: hetero/cli.py prints them as one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from hetero.errors import ConfigError
from hetero.plan import Plan
from hetero.serde import from_dict, to_dict
from hetero.specs import RUNTIME_OVERRIDABLE, TrainSpec

PLACEMENT_SECTIONS = ("model", "lora", "hardware", "cluster", "planner", "data")


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


def _sigterm_as_interrupt() -> None:
    """SIGTERM stops the run in order (stages told to stop, logs kept), like Ctrl-C."""
    import signal
    import threading

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def default_run_dir(plan: Plan) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{plan.model.name}"


def main_run(argv: list[str]) -> int:
    """`hetero run plan.json [key=value ...] [--run-dir D] [--host NAME] [--port P]`."""
    from hetero.runtime.coordinator import Coordinator, RunOptions
    from hetero.runtime.report import build_report, print_report

    ap = argparse.ArgumentParser(prog="hetero run", description="Train with a compiled plan.")
    ap.add_argument("plan", type=Path)
    ap.add_argument("overrides", nargs="*", help=f"run-time keys: {', '.join(sorted(RUNTIME_OVERRIDABLE))}")
    ap.add_argument("--run-dir", type=Path)
    ap.add_argument("--host", help="the plan host this coordinator runs on (default: stage 0's host)")
    ap.add_argument("--port", type=int, help="coordinator port (default: that host's base port - 1)")
    ap.add_argument("--handshake-timeout", type=float, default=600.0, help="seconds to wait for every stage to say hello")
    ap.add_argument("--resume", type=Path, help="continue from RUN_DIR/checkpoints/step-N (any split of the same model)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_intermixed_args(argv)  # overrides may come before or after the options

    plan = Plan.load(args.plan)
    train = parse_overrides(args.overrides, plan.train)
    plan = replace(plan, train=train)
    from hetero.runtime.worker import coordinator_endpoint

    coordinator_endpoint(plan, args.host, args.port)  # validates --host before anything is created
    run_dir = args.run_dir or default_run_dir(plan)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    plan_path = run_dir / "plan.json"
    plan.save(plan_path)  # the overrides are in it; the input hash is unchanged (they are not placement)
    config = dict(plan.config) if plan.config else {}
    config["train"] = to_dict(train)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))

    options = RunOptions(run_dir=run_dir, host=args.host, port=args.port,
                         handshake_timeout_s=args.handshake_timeout, progress=not args.no_progress,
                         resume=args.resume)
    _sigterm_as_interrupt()
    result = Coordinator(plan, plan_path, options).run()
    report = build_report(plan, result.steps, result.build_s, str(run_dir))
    (run_dir / "report.json").write_text(json.dumps(report, indent=1))
    print_report(report)
    print(f"adapter: {run_dir / 'adapter'}   metrics: {run_dir / 'metrics.jsonl'}")
    return 0


def main_worker(argv: list[str]) -> int:
    """`hetero worker plan.json --host NAME [--coordinator tcp://...]`."""
    from hetero.runtime.worker import main_worker as run

    return run(argv)


def main_generate(argv: list[str]) -> int:
    """`hetero generate RUN_DIR --prompt "..." [--max-new-tokens N]`."""
    from hetero.runtime.generate import main_generate as run

    return run(argv)
