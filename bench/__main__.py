"""One benchmark command: `python -m bench` from the repository root (~21 minutes on 2 cores).

Runs, in this order (each section measures its own baseline in the same run):

  planner    W2 + rig fleets: solve time and proof for llama8b/llama70b x nf4/bf16  (bench_planner.py)
  compile    `hetero compile` wall time and peak RSS, llama8b on homelab, llama70b nf4 on mining_rig
  transport  hetero's Transport vs a raw TCP socket, 64 KiB - 64 MiB messages      (bench_transport.py)
  w1         hetero vs torch.distributed.pipelining, 2 and 3 stages x 4, 8, 16 micro-batches (bench_runtime.py)
  w3         the same over a rate-limited veth between two network namespaces (bench_w3.py; root only)
  replicas   2 replicas x 1 stage vs 1 replica x 2 stages on W1's model: predicted vs measured (bench_replicas.py)
  eval       held-out evaluation on a spare CPU device: training step with vs without it (bench_eval.py)
  prediction run -> compile profile=RUN_DIR -> run, 2 and 3 tiny stages: measured / predicted (bench_prediction.py)

`python -m bench rebalance [--shape replicas]` runs W5 alone (a stage slowed mid-run by a cgroup quota, with and
without runtime.rebalance, and a plan compiled for the slowed fleet; bench_rebalance.py, root only) and prints it;
`--shape replicas` trains two one-stage replicas instead of the planner's default plan.

`python -m bench data [--quick] [--json FILE]` runs W7 alone (real-length records at seq_len 1024: hetero packed,
padded and on full rows, TRL's SFTTrainer packed and default, in trained tokens/s; bench_data.py, ~15 min) and
prints it. `python -m bench --only data` runs the same as a section, recorded in docs/benchmarks.md's generated
part; it is not in the default run.

then prints every table and the ratios last, and rewrites the generated part of docs/benchmarks.md
(between its `bench:begin` / `bench:end` markers: tables, machine, date, commands) and
docs/bench.png. `--only w1 w3` runs some sections; `--no-write` leaves docs/ alone. Do not run it
while other heavy work shares the machine: its numbers would say more about the neighbours.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

SECTIONS = ("planner", "compile", "transport", "w1", "w3", "replicas", "eval", "prediction")
OPT_IN = ("data",)  # run only when named in --only (W7 alone takes ~15 minutes)
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
DOC, PLOT = REPO / "docs" / "benchmarks.md", REPO / "docs" / "bench.png"

# What `hetero compile` is timed on: the everyday plan, and the biggest shipped one.
COMPILES = (
    ("llama8b on homelab", ["model=llama8b", "hardware=homelab"]),
    ("llama70b nf4 on mining_rig", ["model=llama70b", "model.quantization=nf4", "hardware=mining_rig"]),
)


def machine() -> str:
    """One line about where the numbers come from."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}, torch {torch.__version__}, "
            f"{platform.system()} {platform.release()}")


# ---------------------------------------------------------------- sections


def bench_planner() -> dict[str, Any]:
    import bench_planner

    rows = bench_planner.rig_rows()
    return {"rows": rows}


def bench_compile(work: Path) -> dict[str, Any]:
    from w1_hetero import PEAK_RSS, hetero_cmd

    rows = []
    for name, overrides in COMPILES:
        out = work / re.sub(r"\W+", "-", name)
        cmd = hetero_cmd() + ["compile", *overrides, f"output={out}"]
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", PEAK_RSS, *cmd], capture_output=True, text=True, cwd=REPO,
                              timeout=600)
        wall = time.perf_counter() - t0
        row: dict[str, Any] = {"name": name, "command": "hetero compile " + " ".join(overrides), "wall_s": wall}
        for line in proc.stderr.splitlines():
            if line.startswith("peak_rss_kib"):
                row["peak_rss_mib"] = int(line.split()[1]) / 1024
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            row["error"] = lines[-1] if lines else str(proc.returncode)
        else:
            plan = json.loads((out / "plan.json").read_text())
            row["solve_s"] = plan["solver"]["solve_time_s"]
            row["proven"] = plan["solver"]["proven_optimal"]
        rows.append(row)
    return {"rows": rows}


