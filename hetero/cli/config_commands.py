"""The commands that compose a Hydra config: `hetero compile` (and its sweep), `hetero inspect`, `hetero profile`.

Each command imports what it needs inside its function: `hetero compile` never loads the runtime, and
every `hetero run` / `hetero worker` (which import this package too) starts without the compiler, the
planner, Hydra or rich's tables.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from hetero.cli.console import console
from hetero.runtime.base import warnings_log

if TYPE_CHECKING:
    from hetero.config import Config
    from hetero.plan import Plan
    from hetero.planner.model.profile_cost import ProfileCostModel
    from hetero.profile import DeviceProfile, LinkProfile


def compile_config(cfg: Config, say: Callable[[str], None],
                   started: float | None = None) -> tuple[Plan, list[Path]]:
    """Trace, plan and emit one composed config (a compile or a sweep's point); ``say`` gets progress.

    The one place a compiled Plan is finished: the planner returns it complete but for its keys, which
    need the chosen stages' hosts and are written next to the artifacts. ``started`` (time.perf_counter()
    when the compile began): the pictures start only within planner.time_limit_s plus tracing plus
    emit.PICTURES_ALLOWANCE_S of it; None draws them always."""
    trace_started = time.perf_counter()  # tracing (torch's import with it) is outside planner.time_limit_s
    from hetero.cli.data_stats import check_data_file, measure_data, refuse_unlabeled
    from hetero.compiler.emit import PICTURES_ALLOWANCE_S, emit
    from hetero.compiler.trace import trace_with_module
    from hetero.planner import plan as make_plan
    from hetero.security import generate

    warnings_log.log_to(Path(cfg.output) / "warnings.log")  # library warnings: the plan's dir, not the terminal
    say(f"checking the data ({cfg.data.path or 'the bundled demo set'})")
    check_data_file(cfg.data, cfg.model.seq_len)  # a file `hetero run` could not use stops the compile here, in one line
    say(f"measuring the data ({cfg.data.path or 'the bundled demo set'}) with the model's tokenizer")
    stats, _ = measure_data(cfg.model, cfg.data)  # None (and why): the plan counts computed tokens only
    refuse_unlabeled(stats, cfg.data)
    say(f"tracing {cfg.model.name} on the meta device")
    # Packed rows attend within each record: their attention is priced at the records' lengths.
    # The head computes logits for label tokens only: priced at the data's label share.
    graph, traced = trace_with_module(cfg.model, stats.attention_len if stats and stats.packed else None,
                                      stats.label_fraction if stats else None)
    train = cfg.train
    if train.epochs > 0 and stats is not None:  # `hetero run` counts them again from the data it reads
        train = replace(train, steps=stats.steps_per_epoch(train, train.epochs))
    tracing_s = time.perf_counter() - trace_started  # and measuring the data: both outside the solver's limit
    say(f"planning {len(graph.nodes)} nodes on {len(cfg.cluster.devices)} devices "
        f"(solver limit {cfg.planner.time_limit_s:.0f} s)")
    cost_model = profile_cost_model(cfg)
    planned = make_plan(cfg.model, graph, cfg.cluster, train, cfg.data, cfg.planner,
                        cost_model=cost_model, evaluation=cfg.eval, config=cfg.raw, data_stats=stats,
                        security=cfg.security)
    say(f"writing plan and artifacts to {cfg.output}")
    plan = replace(planned, security=generate(cfg.security, [s.host for s in planned.stages], Path(cfg.output)))
    if plan.planner.split is None:  # a device that adds little is named, with how to leave it out (priced with the keys)
        from hetero.planner.replan.whatif import cheap_device_lines

        say("weighing each device against the plan without it")
        # At most half the solver's limit (10 s at most): a compile keeps to planner.time_limit_s and a few seconds
        # (tests/unit/test_planner_limits.py); a re-plan cut short names nothing.
        budget_s = min(10.0, cfg.planner.time_limit_s / 2)
        plan = replace(plan, verdict=[*plan.verdict, *cheap_device_lines(plan, cost_model, budget_s=budget_s)])
    by = None if started is None else started + tracing_s + cfg.planner.time_limit_s + PICTURES_ALLOWANCE_S
    return plan, emit(plan, cfg.output, traced, pictures_by=by)


def cmd_compile(config_dir: str | None, overrides: list[str], multirun: bool = False) -> int:
    """Config -> trace -> plan -> emit, with a progress line, then the plan summary; -m: hetero.cli.sweep."""
    from hetero import config as config_mod
    from hetero.cli import sweep
    from hetero.cli.data_stats import measure_data
    from hetero.cli.plan_commands import skipped_pictures_line
    from hetero.cli.show import data_lines, print_plan

    started = time.perf_counter()  # the compile's clock (planner.time_limit_s bounds it, tracing aside)
    out, status_console = console(), console(stderr=True)
    if multirun:
        return sweep.run_sweep(overrides, config_dir, compile_config, out, status_console)
    sweep.refuse_sweeps(overrides)
    with status_console.status("composing config") as status:
        cfg = config_mod.load(overrides, config_dir)
        plan, paths = compile_config(cfg, status.update, started)
    print_plan(plan, out)
    out.print()
    for line in data_lines(plan, measure_data(cfg.model, cfg.data)[1]):  # the compile's own look (cached)
        out.print(line, highlight=False, markup=False, soft_wrap=True)
    out.print("\n[bold]wrote[/]")
    for path in paths:
        out.print(f"  {path}", highlight=False)
    plan_json = next((p for p in paths if Path(p).name == "plan.json"), Path(cfg.output) / "plan.json")
    skipped = skipped_pictures_line(plan_json, paths, cfg.planner.time_limit_s)
    if skipped:
        out.print(f"\n{skipped}", highlight=False)
    if len({s.host for s in plan.stages}) > 1:
        from hetero.cli.hosts_view import host_lines

        out.print("\n[bold]each host[/] (hetero show --hosts prints this again)")
        for line in host_lines(plan, plan_json):
            out.print(f"  {line}", highlight=False, markup=False, soft_wrap=True)
    out.print(f"\nnext: hetero run {plan_json}", highlight=False)
    return 0


def cmd_inspect(config_dir: str | None, overrides: list[str]) -> int:
    """Trace the model and print its LayerGraph."""
    from hetero import config as config_mod
    from hetero.cli.show import graph_table
    from hetero.compiler.trace import trace

    cfg = config_mod.load(overrides, config_dir)
    with console(stderr=True).status(f"tracing {cfg.model.name} on the meta device"):
        graph = trace(cfg.model)
    out = console()
    out.print(graph_table(graph))
    for note in graph.notes:
        out.print(f"note: {note}", highlight=False)
    return 0


def profile_cost_model(cfg: Config) -> ProfileCostModel | None:
    """The ProfileCostModel for ``profile=PATH`` or ``profile=[RUN_DIR,FILE]`` (each checked against this fleet
    and model, then merged: hetero.profile.merge_profiles), else None."""
    if cfg.profile is None:
        return None
    from hetero.hints import suggest
    from hetero.planner.model.cost_model import RooflineCostModel
    from hetero.planner.model.profile_cost import ProfileCostModel
    from hetero.profile import Profile, check_profile, merge_profiles

    paths = cfg.profiles or (cfg.profile,)
    rerun = suggest("profile", cfg.raw, fallback=[f"hardware={cfg.cluster.name}", f"model={cfg.model.name}"],
                    add=[f"output={cfg.profile}"])
    profiles = [Profile.load(p) for p in paths]
    for path, profile in zip(paths, profiles, strict=True):
        check_profile(profile, cfg.cluster, cfg.model, str(path), rerun)
    return ProfileCostModel(merge_profiles(profiles), RooflineCostModel(cfg.planner.efficiency, cfg.security),
                            path=" + ".join(str(p) for p in paths))


def cmd_profile(config_dir: str | None, overrides: list[str]) -> int:
    """Measure every device and host pair of the fleet for the model; write the profile file."""
    from hetero import config as config_mod
    from hetero.hints import suggest
    from hetero.profile import Profile, fleet_hash, model_hash, now_iso

    cfg = config_mod.load(overrides, config_dir)
    out_path = cfg.output if cfg.output.suffix == ".json" else cfg.output / "profile.json"
    warnings_log.log_to(out_path.parent / "profile-logs" / "warnings.log")
    fhash, mhash = fleet_hash(cfg.cluster), model_hash(cfg.model)
    devices, links = _measure(cfg, fhash + mhash, out_path.parent)
    profile = Profile(fleet=cfg.cluster.name, fleet_hash=fhash, model=cfg.model.name, model_hash=mhash,
                      devices=devices, links=links, created=now_iso(),
                      notes=[f"micro_batch_size={cfg.train.micro_batch_size}, seq_len={cfg.model.seq_len}"])
    profile.save(out_path)
    out = console()
    for d in devices:
        for line in _device_lines(cfg, d):
            out.print(line, highlight=False)
    for lk in links:
        out.print(f"link {lk.a}<->{lk.b}: {lk.bandwidth_gbps:.2f} Gbit/s, {lk.latency_us:.0f} us", highlight=False)
    compile_next = suggest("compile", cfg.raw, fallback=[], add=[f"profile={out_path}"])
    out.print(f"wrote {out_path}\nnext: {compile_next}", highlight=False)
    return 0


def _measure(cfg: Config, run_hash: str, out_dir: Path) -> tuple[list[DeviceProfile], list[LinkProfile]]:
    """The runtime's measurements of every device and link (the runtime, and torch, load only for this
    command), with a progress bar on stderr. Logs go to OUT/profile-logs; the session's keys (the fleet's
    security mode, as `hetero compile` resolves it) to OUT/profile-session."""
    from rich.progress import Progress

    from hetero.profile import MEASURED_PARTS
    from hetero.runtime.tools.profile_fleet import _link_pairs, measure_fleet

    err = console(stderr=True)
    with Progress(console=err, transient=True) as bar:
        task = bar.add_task(f"profiling {cfg.model.name} on {cfg.cluster.name}",
                            total=len(cfg.cluster.devices) * (len(MEASURED_PARTS) + 1) + len(_link_pairs(cfg.cluster)))

        def on_event(line: str) -> None:
            if line.startswith("on host"):
                err.print(line, highlight=False, markup=False, soft_wrap=True)  # one line, to copy as it is
                return
            bar.update(task, advance=1, description=line)

        return measure_fleet(cfg.cluster, cfg.model, cfg.train.micro_batch_size, run_hash,
                             log_dir=out_dir / "profile-logs", session_dir=out_dir / "profile-session",
                             security=cfg.security, on_event=on_event)


def _device_lines(cfg: Config, d: DeviceProfile) -> list[str]:
    """What `hetero profile` reports of one device: its decoder layer's times, optimizer step and messages."""
    from hetero.specs import BYTES_PER_DTYPE

    dec = d.layers["decoder"]
    tokens = cfg.train.micro_batch_size * cfg.model.seq_len
    lines = [f"{d.device}: decoder layer fwd {dec.fwd.at(tokens) * 1e3:.2f} ms + bwd {dec.bwd.at(tokens) * 1e3:.2f} ms "
             f"at {tokens} tokens (r2 {dec.fwd.r2:.2f}/{dec.bwd.r2:.2f}), threads {d.threads}"]
    extra = []
    if d.optimizer is not None:
        extra.append(f"optimizer step {d.optimizer.at(dec.lora_params) * 1e3:.2f} ms per decoder layer's LoRA")
    if d.message_send is not None and d.message_recv is not None:
        size = tokens * int(cfg.model.architecture.get("hidden_size", 0)) * BYTES_PER_DTYPE.get(d.dtype, 4)
        extra.append(f"a {size / 1e6:.2g} MB activation costs {d.message_send.at(size) * 1e3:.2f} ms to send, "
                     f"{d.message_recv.at(size) * 1e3:.2f} ms to receive")
    if "int8" in d.codec_encode and "int8" in d.codec_decode:
        values = tokens * int(cfg.model.architecture.get("hidden_size", 0))
        extra.append(f"int8 compression of one costs {d.codec_encode['int8'].at(values) * 1e3:.2f} ms to encode, "
                     f"{d.codec_decode['int8'].at(values) * 1e3:.2f} ms to decode")
    if d.host_link_gbs is not None:
        extra.append(f"streamed weights reach it at {d.host_link_gbs:.1f} GB/s")
    if d.host_ram_gb is not None:
        extra.append(f"host {d.host} has {d.host_ram_gb:.1f} GB of RAM available")
    if extra:
        lines.append(f"  {'; '.join(extra)}")
    return lines
