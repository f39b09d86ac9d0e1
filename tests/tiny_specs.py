"""Support for the tests (helpers, not tests): the tiny model of conf/model/tiny.yaml as a ModelSpec, Llama 3 8B
and 70B architectures, and a real plan of the tiny model on two hosts."""

from __future__ import annotations

from pathlib import Path

import yaml

from hetero.compiler.trace import trace
from hetero.hardware import build_cluster
from hetero.plan import Plan
from hetero.planner import plan as make_plan
from hetero.specs import DataSpec, LoraSpec, ModelSpec, PlannerOptions, TrainSpec

ROOT = Path(__file__).resolve().parents[1]


TINY = yaml.safe_load((ROOT / "conf/model/tiny.yaml").read_text())


LLAMA8B = dict(
    model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    tie_word_embeddings=False,
)  # fmt: skip


LLAMA70B = dict(
    LLAMA8B, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, intermediate_size=28672
)


def tiny_model(**kw) -> ModelSpec:
    """conf/model/tiny.yaml's model with its lora section, fields overridable."""
    m = TINY["model"]
    lora = LoraSpec(
        r=TINY["lora"]["r"],
        alpha=float(TINY["lora"]["alpha"]),
        target_modules=list(TINY["lora"]["target_modules"]),
    )
    kw.setdefault("lora", lora)
    return ModelSpec(name="tiny", architecture=dict(m["architecture"]), seq_len=m["seq_len"], **kw)


HOSTS = {
    "name": "two_hosts",
    "hosts": [
        {"name": "alpha", "address": "10.0.0.1", "devices": [{"type": "cpu"}]},
        {"name": "beta", "address": "10.0.0.2", "port": 30000, "devices": [{"type": "cpu", "count": 2}]},
    ],
    "links": [{"a": "alpha", "b": "beta", "bandwidth_gbps": 10, "latency_us": 50}],
}


def tiny_plan(split: list[int] = (1, 3, 2)) -> Plan:
    """A real plan (planner with a manual split) of the tiny model over three CPU stages on two hosts."""
    model = tiny_model()
    cluster = build_cluster(HOSTS)
    options = PlannerOptions(split=list(split), devices=[d.name for d in cluster.devices])
    return make_plan(model, trace(model), cluster, TrainSpec(num_micro_batches=4), DataSpec(), options)
