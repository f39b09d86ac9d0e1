"""compiler.pictures: what a person reads off placement.png and schedule.png is there and right."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest
from matplotlib.colors import to_hex
from matplotlib.patches import Rectangle
from test_emit import tiny_plan

from hetero.compiler.pictures import (
    BACKWARD_COLOUR,
    FORWARD_COLOUR,
    draw_placement,
    draw_schedule,
    placement_figure,
    schedule_figure,
    span_label,
)
from hetero.hardware import build_cluster
from hetero.planner.simulator import Event, Timeline


def _texts(fig) -> str:
    return "\n".join(t.get_text() for ax in fig.axes for t in ax.texts) + "\n" + fig.axes[0].get_title()


@pytest.fixture
def plan():
    return tiny_plan()


def test_span_labels():
    assert span_label(["embed", "layers.0", "layers.1", "layers.2"]) == "embed + layers 0-2"
    assert span_label(["layers.14", "layers.15", "norm", "head"]) == "layers 14-15 + norm + head"
    assert span_label(["layers.5"]) == "layer 5"
    assert span_label(["norm", "head"]) == "norm + head"


def test_placement_shows_spans_memory_links_and_idle_devices(plan):
    # A third host with a device the plan leaves out, linked to both others: the far link becomes an arc.
    hosts = {h.name: h for h in plan.cluster.hosts}
    spare = build_cluster({"name": "x", "hosts": [{"name": "gamma", "devices": [{"type": "cpu"}]}]}).hosts[0]
    plan.cluster.hosts = [hosts["alpha"], hosts["beta"], spare]
    plan.cluster.links = plan.cluster.links + [
        type(plan.cluster.links[0])("beta", "gamma", 1.0, 200.0),
        type(plan.cluster.links[0])("alpha", "gamma", 2.5, 300.0),
    ]
    fig = placement_figure(plan)
    text = _texts(fig)
    plt.close(fig)
    for stage in plan.stages:
        assert f"stage {stage.index}" in text
        assert span_label(stage.node_names) in text
        assert f"memory {stage.memory.total_gb:.1f} / {stage.memory.available_gb:.1f} GB usable" in text
    assert "embed + layer 0" in text and "layers 4-5 + norm + head" in text
    assert "not used by this plan" in text  # gamma's device
    assert "10 Gb/s, 50 us" in text and "1 Gb/s, 200 us" in text and "2.5 Gb/s, 300 us" in text
    assert f"{plan.prediction.step_time_s:.3g} s/step" in text


def test_schedule_draws_every_event_from_the_timeline(plan):
    fwd, bwd = 0.1, 0.2
    events = []
    for mb in range(3):  # a hand-made two-stage GPipe step
        events += [
            Event(0, "F", mb, mb * fwd, (mb + 1) * fwd),
            Event(1, "F", mb, (mb + 1) * fwd, (mb + 2) * fwd),
        ]
        events += [Event(1, "B", mb, 0.5 + mb * bwd, 0.5 + (mb + 1) * bwd)]
        events += [Event(0, "B", mb, 0.7 + mb * bwd, 0.7 + (mb + 1) * bwd)]
    events.append(Event(0, "SA", 0, 0.1, 0.12))
    timeline = Timeline(events, step_time_s=1.3, busy_fraction=[0.69, 0.69], bubble_fraction=0.31)
    plan.stages = plan.stages[:2]
    fig = schedule_figure(plan, timeline)
    ax = fig.axes[0]
    boxes = [p for p in ax.patches if isinstance(p, Rectangle)]
    forward = [p for p in boxes if to_hex(p.get_facecolor()) == FORWARD_COLOUR.lower()]
    backward = [p for p in boxes if to_hex(p.get_facecolor()) == BACKWARD_COLOUR.lower()]
    assert len(forward) == 6 and len(backward) == 6
    assert sorted(round(p.get_x(), 6) for p in backward) == sorted(
        round(e.start_s, 6) for e in events if e.op == "B"
    )
    labels = {t.get_text() for t in ax.texts}
    assert {"F0", "F1", "F2", "B0", "B1", "B2"} <= labels
    assert "step 1.3 s" in _texts(fig) and "bubble 31%" in ax.get_title()
    assert ax.get_xlim()[1] >= 1.3
    plt.close(fig)


def test_draw_functions_write_pngs(tmp_path):
    plan = tiny_plan()  # the real simulator's timeline this time
    placement = draw_placement(plan, tmp_path / "placement.png")
    schedule = draw_schedule(plan, tmp_path / "schedule.png")
    for path in (placement, schedule):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000
