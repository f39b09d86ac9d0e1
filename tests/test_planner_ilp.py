"""The placement ILP against exhaustive search, on random small fleets and graphs."""

from __future__ import annotations

import random

import pytest
from hetero.planner.bruteforce import brute_force
from hetero.planner.cost import RooflineCostModel, build_cost_table
from hetero.planner.ilp import solve_ilp

from hetero.graph import CutEdge, LayerGraph, LayerNode, TensorSpec
from hetero.specs import (
    ClusterSpec,
    DeviceSpec,
    HostSpec,
    LinkSpec,
    ModelSpec,
    PlannerOptions,
    TrainSpec,
)

# (type, memory GB, bandwidth GB/s, fp32, fp16, bf16 TFLOPS, bf16?)
TYPES = {
    "rtx3090": (24.0, 936.0, 35.6, 71.0, 71.0, True),
    "rtx4090": (24.0, 1008.0, 82.6, 165.0, 165.0, True),
    "v100": (16.0, 900.0, 15.7, 125.0, 0.0, False),
    "m40": (24.0, 288.0, 6.8, 6.8, 0.0, False),
    "rtx5090": (32.0, 1792.0, 104.8, 209.5, 209.5, True),
}


def make_device(name: str, host: str, kind: str, index: int, memory_gb: float | None = None) -> DeviceSpec:
    """A CUDA device of a datasheet type, optionally with another memory size."""
    mem, bw, f32, f16, b16, bf16 = TYPES[kind]
    return DeviceSpec(
        name=name,
        host=host,
        type=kind,
        index=index,
        backend="cuda",
        display_name=kind.upper(),
        memory_gb=memory_gb if memory_gb is not None else mem,
        memory_bandwidth_gbs=bw,
        tflops={"float32": f32, "float16": f16, "bfloat16": b16},
        bf16=bf16,
        nf4=True,
        overrides=["memory_gb"] if memory_gb is not None else [],
    )


def make_cluster(spec: list[tuple[str, str, float | None]], gbps: float = 10.0) -> ClusterSpec:
    """Hosts from (host, type, memory override) triples; every pair of hosts linked at ``gbps``."""
    hosts: dict[str, HostSpec] = {}
    for host, kind, mem in spec:
        h = hosts.setdefault(host, HostSpec(name=host, port=29500))
        h.devices.append(make_device(f"{host}.gpu{len(h.devices)}", host, kind, len(h.devices), mem))
    names = list(hosts)
    links = [LinkSpec(a, b, gbps, 200.0) for i, a in enumerate(names) for b in names[i + 1 :]]
    return ClusterSpec(name="test", hosts=list(hosts.values()), links=links)


def make_graph(num_decoders: int, hidden: int = 4096, scale: float = 1.0, rng: random.Random | None = None) -> LayerGraph:
    """A Llama-shaped chain: embed, decoders (optionally of random sizes), norm+head as one node."""
    rng = rng or random.Random(0)
    vocab, inter = 32000, int(hidden * 3.5)
    nodes = [
        LayerNode("embed", "embedding", ["model.embed_tokens.weight"], vocab * hidden, 0, vocab * hidden * 2.0, 0, 0.0, 0.0, 0.0)
    ]
    for k in range(num_decoders):
        jitter = rng.uniform(0.5, 1.5) * scale
        params = int((4 * hidden * hidden + 3 * hidden * inter) * jitter)
        flops = 2.0 * params
        nodes.append(
            LayerNode(
                f"layers.{k}", "decoder", [f"model.layers.{k}.x"], params, params, params * 2.0,
                int(8 * 2 * hidden * 7 * jitter), flops, 2.2 * flops, hidden * 2.0 * 12 * jitter,
            )
        )
    nodes.append(
        LayerNode("head", "head", ["lm_head.weight"], vocab * hidden, 0, vocab * hidden * 2.0, 0,
                  2.0 * vocab * hidden, 2.0 * vocab * hidden, vocab * 4.0)
    )
    edges = [
        CutEdge(n.name, [TensorSpec("hidden", ["batch", "seq", hidden], "bfloat16", hidden * 2.0)]) for n in nodes[:-1]
    ]
    return LayerGraph("synthetic", "llama", 2048, "bfloat16", "none", hidden, vocab, num_decoders, nodes, edges)


def make_model(quantization: str = "none") -> ModelSpec:
    return ModelSpec(name="synthetic", architecture={"model_type": "llama"}, dtype="bfloat16",
                     quantization=quantization, seq_len=2048)


def table_for(graph, cluster, schedule="1f1b", m=4, quantization="none", headroom=0.1):  # type: ignore[no-untyped-def]
    train = TrainSpec(micro_batch_size=1, num_micro_batches=m, schedule=schedule)
    opts = PlannerOptions(memory_headroom=headroom)
    return build_cost_table(graph, make_model(quantization), cluster, train, opts, RooflineCostModel(0.4)), train, opts


def random_problem(rng: random.Random):  # type: ignore[no-untyped-def]
    """2-4 devices on 1-3 hosts (some identical, some tight), a 4-9 node graph."""
    n_dev = rng.randint(2, 4)
    n_hosts = rng.randint(1, 3)
    spec = []
    for _ in range(n_dev):
        kind = rng.choice(["rtx3090", "rtx4090", "v100", "m40"])
        mem = None if rng.random() < 0.5 else rng.choice([2.0, 3.0, 4.0, 6.0, 10.0])
        spec.append((f"h{rng.randrange(n_hosts)}", kind, mem))
    if rng.random() < 0.4:  # an identical twin of the first device
        spec.append(spec[0])
        spec = spec[:4]
    cluster = make_cluster(spec, gbps=rng.choice([1.0, 10.0, 100.0]))
    graph = make_graph(rng.randint(2, 7), hidden=rng.choice([1024, 2048, 4096]), rng=rng)
    return cluster, graph


@pytest.mark.parametrize("seed", range(30))
def test_ilp_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    cluster, graph = random_problem(rng)
    schedule = rng.choice(["1f1b", "gpipe"])
    table, _, _ = table_for(graph, cluster, schedule=schedule, m=rng.choice([1, 2, 4, 8]),
                            quantization=rng.choice(["none", "nf4"]))
    forced = rng.choice([None, None, 1, 2, 3])
    if forced and forced > min(len(cluster.devices), len(graph.nodes)):
        forced = None
    best = brute_force(table, forced)
    result = solve_ilp(table, forced, time_limit_s=30)
    if best is None:
        assert result.evaluation is None, "ILP found a placement the brute force says cannot fit"
        assert result.report.sol_status == "No Solution Exists"
        return
    assert result.evaluation is not None, result.report
    assert result.report.proven_optimal
    assert result.evaluation.feasible
    if forced:
        assert len(result.evaluation.placement.devices) == forced
    assert result.evaluation.step_time_s == pytest.approx(best.step_time_s, rel=1e-6)
    assert result.report.objective_s == pytest.approx(best.step_time_s, rel=1e-6)