def bench_transport() -> dict[str, Any]:
    import bench_transport

    return {"rows": bench_transport.sweep()}


def bench_w1(work: Path) -> dict[str, Any]:
    import bench_runtime

    return bench_runtime.run_w1(work, steps=4, log=lambda s: print("  " + s, flush=True) if s else None)


def bench_w3(work: Path) -> dict[str, Any]:
    import bench_w3

    return {"rows": bench_w3.run_w3(steps=4, work=work)}


def bench_replicas(work: Path) -> dict[str, Any]:
    import bench_replicas

    result = bench_replicas.bench(work, steps=6, rounds=2)
    bench_replicas.print_report(result)
    return result


def bench_eval(work: Path) -> dict[str, Any]:
    import bench_eval

    result = bench_eval.bench(work, steps=6, rounds=2, every=2)
    bench_eval.print_report(result)
    return result


# ---------------------------------------------------------------- report


def _f(x: Any, p: int = 3) -> str:
    return "-" if x is None else f"{x:.{p}f}" if isinstance(x, float) else str(x)


def markdown(results: dict[str, Any], started: str, wall_s: float) -> list[str]:
    """The generated part of docs/benchmarks.md."""
    out = [BEGIN, "", f"## Latest `python -m bench` ({started}, {wall_s / 60:.1f} min)", "",
           f"Machine: {machine()}. Commands: `python -m bench` (all below); each section alone: "
           "`python bench/bench_planner.py`, `python bench/bench_transport.py`, `python bench/bench_runtime.py`, "
           "`sudo python bench/bench_w3.py`. Ratios, not absolute times, are what carries between days.", ""]
    for name, res in results.items():
        if "error" in res:
            out += [f"### {name}: not measured", "", f"`{res['error']}`", ""]
    if "w1" in results and "rows" in results["w1"]:
        r = results["w1"]
        out += ["### W1 — hetero vs torch.distributed.pipelining (CPU stages x 1 thread, loopback)", "",
                f"{r['steps']} steps per run, median of steps 3..{r['steps']}; the figure of a setting is the "
                "median over its alternating runs. Layer bound: per-node times measured alone with hetero's "
                f"kernels, best contiguous split, (m+S-1) slots plus the optimizer (and total work / {r['cores']} "
                "cores when S exceeds them).", "",
                "| S | m | hetero s/step | peer s/step | hetero tokens/s | **hetero / peer** | of layer bound | "
                "splits hetero / peer |", "|---|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            tok = row["tokens_per_step"] / row["hetero_s"] if row.get("hetero_s") else None
            out.append(f"| {row['stages']} | {row['m']} | {_f(row.get('hetero_s'))} | {_f(row.get('peer_s'))} | "
                       f"{_f(tok, 0)} | **{_f(row.get('speedup'), 2)}x** | {_f(row.get('of_layer_bound'), 2)} | "
                       f"{row.get('hetero_split')} / {row['peer_split']} |")
        base = r.get("baselines") or {}
        if base:
            out += ["", "One process, stock peft, m=8: " + ", ".join(f"{k} {v:.3f} s/step" for k, v in base.items())
                    + "."]
        out += [""]
    if "w3" in results and "rows" in results["w3"]:
        out += ["### W3 — over a rate-limited link (two network namespaces, veth + tc tbf)", ""]
        out += w3_lines(results["w3"]["rows"])
    if "replicas" in results and "rows" in results["replicas"]:
        r = results["replicas"]
        out += ["### Data x pipeline replicas on W1's model (2 CPU devices x 1 thread)", "",
                f"Both plans compiled from one `hetero profile`, run alternately ({r['rounds']} rounds of "
                f"{r['steps']} steps, median of steps 3..{r['steps']}).", "",
                "| plan | replicas x stages | predicted s/step | measured s/step | measured / predicted |",
                "|---|---|---|---|---|"]
        for name, row in r["rows"].items():
            out.append(f"| {name} | {row['shape']} | {row['predicted_s']:.3f} | {row['measured_s']:.3f} | "
                       f"{row['ratio']:.2f} |")
        out += ["", f"Faster measured: {r['faster']}; the planner's own choice: {r['auto']}.", ""]
    if "eval" in results and "eval_s" in results["eval"]:
        r = results["eval"]
        out += ["### Held-out evaluation on a spare device (W1's model, 1 training + 1 eval CPU thread)", "",
                f"Training step without evaluation {r['no_eval_s']:.3f} s, with evaluation every {r['every']} steps "
                f"{r['eval_s']:.3f} s: **{r['ratio']:.3f}x** (medians over {r['rounds']} alternating runs of "
                f"{r['steps']} steps).", ""]
    if "data" in results and "rows" in results["data"]:
        import bench_data

        out += ["### W7 — real-length data: packed, padded, full rows and TRL, in trained tokens/s", ""]
        out += bench_data.lines(results["data"]) + [""]
    if "transport" in results and "rows" in results["transport"]:
        out += ["### Transport vs raw TCP (loopback, process to process)", "",
                "| message | raw MB/s | Transport MB/s | ratio |", "|---|---|---|---|"]
        for row in results["transport"]["rows"]:
            size = row["bytes"]
            label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
            out.append(f"| {label} | {row['raw_mb_s']:.0f} | {row['transport_mb_s']:.0f} | {row['ratio']:.2f} |")
        out += [""]
    if "planner" in results and "rows" in results["planner"]:
        out += ["### Planner — rig-scale fleets (W2)", ""]
        out += _table(results["planner"]["rows"])
    if "compile" in results and "rows" in results["compile"]:
        out += ["### `hetero compile`", "", "| plan | wall s | peak RSS MiB | solve s | proven |", "|---|---|---|---|---|"]
        for row in results["compile"]["rows"]:
            out.append(f"| `{row['command']}` | {row['wall_s']:.1f} | {_f(row.get('peak_rss_mib'), 0)} | "
                       f"{_f(row.get('solve_s'), 2)} | {row.get('proven', row.get('error', '-'))} |")
        out += [""]
    out += ["![benchmarks](bench.png)", "", END]
    return out


def w3_speedups(rows: list[dict[str, Any]]) -> list[tuple[str, str, float]]:
    """(rate, hetero run, peer step / hetero step) for every hetero run next to a peer run of its rate."""
    peer = {r["rate"]: r["step_s"] for r in rows if r.get("run") == "torch-pipelining" and r.get("available")}
    return [(r["rate"], r["run"], peer[r["rate"]] / r["step_s"]) for r in rows
            if r.get("available") and r.get("run", "").startswith("hetero") and r.get("rate") in peer]


def w3_lines(rows: list[dict[str, Any]]) -> list[str]:
    """W3's table: one line per (rate, run), with the link's busy fraction each way."""
    if not rows or not rows[0].get("rate"):
        return [f"not measured: {rows[0].get('note') if rows else 'nothing ran'}", ""]
    r0 = rows[0]
    out = [f"W1's model at hidden {r0['hidden']}, seq {r0['seq']} ({r0['tokens_per_step']} tokens/step); one activation "
           f"message at 1 Gbit/s takes {r0['ratio_1gbit']:.3f} of a stage's forward. One stage process per namespace, "
           "1 thread each; hetero with CurveZMQ (the default off loopback) and with security none.", "",
           "| rate | run | s/step | tokens/s | link busy a→b / b→a | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        if not r.get("available"):
            out.append(f"| {r.get('rate')} | {r.get('run')} | - | - | - | {r.get('note', '')} |")
            continue
        link = r.get("link") or {}
        busy = (f"{link['busy_ab']:.1%} / {link['busy_ba']:.1%}" if "busy_ab" in link and "busy_ba" in link else "-")
        out.append(f"| {r['rate']} | {r['run']} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {busy} | |")
    out += [""] + [f"- {rate}: {run} / torch pipelining **{x:.2f}x**" for rate, run, x in w3_speedups(rows)] + [""]
    return out


def _table(rows: list[dict[str, Any]]) -> list[str]:
    """A markdown table of uniform dict rows (the columns of the first row)."""
    if not rows:
        return ["(no rows)", ""]
    cols = list(rows[0])
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        out.append("| " + " | ".join(_f(row.get(c)) if not isinstance(row.get(c), float) else
                                     f"{row[c]:.3g}" for c in cols) + " |")
    return out + [""]


def write_doc(lines: list[str]) -> None:
    """Replace the generated part of docs/benchmarks.md (or put it after the first paragraph)."""
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    block = "\n".join(lines)
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        head, sep, rest = text.partition("\n## ")
        text = head.rstrip() + "\n\n" + block + "\n\n" + (sep.lstrip("\n") + rest if sep else "")
    DOC.write_text(text)


def plot(results: dict[str, Any]) -> None:
    """docs/bench.png: W1 (and W3) tokens/s, hetero vs the peer, per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results.get("w1", {}).get("rows", [])
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"S={r['stages']}\nm={r['m']}" for r in rows]
    xs = range(len(rows))
    for off, who, color in ((-0.2, "hetero", "#1f77b4"), (0.2, "peer", "#aaaaaa")):
        vals = [r["tokens_per_step"] / r[f"{who}_s"] if r.get(f"{who}_s") else 0 for r in rows]
        ax.bar([x + off for x in xs], vals, width=0.4, color=color,
               label="hetero" if who == "hetero" else "torch.distributed.pipelining")
    for x, r in zip(xs, rows, strict=True):
        if r.get("speedup"):
            top = r["tokens_per_step"] / min(r["hetero_s"], r["peer_s"])
            ax.text(x, top * 1.02, f"{r['speedup']:.2f}x", ha="center", fontsize=9)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("tokens/s (higher is better)")
    ax.set_title("W1 on this CPU: hetero vs torch.distributed.pipelining (1 thread per stage)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    plt.close(fig)


def ratios(results: dict[str, Any]) -> list[str]:
    """The lines printed last."""
    out = ["", "ratios:"]
    for row in results.get("w1", {}).get("rows", []):
        if row.get("speedup"):
            out.append(f"  W1 S={row['stages']} m={row['m']:<3} hetero / torch pipelining {row['speedup']:.2f}x, "
                       f"{row['of_layer_bound']:.0%} of the layer-granularity bound")
    for rate, run, x in w3_speedups(results.get("w3", {}).get("rows", [])):
        out.append(f"  W3 {rate:<8} {run:<13} / torch pipelining {x:.2f}x")
    for name, row in results.get("replicas", {}).get("rows", {}).items():
        out.append(f"  replicas: {name} ({row['shape']}) measured / predicted {row['ratio']:.2f}")
    if "faster" in results.get("replicas", {}):
        r = results["replicas"]
        faster = r["rows"][r["faster"]]["shape"]
        out.append(f"  replicas: faster measured {faster}, planner chose {r['auto']}"
                   f" ({'the faster' if faster == r['auto'] else 'NOT the faster'})")
    for loop in results.get("prediction", {}).get("loops", []):
        per_round = " ".join(f"{r['ratio']:.2f}" for r in loop["rows"])
        out.append(f"  prediction: {loop['stages']} stages planned from the previous run, measured / predicted median "
                   f"{loop['median']:.2f} (rounds {per_round})")
    if "ratios" in results.get("data", {}):
        import bench_data

        for key, label, goal in bench_data.GOALS:
            x = results["data"]["ratios"].get(key)
            if x is not None:
                out.append(f"  W7 {label} {x:.2f}x (goal >= {goal})")
    if "ratio" in results.get("eval", {}):
        out.append(f"  eval: training step with / without evaluation on a spare device {results['eval']['ratio']:.3f}x")
    for row in results.get("transport", {}).get("rows", []):
        out.append(f"  transport {row['bytes'] >> 10:>6} KiB: Transport / raw TCP {row['ratio']:.2f}")
    prows = results.get("planner", {}).get("rows", [])
    if prows:
        times = [r.get("solve_s", 0.0) for r in prows]
        optimal = sum(1 for r in prows if r.get("result") == "optimal")
        infeasible = sum(1 for r in prows if r.get("result") == "infeasible")
        out.append(f"  planner: of {len(prows)} (model, fleet) pairs, {optimal} proven optimal and {infeasible} proven "
                   f"not to fit, {len(prows) - optimal - infeasible} unproven; slowest solve {max(times):.2f} s")
    for name, res in results.items():
        if "error" in res:
            out.append(f"  {name}: NOT MEASURED ({res['error']})")
    return out


def run_section(name: str, work: Path) -> dict[str, Any]:
    if name == "planner":
        return bench_planner()
    if name == "transport":
        return bench_transport()
    if name == "prediction":
        import bench_prediction

        return bench_prediction.run_loop(work, rounds=3, steps=12)
    if name == "data":
        import bench_data

        return bench_data.bench(work, log=lambda s: print("  " + s, flush=True))
    return {"compile": bench_compile, "w1": bench_w1, "w3": bench_w3, "replicas": bench_replicas,
            "eval": bench_eval}[name](work)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["rebalance"]:  # W5: its own script (root: it slows a stage with a cgroup), printed only
        import bench_rebalance

        return bench_rebalance.main(argv[1:])
    if argv[:1] == ["data"]:  # W7: its own script (~15 min), printed only; `--only data` records it in docs/
        import bench_data

        return bench_data.main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m bench", description="Every hetero benchmark, ratios last.")
    ap.add_argument("--only", nargs="+", choices=SECTIONS + OPT_IN, default=list(SECTIONS))
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md and docs/bench.png")
    ap.add_argument("--json", type=Path, help="also write every result here")
    ap.add_argument("--from-json", type=Path, help="measure nothing: render a --json file of an earlier run")
    args = ap.parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        if "results" not in saved:  # a bare results dict
            mtime = datetime.fromtimestamp(args.from_json.stat().st_mtime, timezone.utc)
            saved = {"results": saved, "started": mtime.strftime("%Y-%m-%d %H:%M UTC (file time)"),
                     "wall_s": sum(r.get("wall_s", 0.0) for r in saved.values())}
        results, started, wall = saved["results"], saved["started"], saved["wall_s"]
        return report(results, started, wall, args)
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"python -m bench, {started}: {machine()}", flush=True)
    t0 = time.perf_counter()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="hetero-bench-") as tmp:
        work = Path(tmp)
        for name in SECTIONS + OPT_IN:
            if name not in args.only:
                continue
            print(f"\n== {name}", flush=True)
            s0 = time.perf_counter()
            try:
                sub = work / name
                sub.mkdir()
                results[name] = run_section(name, sub)
            except Exception as exc:  # one broken section must not lose the others' numbers
                traceback.print_exc()
                results[name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
            results[name]["wall_s"] = time.perf_counter() - s0
            print(f"== {name}: {results[name]['wall_s']:.0f} s", flush=True)
    wall = time.perf_counter() - t0
    if args.json:
        args.json.write_text(json.dumps({"results": results, "started": started, "wall_s": wall}, indent=1,
                                        default=str))
    return report(results, started, wall, args)


def report(results: dict[str, Any], started: str, wall: float, args: argparse.Namespace) -> int:
    """Print the tables and the ratios last; write docs/ unless --no-write."""
    lines = markdown(results, started, wall)
    print("\n" + "\n".join(lines[1:-1]))
    print("\n".join(ratios(results)))
    print(f"\ntotal {wall / 60:.1f} min")
    if not args.no_write:
        write_doc(lines)
        plot(results)
        print(f"wrote {DOC.relative_to(REPO)} and {PLOT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
