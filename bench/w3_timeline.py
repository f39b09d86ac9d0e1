"""W3's timeline: when each action of a run started and ended, and what the link did meanwhile.

hetero: a sitecustomize put first on the stage processes' PYTHONPATH registers an observer on the
executor's profiling seam (``Executor.action_observers``, runtime/stage/executor.py) that appends
[op, step, mb, t0, t1] (wall clock) per action to DIR/stage<k>.jsonl; nothing in the runtime changes.
The peer (w3_peer_rank.py) writes the same rows for its forward/backward chunks and send/recv waits.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

from w3_net import Sampler

# Put first on a hetero process's PYTHONPATH (with W3_TRACE=DIR): once hetero.runtime.stage.executor has
# been imported (importing it here would load torch before hetero does), registers the observer. Without
# W3_TRACE it does nothing.
TRACE_HOOK = '''"""bench_w3 --trace: time each runtime action of a hetero stage (W3_TRACE=DIR)."""
import importlib.abc
import importlib.util
import json
import os
import sys
import time

TARGET = "hetero.runtime.stage.executor"
_files = {}


def _record(stage, op, step, mb, t0, t1):
    """An Executor.action_observers callback: t0 and t1 come on perf_counter's clock, go out as wall clock."""
    out = _files.get(stage)
    if out is None:
        out = _files[stage] = open(os.path.join(os.environ["W3_TRACE"], f"stage{stage}.jsonl"), "a", buffering=1)
    wall = time.time() - time.perf_counter()  # taken now: the two clocks may drift apart over a run
    out.write(json.dumps([str(op), step, mb, t0 + wall, t1 + wall]) + "\\n")


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                module.Executor.action_observers.append(_record)

            spec.loader.exec_module = exec_module
        return spec


if os.environ.get("W3_TRACE"):
    sys.meta_path.insert(0, _Hook())
'''


def hetero_trace_env(work: Path, trace_dir: Path, env: dict[str, str]) -> dict[str, str]:
    """``env`` for hetero processes whose actions are timed into ``trace_dir`` (the hook in work/trace-hook)."""
    hook = work / "trace-hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(TRACE_HOOK)
    trace_dir.mkdir(parents=True)
    return {**env, "W3_TRACE": str(trace_dir),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), env.get("PYTHONPATH")]))}


_COMPUTE = ("F", "B", "L")  # forward (with the last stage's loss), backward
_WAITS = ("RA", "RG", "W")  # hetero: waiting for an activation / a gradient; the peer: waiting on send/recv work


def timeline(trace_dir: Path, sampler: Sampler, steps: int) -> dict[str, Any] | None:
    """From a run's trace (stage<k>.jsonl) and the link samples, over steps 3..N, per stage: compute
    and wait seconds per step, and how busy the link toward that stage was while it waited; for
    hetero, each activation's / gradient's transit (the sender's SA/SG end to the receiver's RA/RG
    end) when the receiver was already waiting for it."""
    traces: dict[int, list[list[Any]]] = {}
    for f in sorted(trace_dir.glob("stage*.jsonl")):
        rows = [json.loads(ln) for ln in f.read_text().splitlines() if ln.strip()]
        if rows:
            traces[int(f.stem[len("stage"):])] = rows
    if sorted(traces) != [0, 1] or sampler.link.rate_bps is None or not sampler.samples:
        return None
    all_steps = sorted({r[1] for rows in traces.values() for r in rows})
    kept = set(all_steps[2:steps])
    n = max(1, len(kept))
    out: dict[str, Any] = {"stages": []}
    for k in (0, 1):
        rows = [r for r in traces[k] if r[1] in kept]
        waits = [r for r in rows if r[0] in _WAITS and r[4] - r[3] > 0.002]
        wait_s = sum(r[4] - r[3] for r in waits)
        toward = 0 if k == 1 else 1  # stage 1 waits for what a sends (a->b), stage 0 for what b sends
        moved = sum(sampler.bytes_between(toward, r[3], r[4]) for r in waits)
        out["stages"].append({
            "compute_s": sum(r[4] - r[3] for r in rows if r[0] in _COMPUTE) / n,
            "wait_s": sum(r[4] - r[3] for r in rows if r[0] in _WAITS) / n,
            "waits_over_2ms": len(waits) / n,
            "link_busy_in_waits": moved * 8 / sampler.link.rate_bps / wait_s if wait_s > 0 else None,
        })
    # hetero: stage 1's waits for its first activation (pipeline fill) vs the later ones (steady state)
    ra = [r for r in traces[1] if r[0] == "RA" and r[1] in kept]
    if ra:
        out["ra_first_s"] = sum(r[4] - r[3] for r in ra if r[2] == 0) / n
        out["ra_rest_per_mb_s"] = sum(r[4] - r[3] for r in ra if r[2] != 0) / max(1, sum(r[2] != 0 for r in ra))
    sent = {(r[0], r[1], r[2]): r[4] for k in (0, 1) for r in traces[k] if r[0] in ("SA", "SG")}
    for name, send_op, recv_op, receiver in (("act", "SA", "RA", 1), ("grad", "SG", "RG", 0)):
        transit = [r[4] - sent[(send_op, r[1], r[2])] for r in traces[receiver]
                   if r[0] == recv_op and r[1] in kept and r[4] - r[3] > 0.002 and (send_op, r[1], r[2]) in sent]
        out[f"{name}_transit_s"] = statistics.median(transit) if transit else None
        out[f"{name}_transit_n"] = len(transit)
    return out
