"""`hetero compile -m`: expand Hydra sweep overrides, compile every point in this process, compare them.

``key=a,b``, ``key=range(1,4)``, ``key=choice(a,b)`` and, for a config group, ``key=glob(llama*)``
are sweeps (Hydra's override grammar); ``key=[a,b]`` is one list value. The points are the cartesian
product in Hydra's order: the first swept key varies slowest. Each point is compiled into its own
directory under ``output``, named by its swept values: ``key=value`` pairs joined by commas, any
character other than letters, digits and ``._=,+@-`` replaced by ``_``
(``hardware=homelab,model.quantization=nf4``); ``point-NN`` (its number) when that name is over 100
characters or an earlier point has it. One table on stdout and ``output/sweep.csv`` compare the
points; a point that fails (a HeteroError) is a row with its one-line error. Exit code: 0 when every
point compiled, 1 when any failed (the table and the CSV are written either way).
"""

from __future__ import annotations

import csv
import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from hetero.cli.show import fmt_rate, fmt_time
from hetero.config import GROUPS, available_options, package_conf_dir
from hetero.errors import ConfigError, HeteroError
from hetero.plan import Plan
from hetero.serde import short_repr

CSV_NAME = "sweep.csv"
_MAX_NAME = 100


@dataclass(frozen=True)
class Point:
    """One combination of swept values: the overrides that compose it and the directory it goes to."""

    number: int  # 1-based, as the table, the CSV and the progress line show it
    overrides: tuple[str, ...]  # the command line's overrides with this point's values in place
    values: tuple[tuple[str, str], ...]  # (swept key, value as written) in command-line order
    name: str  # its directory under output


@dataclass(frozen=True)
class Sweep:
    """The expanded command line: what varies, what every point shares, the points, where they go."""

    keys: tuple[str, ...]  # the swept keys, in command-line order
    fixed: tuple[str, ...]  # the overrides every point shares
    points: tuple[Point, ...]
    output: Path  # where the point directories and sweep.csv go


@dataclass(frozen=True)
class PointResult:
    """A compiled point (its plan and plan.json) or a failed one (its one-line error)."""

    point: Point
    plan: Plan | None = None
    plan_json: Path | None = None
    error: str = ""


def _parse(overrides: Sequence[str]) -> list[Any]:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except OverrideParseException as exc:
        raise ConfigError(f"cannot read the override {short_repr(exc.override)}; write key=value, key=a,b to "
                          "sweep, and quote a value with spaces or symbols: key='a b'") from None


def refuse_sweeps(overrides: Sequence[str]) -> None:
    """Without -m a sweep value is a mistake: say how to sweep, or how to write a list or a string."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except OverrideParseException:
        return  # hetero.config.load reports it, with the override
    for override in parsed:
        if override.is_sweep_override():
            line = override.input_line or override.get_key_element()
            raise ConfigError(f"{line} is a sweep: add -m to compile each value and compare them "
                              f"(hetero compile -m {line} ...); a list is written key=[a,b], a string with a "
                              "comma key='a,b'")


def _sweep_values(override: Any, config_dir: str | Path | None) -> list[str]:
    """A sweep override's values as they would be written after ``key=``."""
    from hydra.core.override_parser.types import ValueType

    key = override.get_key_element()
    if override.value_type == ValueType.GLOB_CHOICE_SWEEP:
        if override.key_or_group not in GROUPS:
            raise ConfigError(f"{override.input_line}: glob() picks files of a config group "
                              f"({', '.join(GROUPS)}), not values of {key}")
        return list(override.value().filter(available_options(override.key_or_group, config_dir)))
    if not override.is_discrete_sweep():
        raise ConfigError(f"{override.input_line}: a continuous sweep cannot be compiled point by point; "
                          "list the values (key=a,b), or use range(start,stop,step) or choice(a,b)")
    return list(override.sweep_string_iterator())


def _shown(value: str) -> str:
    """``b\\ c`` (the override form of a value with a space) -> ``b c``."""
    return re.sub(r"\\(.)", r"\1", value)


