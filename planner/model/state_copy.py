"""What keeping a run recoverable costs, priced with the plan (runtime.elastic=auto, runtime/run/elastic.py).

While it trains, the coordinator copies every stage's state (its LoRA weights and AdamW's two moments, fp32: the
checkpoint payload) into its own memory at a step boundary, so a lost stage cannot take the run's state along. A
copy costs each stage the serialization of its state (a copy off a GPU over the host link, or through CPU memory)
and the transfer to the coordinator's host; the stages of one host share its link. The copies are spaced so that
they cost at most STATE_COPY_SHARE of the steps' time between them: every ``every`` steps. The plan shows both, as
what to expect; the coordinator copies after the first step, measures that copy and spaces the next ones by it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from hetero.graph import LayerGraph
from hetero.planner.model.cost_model import HOST_COPY_BYTES_PER_S, MESSAGE_FIXED_S
from hetero.specs import ClusterSpec

STATE_BYTES_PER_LORA_PARAM = 12.0  # the LoRA weight and AdamW's two moments, fp32
STATE_COPY_SHARE = 0.01  # a copy's cost over the steps' time between two copies, at most


@dataclass(frozen=True)
class StateCopy:
    """One copy of the run's state to the coordinator: its bytes, its seconds, and the steps between copies."""

    bytes: float
    seconds: float
    every: int


def copy_every(copy_s: float, step_s: float) -> int:
    """Steps between copies that keep a copy of ``copy_s`` under STATE_COPY_SHARE of the steps' time."""
    if step_s <= 0 or not math.isfinite(copy_s / step_s):
        return 1
    return max(1, math.ceil(copy_s / (STATE_COPY_SHARE * step_s)))


def state_copy(stages: Sequence, graph: LayerGraph, cluster: ClusterSpec, step_time_s: float,
               pipeline: Sequence[int] | None = None) -> StateCopy:
    """The priced copy of the state of ``stages`` (plan.StagePlan; only those of ``pipeline``, the first replica's,
    since replicas hold the same state) to the coordinator on stage 0's host, at a step of ``step_time_s``."""
    coordinator = stages[0].host
    chosen = [stages[k] for k in (pipeline if pipeline is not None else range(len(stages)))]
    per_host: dict[str, float] = defaultdict(float)
    prepare: dict[str, float] = defaultdict(float)  # per host: its slowest stage's serialization
    for s in chosen:
        nbytes = STATE_BYTES_PER_LORA_PARAM * sum(graph.nodes[i].lora_params for i in s.nodes())
        device = cluster.device(s.device)
        rate = HOST_COPY_BYTES_PER_S if s.backend != "cpu" else device.memory_bandwidth_gbs * 1e9
        per_host[s.host] += nbytes
        prepare[s.host] = max(prepare[s.host], nbytes / rate + MESSAGE_FIXED_S)
    seconds = 0.0
    for host, nbytes in per_host.items():
        link = cluster.link(host, coordinator)
        transfer = nbytes * 8 / (link.bandwidth_gbps * 1e9) + link.latency_us * 1e-6
        seconds = max(seconds, prepare[host] + transfer)
    return StateCopy(sum(per_host.values()), seconds, copy_every(seconds, step_time_s))
