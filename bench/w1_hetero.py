"""hetero itself on W1: `hetero compile` of the W1 model on local CPU devices, `hetero run` of the plan
(per-step seconds, peak RSS, per-stage ops from metrics.jsonl)."""

from __future__ import annotations

import json
import shutil
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from w1_model import LR, MICRO_BATCH, NUM_MICRO, SEQ_LEN

from hetero.runtime.run.metrics_file import NAME, read_metrics

HARDWARE_YAML = """\
name: w1
hosts:
  - name: localhost
    address: 127.0.0.1
    port: {port}{host_extra}
    devices:
      - {{type: cpu, count: {count}, threads: 1}}
"""


# Runs a command and prints the largest peak RSS (KiB) of any process it waited for (stage workers included).
PEAK_RSS = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
            "print('peak_rss_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
            "sys.exit(rc)")


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive loopback ports that are free now (a run binds base-1..base+S)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + count > 65535:
            continue
        try:
            for p in range(first, first + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


def hetero_cmd() -> list[str]:
    """The command line that runs `hetero`: the installed script, else this Python's module."""
    return [sys.executable, "-m", "hetero.cli"] if not shutil.which("hetero") else ["hetero"]


def compile_hetero(model_dir: Path, data: Path, steps: int, work: Path, extra: tuple[str, ...] = (),
                   stages: int = 2, num_micro: int | None = None, name: str = "plan",
                   ram_gb: float | None = None, verb: str = "compile") -> tuple[Path | None, str]:
    """`hetero compile` of W1 on ``stages`` local CPU devices (``ram_gb``: the host's RAM for streamed weights);
    returns (plan.json, note). ``verb="profile"``: `hetero profile` of the same config; returns (profile.json, note)."""
    conf = work / "conf"
    (conf / "hardware").mkdir(parents=True, exist_ok=True)
    port = free_ports(max(2, stages) + 1) + 1  # the coordinator takes base port - 1
    (conf / "hardware" / "w1.yaml").write_text(HARDWARE_YAML.format(
        port=port, count=max(2, stages), host_extra="" if ram_gb is None else f"\n    ram_gb: {ram_gb}"))
    out = work / name
    cmd = hetero_cmd() + [
        verb, "-cd", str(conf), "model=hf", f"model.pretrained={model_dir}", f"model.seq_len={SEQ_LEN}",
        "model.dtype=float32", "lora.r=8", "lora.alpha=16", "hardware=w1", f"train.micro_batch_size={MICRO_BATCH}",
        f"train.num_micro_batches={num_micro or NUM_MICRO}", f"train.steps={steps}", f"train.lr={LR}",
        "train.schedule=1f1b", f"data.path={data}", "data.format=tokens", f"planner.num_stages={stages}",
        f"output={out}", *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work, timeout=1800)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return None, f"`hetero {verb}` failed: {lines[-1] if lines else proc.returncode}"
    written = out / ("plan.json" if verb == "compile" else "profile.json")
    return written, f"{verb} {written}"


def run_plan(plan: Path, steps: int, work: Path, peak: dict[str, float] | None = None,
             detail: dict[str, Any] | None = None, engine: str = "hetero",
             run_args: tuple[str, ...] = ()) -> tuple[list[float] | None, str]:
    """`hetero run plan.json --engine ENGINE [run_args]`; returns (per-step seconds, note). ``peak``: filled with the
    largest process peak RSS (MiB); ``detail``: with the median per-op seconds of each stage over steps 3..N."""
    run_dir = work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = hetero_cmd() + ["run", str(plan), "--run-dir", str(run_dir), "--no-progress", "--engine", engine, *run_args]
    proc = subprocess.run([sys.executable, "-c", PEAK_RSS, *cmd], capture_output=True, text=True, cwd=work,
                          timeout=1800)
    if proc.returncode != 0:
        lines = [line for line in (proc.stderr or proc.stdout).strip().splitlines()
                 if not line.startswith("peak_rss_kib")]  # the wrapper's own last line
        return None, f"`hetero run` failed: {lines[-1] if lines else proc.returncode}"
    for line in proc.stderr.splitlines():
        if line.startswith("peak_rss_kib") and peak is not None:
            peak["rss_mib"] = int(line.split()[1]) / 1024
    metrics = run_dir / NAME
    if not metrics.is_file():
        return None, f"no {metrics}"
    rows = read_metrics(metrics).steps
    times = [s.step_time_s for s in rows]
    if len(times) < steps:
        return None, f"metrics.jsonl has {len(times)} step times, expected {steps}"
    if detail is not None:
        tail = [s.stage_ops for s in rows][2:] or [s.stage_ops for s in rows]
        detail["stage_ops"] = [{op: statistics.median(step[k].get(op, 0.0) for step in tail)
                                for op in sorted({o for step in tail for o in step[k]})}
                               for k in range(len(tail[0]))]
    return times, f"plan {plan}"


def run_hetero(model_dir: Path, data: Path, steps: int, work: Path, extra: tuple[str, ...] = (),
               peak: dict[str, float] | None = None) -> tuple[list[float] | None, str]:
    """`hetero compile` + `hetero run` (2 stages, NUM_MICRO micro-batches); returns (per-step seconds, note)."""
    plan, note = compile_hetero(model_dir, data, steps, work, extra)
    if plan is None:
        return None, note
    return run_plan(plan, steps, work, peak)


def plan_split(plan: Path) -> list[int]:
    """Decoder layers per stage of a compiled plan."""
    doc = json.loads(plan.read_text())
    return [sum(1 for n in s["node_names"] if n.startswith("layers.")) for s in doc["stages"]]