def point_name(values: Sequence[tuple[str, str]], number: int, taken: set[str]) -> str:
    """The directory of a point: its swept values, sanitized; ``point-NN`` when too long or taken."""
    name = re.sub(r"[^A-Za-z0-9._=,+@-]", "_", ",".join(f"{k}={v}" for k, v in values))
    if not name or len(name) > _MAX_NAME or name in taken:
        name = f"point-{number:02d}"
    return name


def default_output() -> str:
    """The root config's ``output`` (where a compile writes without ``output=``)."""
    import yaml

    root = yaml.safe_load((package_conf_dir() / "config.yaml").read_text()) or {}
    return str(root.get("output", "."))


def expand(overrides: Sequence[str], config_dir: str | Path | None = None) -> Sweep:
    """The points of the sweep, in Hydra's order (the first swept key varies slowest)."""
    parsed = _parse(overrides)
    keys: list[str] = []
    choices: list[list[tuple[str, str]]] = []  # per override: (override text, value shown) of each choice
    output: str | None = None
    for override in parsed:
        key = override.get_key_element()
        if not override.is_sweep_override():
            choices.append([(str(override.input_line), "")])
            if override.key_or_group == "output" and not override.is_delete():
                output = str(override.value())
            continue
        if override.key_or_group == "output":
            raise ConfigError(f"{override.input_line}: output cannot be swept; each point gets its own "
                              "directory under output")
        if key in keys:
            raise ConfigError(f"{key} is swept twice; give all its values in one override: {key}=a,b,c")
        written = _sweep_values(override, config_dir)
        if not written:
            raise ConfigError(f"{override.input_line}: the sweep has no values")
        keys.append(key)
        choices.append([(f"{key}={v}", _shown(v)) for v in written])
    swept = [i for i, o in enumerate(parsed) if o.is_sweep_override()]
    points: list[Point] = []
    taken: set[str] = set()
    for number, combo in enumerate(itertools.product(*choices), start=1):
        values = tuple((key, combo[i][1]) for key, i in zip(keys, swept, strict=True))
        name = point_name(values, number, taken)
        taken.add(name)
        points.append(Point(number, tuple(text for text, _ in combo), values, name))
    fixed = tuple(str(o.input_line) for o in parsed if not o.is_sweep_override())
    return Sweep(tuple(keys), fixed, tuple(points), Path(output or default_output()).expanduser())


# --- the comparison -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanSummary:
    """What the sweep compares of a compiled point, defined once: its fields are sweep.csv's columns (in order,
    between the point's own and plan_json/error), and every table column shows some of them."""

    step_time_s: float
    tokens_per_s: float | None  # trained (label) tokens/s: None where the data was not measured at compile
    computed_tokens_per_s: float  # every row's tokens, padding included
    label_fraction: float | None  # of the computed tokens, those with a label (plan.data_stats)
    tokens_per_step: int  # computed
    bubble_fraction: float
    headroom_gb: float  # free memory of the tightest stage
    headroom_fraction: float  # ... as a share of its device's
    tightest_device: str
    num_stages: int
    num_replicas: int
    devices_used: int
    fleet_devices: int
    single_device_step_time_s: float | None  # the fastest single device that fits, None: none does
    speedup_vs_single_device: float | None
    versus_single: str  # the table's text of it: "1.52x", "one device", "none fits alone"
    proven_optimal: int


SUMMARY_KEYS = tuple(f.name for f in fields(PlanSummary))
CSV_COLUMNS = ("point", "name", "status", "best", *SUMMARY_KEYS, "plan_json", "error")


@dataclass(frozen=True)
class TableColumn:
    """A column of the sweep table: its heading and its cell, made from the named fields of a PlanSummary."""

    heading: str
    keys: tuple[str, ...]  # of SUMMARY_KEYS, passed to ``cell`` in this order
    cell: Callable[..., str]

    def text(self, summary: dict[str, Any]) -> str:
        """This column's cell for a point's summary (``asdict(plan_summary(plan))``)."""
        return self.cell(*(summary[k] for k in self.keys))


TABLE_COLUMNS = (
    TableColumn("step", ("step_time_s",), fmt_time),
    TableColumn("trained tokens", ("tokens_per_s", "computed_tokens_per_s"),
                lambda trained, computed: fmt_rate(trained) if trained is not None else f"{fmt_rate(computed)} computed"),
    TableColumn("headroom", ("headroom_gb", "headroom_fraction"), lambda gb, share: f"{gb:.1f} GB ({share:.0%})"),
    TableColumn("devices", ("devices_used", "fleet_devices"), lambda used, fleet: f"{used}/{fleet}"),
    TableColumn("replicas", ("num_replicas",), str),
    TableColumn("vs best single", ("versus_single",), str),
)


