"""W3's runs over the link: the peer (torch.distributed.pipelining, one rank per namespace, started as
w3_peer_rank.py) and hetero (`hetero compile` for the two-host fleet, `hetero run` in a, `hetero worker
--host b` in b, with the compiled CurveZMQ security or a copy switched to none); each returns its step
times, the link's bytes and busy fractions over steps 3..N and, traced, the timeline."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import w1_model as w1
from w3_net import IPS, LinkPair, Sampler
from w3_timeline import hetero_trace_env, timeline

from hetero.runtime.base.processes import last_line
from hetero.runtime.run.metrics_file import NAME, StepLine, read_metrics

HOSTS = ("a", "b")  # plan host names: stage 0 (and the coordinator) on a, stage 1 on b
BASE_PORT = 29500  # fresh namespaces: nothing else can hold it
PEER_PORT = 29400  # torch.distributed's rendezvous (TCPStore) on a
HETERO = [sys.executable, "-m", "hetero.cli"]
PEER_RANK = Path(__file__).resolve().with_name("w3_peer_rank.py")  # one rank of the peer, run in a namespace
OPS = ("data_wait", "RA", "F", "SA", "RG", "B", "SG", "STEP", "clip_wait")  # metrics.jsonl stage_ops


def _finish(procs: dict[str, subprocess.Popen], main: str, timeout: float) -> tuple[int | None, str]:
    """Wait for ``procs[main]`` then the others (60 s more); (its return code, a note on any failure)."""
    note = ""
    deadline = time.monotonic() + timeout
    try:
        code = procs[main].wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None, f"{main} did not finish within {timeout:.0f} s"
    for name, proc in procs.items():
        try:
            other = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            note = f"{name} still running 60 s after {main} exited"
            continue
        if other != 0 and not note:
            note = f"{name} exited with {other}"
    return code, note


def _last_line(path: Path) -> str:
    return _last_line_of(path.read_text(errors="replace") if path.is_file() else "")


def run_peer(link: LinkPair, model: dict[str, Any], steps: int, work: Path, timeout: float, tag: str,
             trace: bool = True) -> dict[str, Any]:
    """torch.distributed.pipelining, rank 0 in a and rank 1 in b; per-step times, link window, timeline."""
    out, marks, trace_dir = work / f"{tag}-times.json", work / f"{tag}-marks.txt", work / f"trace-{tag}"
    for f in (out, marks):
        f.unlink(missing_ok=True)
    shutil.rmtree(trace_dir, ignore_errors=True)
    trace_dir.mkdir(parents=True)
    procs: dict[str, subprocess.Popen] = {}
    sampler = Sampler(link, marks)
    sampler.start()
    try:
        for rank in (1, 0):
            cmd = [sys.executable, str(PEER_RANK), "--peer-rank", str(rank), "--master", IPS[0],
                   "--port", str(PEER_PORT), "--model-dir", str(model["model_dir"]), "--data", str(model["data"]),
                   "--steps", str(steps), "--out", str(out), "--marks", str(marks) if rank == 0 else "",
                   "--hidden", str(model["hidden"]), "--seq", str(model["seq"]), "--trace", str(trace_dir) if trace else ""]
            env = {**os.environ, "GLOO_SOCKET_IFNAME": link.veth[rank], "PYTHONUNBUFFERED": "1"}
            with open(work / f"{tag}-rank{rank}.log", "w") as log:
                procs[f"rank{rank}"] = subprocess.Popen(link.exec(rank, cmd), stdin=subprocess.DEVNULL, stdout=log,
                                                        stderr=subprocess.STDOUT, env=env, start_new_session=True)
        code, note = _finish(procs, "rank0", timeout)
    finally:
        sampler.stop()
        for proc in procs.values():  # (a timeout or Ctrl-C) LinkPair.down() ends the rest
            if proc.poll() is None:
                proc.kill()
    if code != 0 or not out.is_file():
        return {"available": False, "note": note or f"rank 0: {_last_line(work / f'{tag}-rank0.log')}"}
    return {"available": True, "times": json.loads(out.read_text()), "link": sampler.window(steps), "note": note,
            "timeline": timeline(trace_dir, sampler, steps) if trace else None}


def compile_plan(model: dict[str, Any], rate_bps: float, steps: int, work: Path, compression: str = "none"
                 ) -> tuple[Path | None, str, float | None]:
    """`hetero compile` for the two-host fleet with this link and ``planner.compression``; returns (plan dir, note,
    predicted step s)."""
    conf = work / "conf"
    (conf / "hardware").mkdir(parents=True, exist_ok=True)
    devices = "      - {type: cpu, count: 1, threads: 1}\n"
    hosts = "".join(f"  - name: {h}\n    address: {ip}\n    port: {BASE_PORT}\n    devices:\n{devices}"
                    for h, ip in zip(HOSTS, IPS, strict=True))
    (conf / "hardware" / "w3.yaml").write_text(
        f"name: w3\nhosts:\n{hosts}links:\n  - {{a: {HOSTS[0]}, b: {HOSTS[1]}, bandwidth_gbps: {rate_bps / 1e9:g}, "
        "latency_us: 50}\n")
    out = work / f"plan-{rate_bps / 1e6:g}mbit-{compression}"
    cmd = HETERO + [
        "compile", "-cd", str(conf), "model=hf", f"model.pretrained={model['model_dir']}", f"model.seq_len={model['seq']}",
        "model.dtype=float32", "lora.r=8", "lora.alpha=16", "hardware=w3", f"train.micro_batch_size={w1.MICRO_BATCH}",
        f"train.num_micro_batches={w1.NUM_MICRO}", f"train.steps={steps}", f"train.lr={w1.LR}", "train.schedule=1f1b",
        f"data.path={model['data']}", "data.format=tokens", "planner.num_stages=2",
        f"planner.compression={compression}", f"output={out}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work, timeout=600)
    if proc.returncode != 0:
        return None, f"hetero compile failed: {_last_line_of(proc.stderr or proc.stdout)}", None
    plan = json.loads((out / "plan.json").read_text())
    hosts_of = [s["host"] for s in plan["stages"]]
    if hosts_of != list(HOSTS):
        return None, f"plan puts stages on hosts {hosts_of}, not {list(HOSTS)}", None
    predicted = float(plan["prediction"]["step_time_s"])
    split = "/".join(str(sum(n.startswith("layers.") for n in [*s["node_names"], *(x for c in s.get("chunks", [])
                                                                          for x in c["node_names"])]))
                     for s in plan["stages"])
    split += " (interleaved)" if any(s.get("chunks") for s in plan["stages"]) else ""
    link = plan["stages"][0].get("compress_out", "none")
    return out, (f"compression={compression}: stage 0 on {hosts_of[0]}, stage 1 on {hosts_of[1]}, layers {split}; "
                 f"hand-offs {'uncompressed' if link == 'none' else link}; predicted {predicted:.3f} s/step; "
                 f"security {plan['security']['mode']}"), predicted


def _last_line_of(text: str) -> str:
    """The last non-blank line of a log or a command's output (hetero's own helper, unclipped)."""
    return last_line(text, limit=None) or "(no output)"


def plan_with_security(plan_dir: Path, mode: str) -> Path:
    """A copy of the plan switched to ``mode`` (curve keeps the compiled one)."""
    if mode == "curve":
        return plan_dir
    copy = plan_dir.with_name(f"{plan_dir.name}-{mode}")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(plan_dir, copy)
    proc = subprocess.run(HETERO + ["keys", str(copy / "plan.json"), "--mode", mode], capture_output=True, text=True,
                          timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"hetero keys --mode {mode}: {_last_line_of(proc.stderr or proc.stdout)}")
    return copy


def run_hetero(link: LinkPair, plan_dir: Path, steps: int, work: Path, tag: str, timeout: float,
               trace: bool = True) -> dict[str, Any]:
    """`hetero worker --host b` in b and `hetero run` in a; metrics.jsonl rows, link window, timeline."""
    run_dir, worker_dir, trace_dir = work / f"run-{tag}", work / f"worker-{tag}", work / f"trace-{tag}"
    for d in (run_dir, worker_dir, trace_dir):
        shutil.rmtree(d, ignore_errors=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if trace:
        env = hetero_trace_env(work, trace_dir, env)
    plan = str(plan_dir / "plan.json")
    sampler = Sampler(link, run_dir / "metrics.jsonl")
    procs: dict[str, subprocess.Popen] = {}
    sampler.start()
    try:
        commands = {"worker": (1, ["worker", plan, "--host", HOSTS[1], "--run-dir", str(worker_dir)]),
                    "run": (0, ["run", plan, "--run-dir", str(run_dir), "--no-progress"])}
        for name, (side, args) in commands.items():
            with open(work / f"{tag}-{name}.log", "w") as log:
                procs[name] = subprocess.Popen(link.exec(side, HETERO + args), stdin=subprocess.DEVNULL, stdout=log,
                                               stderr=subprocess.STDOUT, cwd=work, start_new_session=True, env=env)
        code, note = _finish(procs, "run", timeout)
    finally:
        sampler.stop()
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    metrics = run_dir / NAME
    rows = read_metrics(metrics).steps if metrics.is_file() else []
    if code != 0 or len(rows) < steps:
        why = note or f"hetero run: {_last_line(work / f'{tag}-run.log')}"
        return {"available": False, "note": f"{why} ({len(rows)} of {steps} steps in metrics.jsonl)"}
    return {"available": True, "times": [s.step_time_s for s in rows], "rows": rows,
            "link": sampler.window(steps), "note": note, "timeline": timeline(trace_dir, sampler, steps) if trace else None}


def stage_ops(rows: list[StepLine]) -> list[dict[str, float]]:
    """Per stage, the median over steps 3..N of each op's seconds per step (metrics.jsonl stage_ops)."""
    tail = rows[2:] if len(rows) > 2 else rows
    stages = len(tail[0].stage_ops)
    return [{op: statistics.median(float(r.stage_ops[k].get(op, 0.0)) for r in tail) for op in OPS}
            for k in range(stages)]
