"""compiler.emit: stage artifacts cover the model exactly once, and the segments compose to the full model."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from tiny_specs import tiny_plan

from hetero.compiler.emit import emit
from hetero.compiler.fxgraph import PipelineView, build_config
from hetero.errors import ConfigError, PlanError
from hetero.plan import Plan


@pytest.fixture(scope="module")
def emitted(tmp_path_factory):
    out = tmp_path_factory.mktemp("emit")
    plan = tiny_plan()
    return plan, out, emit(plan, out)


def test_stage_manifests_cover_every_param_once(emitted):
    plan, out, paths = emitted
    assert {p.name for p in paths} >= {
        "plan.json",
        "stage.json",
        "segment.py.txt",
        "placement.png",
        "schedule.png",
    }
    manifests = [json.loads((out / s.artifact / "stage.json").read_text()) for s in plan.stages]
    assert [s.artifact for s in plan.stages] == [f"artifacts/{s.host}/stage{s.index}" for s in plan.stages]
    loaded = [p for m in manifests for p in m["params"]]
    graph_params = [p for n in plan.graph.nodes for p in n.param_names]
    assert sorted(loaded) == sorted(graph_params) and len(loaded) == len(set(loaded))
    for m, stage in zip(manifests, plan.stages, strict=True):
        nodes = plan.graph.nodes[stage.first_node : stage.last_node + 1]
        assert m["nodes"] == stage.node_names == [n.name for n in nodes]
        assert m["params"] == [p for n in nodes for p in n.param_names]
        assert m["input_hash"] == plan.input_hash and m["program"] == stage.program
        assert m["host"] == stage.host and m["endpoint"] == stage.endpoint


def test_boundaries_and_neighbours_line_up(emitted):
    plan, out, _ = emitted
    manifests = [json.loads((out / s.artifact / "stage.json").read_text()) for s in plan.stages]
    hidden = plan.graph.hidden_size
    assert manifests[0]["receives"] == [] and manifests[0]["reads_input_ids"] and manifests[0]["prev"] is None
    assert manifests[-1]["sends"] == [] and manifests[-1]["computes_loss"] and manifests[-1]["next"] is None
    for a, b in zip(manifests, manifests[1:], strict=False):
        assert a["sends"] == b["receives"]
        assert [t["name"] for t in a["sends"]] == ["hidden_states"]
        assert a["sends"][0]["shape"] == ["batch", "seq", hidden]
        # CPU stages compute and send float32: the traced bf16 bytes are rescaled to the wire dtype.
        assert a["sends"][0]["wire_dtype"] == a["dtype"] == "float32"
        assert a["sends"][0]["bytes_per_token"] == hidden * 4
        assert a["next"]["endpoint"] == b["endpoint"] and b["prev"]["endpoint"] == a["endpoint"]
    assert manifests[1]["rebuilds"] == ["rope_cos", "rope_sin"]
    assert Plan.load(out / "plan.json").input_hash == plan.input_hash  # written plan validates


def test_segments_compose_to_the_full_model(emitted):
    """Executing the emitted segment code stage after stage gives the whole model's logits."""
    plan, out, _ = emitted
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(
        build_config(plan.model.architecture), dtype=torch.float32
    ).eval()
    view = PipelineView(model)
    ids = torch.randint(0, plan.graph.vocab_size, (2, 16))
    value = ids
    for stage in plan.stages:
        source = (out / stage.artifact / "segment.py.txt").read_text()
        scope: dict = {"torch": torch}
        exec(compile(source, str(stage.artifact), "exec"), scope)
        with torch.no_grad():
            value = scope["forward"](view, value)
    with torch.no_grad():
        expected = model(ids).logits
    torch.testing.assert_close(value, expected)


def test_pictures_written_and_non_trivial(emitted):
    import matplotlib.image as mpimg

    _, out, _ = emitted
    for name in ("placement.png", "schedule.png"):
        image = mpimg.imread(out / name)
        assert image.shape[0] > 300 and image.shape[1] > 600
        colours = {tuple(px) for px in image[::7, ::7, :3].reshape(-1, 3).round(2).tolist()}
        assert len(colours) > 20, name  # boxes, bars and text, not a blank canvas


def test_emit_rejects_broken_plans(tmp_path):
    plan = tiny_plan()
    plan = replace(plan, stages=[s if s.index != 1 else replace(s, first_node=s.first_node + 1) for s in plan.stages])
    with pytest.raises(PlanError, match="the stages of a pipeline must cover nodes"):
        emit(plan, tmp_path)
    plan = tiny_plan()
    plan = replace(plan, stages=[replace(plan.stages[0], host="../evil"), *plan.stages[1:]])
    with pytest.raises(ConfigError, match="folder name"):
        emit(plan, tmp_path)