def plan_summary(plan: Plan) -> PlanSummary:
    """What the sweep compares, from a plan: prediction, tightest memory, layout, versus one device."""
    free_gb, tight = min(((s.memory.available_gb - s.memory.total_gb, s) for s in plan.stages),
                         key=lambda pair: pair[0])
    single = next((b for b in plan.baselines if b.name == "best_single_device"), None)
    single_s = single.prediction.step_time_s if single and single.feasible and single.prediction else None
    step = plan.prediction.step_time_s
    speedup = single_s / step if single_s is not None and step > 0 else None
    if len(plan.stages) == 1:
        versus = "one device"
    elif speedup is None:
        versus = "none fits alone"
    else:
        versus = f"{speedup:.2f}x"
    return PlanSummary(
        step_time_s=step,
        tokens_per_s=plan.prediction.trained_tokens_per_s,
        computed_tokens_per_s=plan.prediction.tokens_per_s,
        label_fraction=plan.prediction.label_fraction,
        tokens_per_step=plan.prediction.tokens_per_step,
        bubble_fraction=plan.prediction.bubble_fraction,
        headroom_gb=free_gb,
        headroom_fraction=free_gb / tight.memory.available_gb if tight.memory.available_gb > 0 else 0.0,
        tightest_device=tight.device,
        num_stages=len(plan.stages),
        num_replicas=len(plan.pipelines),
        devices_used=len({s.device for s in plan.stages}),
        fleet_devices=len(plan.cluster.devices),
        single_device_step_time_s=single_s,
        speedup_vs_single_device=speedup,
        versus_single=versus,
        proven_optimal=int(plan.solver.proven_optimal),
    )


def best_point(results: Sequence[PointResult]) -> PointResult | None:
    """The point with the fastest predicted step (the first of equals); None when none compiled."""
    done = [r for r in results if r.plan is not None]
    return min(done, key=lambda r: r.plan.prediction.step_time_s if r.plan else 0.0) if done else None


def csv_rows(sweep: Sweep, results: Sequence[PointResult]) -> list[dict[str, Any]]:
    """One dict per point, full precision (floats as Python writes them), empty cells for a failed point."""
    best = best_point(results)
    rows = []
    for r in results:
        row: dict[str, Any] = {"point": r.point.number, "name": r.point.name, **dict(r.point.values),
                               "status": "ok" if r.plan is not None else "error", "best": int(r is best)}
        row.update(asdict(plan_summary(r.plan)) if r.plan is not None else {})
        row.update({"plan_json": str(r.plan_json or ""), "error": r.error})
        rows.append(row)
    return rows


def write_csv(path: Path, sweep: Sweep, results: Sequence[PointResult]) -> None:
    """sweep.csv: a header, then one row per point (the swept keys after ``name``)."""
    columns = [*CSV_COLUMNS[:2], *sweep.keys, *CSV_COLUMNS[2:]]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, restval="")
            writer.writeheader()
            for row in csv_rows(sweep, results):
                writer.writerow({k: "" if v is None else v for k, v in row.items()})
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}; choose another output=") from None


def sweep_table(sweep: Sweep, results: Sequence[PointResult]) -> Table:
    """The comparison: per point its swept values, prediction, headroom, layout; * = fastest step."""
    fixed = f"; fixed: {' '.join(sweep.fixed)}" if sweep.fixed else ""
    table = Table(title=f"Sweep: {len(results)} points{fixed}", title_justify="left", header_style="bold")
    # Only the error column wraps: the swept values and the numbers are what a reader scans down.
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("", no_wrap=True)  # the best point's mark
    for key in sweep.keys:
        table.add_column(key, no_wrap=True)
    for column in TABLE_COLUMNS:
        table.add_column(column.heading, justify="right", no_wrap=True)
    best = best_point(results)
    for r in results:
        values = [v for _, v in r.point.values]
        if r.plan is None:  # its error goes under the table (failure_lines): a whole line, not a wrapped cell
            table.add_row(str(r.point.number), "", *values, Text("failed", style="red"),
                          *["-"] * (len(TABLE_COLUMNS) - 1))
            continue
        summary = asdict(plan_summary(r.plan))
        table.add_row(str(r.point.number), "*" if r is best else "", *values,
                      *(column.text(summary) for column in TABLE_COLUMNS), style="bold" if r is best else None)
    return table


