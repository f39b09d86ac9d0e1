"""Support for the planner tests (helpers, not tests): synthetic fleets of datasheet cards, Llama-shaped graphs
and their cost tables."""

from __future__ import annotations

import random

from hetero.graph import CutEdge, LayerGraph, LayerNode, TensorSpec
from hetero.hardware import build_cluster, load_device_types
from hetero.planner import plan
from hetero.planner import plan as make_plan
from hetero.planner.model.cost import build_cost_table
from hetero.planner.model.cost_model import RooflineCostModel
from hetero.profile import (
    DeviceProfile,
    LayerProfile,
    LinearFit,
    LinkProfile,
    Profile,
    fleet_hash,
    model_hash,
)
from hetero.specs import (
    ClusterSpec,
    DataSpec,
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
    devices: dict[str, list[DeviceSpec]] = {}
    for host, kind, mem in spec:
        on_host = devices.setdefault(host, [])
        on_host.append(make_device(f"{host}.gpu{len(on_host)}", host, kind, len(on_host), mem))
    names = list(devices)
    links = [LinkSpec(a, b, gbps, 200.0) for i, a in enumerate(names) for b in names[i + 1 :]]
    return ClusterSpec(name="test", hosts=[HostSpec(name=h, port=29500, devices=d) for h, d in devices.items()],
                       links=links)


def make_graph(num_decoders: int, hidden: int = 4096, scale: float = 1.0, rng: random.Random | None = None,
               recompute: bool = False) -> LayerGraph:
    """A Llama-shaped chain: embed, decoders (optionally of random sizes), norm+head as one node.

    ``recompute``: decoder layers say what they keep when recomputing (their input), so they can."""
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
                hidden * 2.0 if recompute else None,
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


def table_for(graph, cluster, schedule="1f1b", m=4, quantization="none", headroom=0.1,  # type: ignore[no-untyped-def]
              recompute="auto"):
    train = TrainSpec(micro_batch_size=1, num_micro_batches=m, schedule=schedule)
    opts = PlannerOptions(memory_headroom=headroom, recompute=recompute)
    return build_cost_table(graph, make_model(quantization), cluster, train, opts, RooflineCostModel(0.4)), train, opts


def fleet(threads: list[int], link_gbps: float | None = None):
    if link_gbps is None:
        hosts = [{"name": "localhost", "devices": [{"type": "cpu", "threads": t} for t in threads]}]
        return build_cluster({"name": "local", "hosts": hosts}, load_device_types())
    hosts = [{"name": f"h{k}", "address": f"10.0.0.{k + 1}", "devices": [{"type": "cpu", "threads": t}]}
             for k, t in enumerate(threads)]
    cfg = {"name": "lan", "hosts": hosts, "default_link": {"bandwidth_gbps": link_gbps, "latency_us": 100}}
    return build_cluster(cfg, load_device_types())


def a_plan(tiny_spec, graph, cluster, m: int = 8, split: list[int] | None = None, schedule: str = "1f1b"):
    train = TrainSpec(micro_batch_size=4, num_micro_batches=m, schedule=schedule)
    return make_plan(tiny_spec, graph, cluster, train, DataSpec(), PlannerOptions(time_limit_s=5, split=split))


def local_fleet(threads: list[int]):
    """This machine's CPU as one stage per entry of ``threads``."""
    devices = [{"type": "cpu", "threads": t} for t in threads]
    return build_cluster({"name": "local", "hosts": [{"name": "localhost", "devices": devices}]}, load_device_types())


def synthetic_profile(cluster, model: ModelSpec, decoder_b: dict[str, float], kinds=("embedding", "decoder", "norm", "head")) -> Profile:
    """A profile whose decoder costs b seconds per token on each device (the rest cheap)."""
    devices = []
    for d in cluster.devices:
        layers = {}
        for kind in kinds:
            b = decoder_b[d.name] if kind == "decoder" else 1e-8
            layers[kind] = LayerProfile(kind, _fit(1e-4, b), _fit(1e-4, 2 * b), 1e5, 10, 4000.0, 4000.0, "test")
        devices.append(DeviceProfile(d.name, d.host, d.type, d.backend, "float32", "none", d.threads, 8.0,
                                     model.seq_len, [128, 512], layers))
    links = [LinkProfile("localhost", "localhost", 10.0, 50.0)]
    return Profile(cluster.name, fleet_hash(cluster), model.name, model_hash(model), devices, links, created="now")


def _plan(cluster, graph, quant="nf4", m=4, schedule="1f1b", **opts):  # type: ignore[no-untyped-def]
    # The placement as the solvers find it (one chunk per device; tests/unit/test_interleaved.py plans interleaving).
    opts.setdefault("interleave", "off")
    train = TrainSpec(micro_batch_size=1, num_micro_batches=m, schedule=schedule)
    return plan(make_model(quant), graph, cluster, train, DataSpec(), PlannerOptions(time_limit_s=20.0, **opts))


def _fit(a: float, b: float) -> LinearFit:
    return LinearFit(a, b, 1.0, [[128.0, a + b * 128], [512.0, a + b * 512]])