# A plan whose tightest stage keeps less than this share of its memory free fits on paper only: a longer record,
# the allocator's fragmentation or another process on the card tips it over.
HEADROOM_LOW = 0.05


def headroom_lines(results: Sequence[PointResult]) -> list[str]:
    """One warning per compiled point whose tightest stage has under HEADROOM_LOW of its memory left."""
    out = []
    for r in results:
        if r.plan is None:
            continue
        summary = plan_summary(r.plan)
        if summary.headroom_fraction < HEADROOM_LOW:
            out.append(f"point {r.point.number} ({r.point.name}): {summary.tightest_device} keeps "
                       f"{summary.headroom_gb:.1f} GB ({summary.headroom_fraction:.0%}) of its memory free: it fits on "
                       "paper only (a longer record, fragmentation or another process on the card tips it over); "
                       "leave room: a shorter model.seq_len, a smaller train.micro_batch_size or planner.recompute=full")
    return out


def failure_lines(results: Sequence[PointResult]) -> list[str]:
    """One line per failed point: its number, directory name and one-line error."""
    return [f"point {r.point.number} ({r.point.name}) failed: {r.error}" for r in results if r.plan is None]


# Compiles one composed config (config_commands.compile_config): progress in, the plan and its paths out.
CompileFn = Callable[[Any, Callable[[str], None]], tuple[Plan, list[Path]]]


def compile_points(sweep: Sweep, config_dir: str | None, compile_config: CompileFn,
                   err: Console) -> list[PointResult]:
    """Compile each point into its directory, a spinner and one line per point on ``err``."""
    from hetero import config as config_mod

    results: list[PointResult] = []
    total = len(sweep.points)
    with err.status(f"sweep of {total} points") as status:
        for point in sweep.points:
            label = f"point {point.number}/{total} ({point.name})"

            def say(text: str, label: str = label) -> None:
                status.update(f"{label}: {text}")

            try:
                say("composing config")
                cfg = config_mod.load(list(point.overrides), config_dir)
                where = sweep.output / point.name
                cfg = replace(cfg, output=where, raw={**cfg.raw, "output": str(where)})
                plan, paths = compile_config(cfg, say)
                plan_json = next((Path(p) for p in paths if Path(p).name == "plan.json"), where / "plan.json")
                results.append(PointResult(point, plan, plan_json))
                err.print(f"{label}: {fmt_time(plan.prediction.step_time_s)}/step", highlight=False)
            except HeteroError as exc:
                error = " ".join(str(exc).split()) or type(exc).__name__
                results.append(PointResult(point, error=error))
                err.print(f"{label}: failed: {error}", highlight=False)
    return results


def run_sweep(overrides: Sequence[str], config_dir: str | None, compile_config: CompileFn, out: Console,
              err: Console) -> int:
    """Expand, compile every point, print the table, write sweep.csv; 0 when every point compiled, else 1."""
    sweep = expand(overrides, config_dir)
    results = compile_points(sweep, config_dir, compile_config, err)
    csv_path = sweep.output / CSV_NAME
    write_csv(csv_path, sweep, results)
    out.print(sweep_table(sweep, results))
    best = best_point(results)
    if best is not None and best.plan is not None:
        out.print(f"* fastest predicted step: point {best.point.number} ({best.point.name}), "
                  f"{fmt_time(best.plan.prediction.step_time_s)}/step", highlight=False)
    for line in headroom_lines(results):
        out.print(f"warning: {line}", highlight=False, style="yellow", soft_wrap=True)
    failed = failure_lines(results)
    for line in failed:
        out.print(line, highlight=False, style="red", soft_wrap=True)
    out.print(f"\nwrote {csv_path} and one directory per point under {sweep.output}", highlight=False)
    if best is not None:
        out.print(f"next: hetero show {best.plan_json}", highlight=False)
    return 1 if failed else 0
