"""compiler.pictures: what a person reads off placement.png, schedule.png and simulate.png is there and right."""

from __future__ import annotations

import colorsys
import time
from dataclasses import replace

import matplotlib.pyplot as plt
import pytest
from matplotlib.colors import to_hex, to_rgb
from matplotlib.patches import FancyBboxPatch, Rectangle
from tiny_specs import tiny_plan

from hetero.compiler.pictures import (
    BACKWARD_COLOUR,
    FORWARD_COLOUR,
    MEMORY_PARTS,
    STAGE_PALETTE,
    STEP_COLOUR,
    WARNING_COLOUR,
    WARNING_TINT,
    crowded_stages,
    draw_placement,
    draw_schedule,
    draw_simulation,
    memory_axis_limits,
    placement_figure,
    schedule_blocks,
    schedule_figure,
    simulation_figure,
    span_label,
    stage_colour,
)
from hetero.hardware import build_cluster
from hetero.plan import ReplicaPlan
from hetero.planner.replan.whatif import memory_over_time
from hetero.planner.schedule.simulator import Event, Timeline, combine_replicas, simulate, simulate_plan
from hetero.program import parse_program


def _texts(fig) -> str:
    return "\n".join(t.get_text() for ax in fig.axes for t in ax.texts) + "\n" + fig.axes[0].get_title()


def _boxes(ax, colour: str) -> list[tuple[float, float, float, float]]:
    """(left, right, bottom, top) of every box drawn in ``colour``: a patch, or a rectangle of a collection
    (the Gantt draws its boxes as one collection per kind)."""
    boxes = [(p.get_x(), p.get_x() + p.get_width(), p.get_y(), p.get_y() + p.get_height()) for p in ax.patches
             if isinstance(p, Rectangle) and to_hex(p.get_facecolor()) == colour.lower()]
    for collection in ax.collections:
        faces = collection.get_facecolor()
        if len(faces) and to_hex(faces[0]) == colour.lower():
            for path in collection.get_paths():
                xs, ys = path.vertices[:, 0], path.vertices[:, 1]
                boxes.append((xs.min(), xs.max(), ys.min(), ys.max()))
    return boxes


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
    links = plan.cluster.links + [
        type(plan.cluster.links[0])("beta", "gamma", 1.0, 200.0),
        type(plan.cluster.links[0])("alpha", "gamma", 2.5, 300.0),
    ]
    plan = replace(plan, cluster=replace(plan.cluster, hosts=[hosts["alpha"], hosts["beta"], spare], links=links))
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
    plan = replace(plan, stages=plan.stages[:2])
    fig = schedule_figure(plan, timeline)
    ax = fig.axes[0]
    forward, backward = _boxes(ax, FORWARD_COLOUR), _boxes(ax, BACKWARD_COLOUR)
    assert len(forward) == 6 and len(backward) == 6
    assert sorted(round(b[0], 6) for b in backward) == sorted(
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
    timeline = simulate_plan(plan)
    schedule = draw_schedule(plan, timeline, tmp_path / "schedule.png")
    simulated = draw_simulation(plan, timeline, memory_over_time(plan, timeline), tmp_path / "sub" / "simulate.png")
    assert simulated == tmp_path / "sub" / "simulate.png"
    for path in (placement, schedule, simulated):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000


def test_gantt_names_a_box_only_where_the_name_fits(plan):
    """Forward boxes ever wider, then wide backwards: the narrow ones go unnamed (a name would spill over its
    neighbours), the wide ones are named, and every name drawn lies inside its box as rendered. However
    many boxes, they are a few collections (one patch each took seconds on a 20-GPU plan)."""
    events, t = [], 0.0
    for mb in range(12):
        events.append(Event(0, "F", mb, t, t + 0.005 * (mb + 1)))
        t += 0.005 * (mb + 1)
    events += [Event(0, "B", mb, 0.5 + 0.2 * mb, 0.7 + 0.2 * mb) for mb in range(4)]
    timeline = Timeline(events, step_time_s=1.3, busy_fraction=[0.9], bubble_fraction=0.1)
    fig = schedule_figure(replace(plan, stages=plan.stages[:1]), timeline)
    ax = fig.axes[0]
    named = {t.get_text(): t for t in ax.texts if t.get_text()[:1] in ("F", "B") and t.get_text()[1:].isdigit()}
    assert {"B0", "B1", "B2", "B3", "F11"} <= set(named) and not {"F0", "F1", "F2"} & set(named)
    renderer = fig.canvas.get_renderer()
    boxes = {e.op + str(e.mb): (e.start_s, e.end_s) for e in events}
    for label, text in named.items():
        drawn = text.get_window_extent(renderer)
        left, right = ax.transData.transform([(boxes[label][0], 0), (boxes[label][1], 0)])[:, 0]
        assert left <= drawn.x0 and drawn.x1 <= right, f"{label} spills out of its box"
    assert len(_boxes(ax, FORWARD_COLOUR)) == 12 and len(ax.patches) + len(ax.collections) <= 6
    plt.close(fig)


def test_pictures_past_their_deadline_are_left_out_and_drawn_later(tmp_path, capsys):
    """A compile out of time draws no picture, leaves no older one behind, names them and the command that
    draws them; `hetero show --pictures` draws them from plan.json."""
    from hetero.cli import main
    from hetero.cli.plan_commands import skipped_pictures_line
    from hetero.compiler.emit import PICTURES, draw_pictures

    plan = tiny_plan()
    plan_json = tmp_path / "plan.json"
    plan.save(plan_json)
    for name in PICTURES:
        (tmp_path / name).write_bytes(b"another plan's picture")
    assert draw_pictures(plan, tmp_path, by=time.perf_counter()) == []
    assert not any((tmp_path / name).exists() for name in PICTURES)
    line = skipped_pictures_line(plan_json, [plan_json], 2.0)
    assert "planner.time_limit_s=2" in line and "placement.png, schedule.png" in line
    assert line.endswith(f"draw them with: hetero show {plan_json} --pictures")
    assert main(["show", str(plan_json), "--no-gantt", "--pictures"]) == 0
    out = capsys.readouterr().out
    for name in PICTURES:
        assert f"wrote {tmp_path / name}" in out and (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert skipped_pictures_line(plan_json, [plan_json, *(tmp_path / name for name in PICTURES)], 2.0) is None


def _distance(a: str, b: str) -> float:
    return sum((x - y) ** 2 for x, y in zip(to_rgb(a), to_rgb(b), strict=True)) ** 0.5


def test_memory_parts_have_their_own_palette_and_legend(plan):
    """Greys with distinct hatches for memory, hues for stages, red for warnings: no colour means two things."""
    for part in MEMORY_PARTS:
        r, g, b = to_rgb(part.colour)
        assert r == g == b, f"{part.label} is not a neutral grey"
        assert part.colour.lower() not in {c.lower() for c in STAGE_PALETTE}
    assert len({p.colour for p in MEMORY_PARTS}) == len({p.hatch for p in MEMORY_PARTS}) == len(MEMORY_PARTS)
    for colour in STAGE_PALETTE:
        assert colorsys.rgb_to_hsv(*to_rgb(colour))[1] > 0.4  # a hue, never a grey
        assert _distance(colour, WARNING_COLOUR) > 0.3  # red is kept for warnings
    assert {stage_colour(k) for k in range(len(STAGE_PALETTE))} == set(STAGE_PALETTE)
    fig = placement_figure(plan)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    plt.close(fig)
    assert legend[0] == "memory: weights" and [p.label for p in MEMORY_PARTS[1:]] == legend[1:4]
    assert any("usable capacity" in t for t in legend) and any("90%" in t for t in legend)


def _with_memory(plan, shares: list[float]):
    """The plan with stage k's peak at shares[k] of a 10 GB usable device."""
    return replace(plan, stages=[replace(s, memory=replace(s.memory, total_gb=10.0 * share, available_gb=10.0))
                                 for s, share in zip(plan.stages, shares, strict=True)])


def test_devices_past_90_percent_of_memory_stand_out(plan):
    plan = _with_memory(plan, [0.9, 0.96, 0.5])  # exactly 90% is not past the line
    assert crowded_stages(plan) == [1]
    fig = placement_figure(plan)
    ax = fig.axes[0]
    tinted = [p for p in ax.patches if isinstance(p, FancyBboxPatch) and to_hex(p.get_facecolor()) == WARNING_TINT.lower()]
    assert len(tinted) == 1
    share_labels = {t.get_text(): to_hex(t.get_color()) for t in ax.texts if t.get_text().endswith("%")}
    assert share_labels == {"90%": "#333333", "96%": WARNING_COLOUR.lower(), "50%": "#333333"}
    assert "stage 1 above 90% of usable memory" in _texts(fig)
    # Every bar (white, full width = the 10 GB usable) marks its capacity at its right end (solid) and
    # 9 GB into it the 90% line (dashed red); the crowded bar has a red outline.
    bars = [p for p in ax.patches if type(p) is Rectangle and to_hex(p.get_facecolor()) == "#ffffff"]
    assert len(bars) == 3
    assert sorted(to_hex(b.get_edgecolor()) for b in bars).count(WARNING_COLOUR.lower()) == 1
    for colour, share in (("#222222", 1.0), (WARNING_COLOUR.lower(), 0.9)):
        marks = [line for line in ax.lines if to_hex(line.get_color()) == colour]
        assert len(marks) == 3
        for bar in bars:
            inside = [m for m in marks if bar.get_y() < sum(m.get_ydata()) / 2 < bar.get_y() + bar.get_height()
                      and bar.get_x() <= m.get_xdata()[0] <= bar.get_x() + bar.get_width() + 1e-9]
            assert len(inside) == 1
            assert inside[0].get_xdata()[0] == pytest.approx(bar.get_x() + share * bar.get_width())
    plt.close(fig)
    assert crowded_stages(_with_memory(tiny_plan(), [0.5, 0.5, 0.5])) == []


def test_step_blocks_follow_the_barrier_and_end_the_step(plan):
    """Each stage's STEP starts at the barrier (the last stage to finish its backwards) and lasts its
    gradient-norm round trip plus optimizer step; the latest one ends at the step time."""
    timeline = simulate_plan(plan)
    blocks = schedule_blocks(timeline)
    steps = {b.stage: b for b in blocks if b.kind == "STEP"}
    assert sorted(steps) == [s.index for s in plan.stages]
    last_backward = max(b.end_s for b in blocks if b.kind == "B")
    for s in plan.stages:
        step = steps[s.index]
        assert step.duration_s == pytest.approx(s.step_sync_s + s.overhead_s["STEP"])
        assert step.start_s >= last_backward and step.label == "STEP"
    assert len({round(b.start_s, 12) for b in steps.values()}) == 1
    assert max(b.end_s for b in steps.values()) == pytest.approx(timeline.step_time_s)
    assert [b.label for b in blocks if b.stage == 0 and b.kind == "F"] == ["F0", "F1", "F2", "F3"]

    fig = schedule_figure(plan, timeline)
    ax = fig.axes[0]
    step_boxes = _boxes(ax, STEP_COLOUR)
    assert sorted(round(b[1], 9) for b in step_boxes) == sorted(round(b.end_s, 9) for b in steps.values())
    assert sum(t.get_text().startswith("STEP") for t in ax.texts) == len(plan.stages)
    assert any(t.get_text() == "STEP: gradient-norm sync + optimizer" for t in ax.get_legend().get_texts())
    plt.close(fig)


def test_replicas_sum_gradients_before_a_zero_length_step(plan):
    """Two one-stage replicas without overheads: a reduce block before the barrier, then a STEP of
    zero seconds that is still drawn (a thin marker named 'STEP 0 s')."""
    program = parse_program(["F0", "B0", "F1", "B1", "STEP"])
    fast = simulate([program], [0.1], [0.2], [0.0])
    slow = simulate([program], [0.2], [0.3], [0.0])
    timeline = combine_replicas([fast, slow], reduce_s=0.25)
    blocks = schedule_blocks(timeline, reduce_s=0.25)
    reduce = [b for b in blocks if b.kind == "reduce"]
    steps = [b for b in blocks if b.kind == "STEP"]
    assert [(b.stage, b.start_s, b.duration_s) for b in reduce] == [(0, 1.0, 0.25), (1, 1.0, 0.25)]
    assert [(b.stage, b.start_s, b.duration_s) for b in steps] == [(0, 1.25, 0.0), (1, 1.25, 0.0)]
    assert timeline.step_time_s == pytest.approx(1.25)

    plan = replace(plan, stages=plan.stages[:2], prediction=replace(plan.prediction, reduce_s=0.25),
                   replicas=[ReplicaPlan([0], 2, 0), ReplicaPlan([1], 2, 2)])
    fig = schedule_figure(plan, timeline)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.texts].count("STEP 0 s") == 2
    markers = _boxes(ax, STEP_COLOUR)
    assert len(markers) == 2 and all(m[1] == pytest.approx(1.25) for m in markers)
    assert "sum gradients across replicas" in [t.get_text() for t in ax.get_legend().get_texts()]
    plt.close(fig)


def test_memory_axes_start_at_zero_and_show_capacity(plan):
    """A 2% swing must look like 2%: the axis runs from 0 past the capacity, which is drawn as a line."""
    assert memory_axis_limits([(0.0, 20.0), (1.0, 20.4)], 24.0) == (0.0, pytest.approx(24.0 * 1.08))
    low, high = memory_axis_limits([(0.0, 20.0), (1.0, 30.0)], 24.0)  # over capacity: the peak still shows
    assert low == 0.0 and high >= 30.0
    timeline = simulate_plan(plan)
    memory = memory_over_time(plan, timeline)
    fig = simulation_figure(plan, timeline, memory)
    panels = fig.axes[1:]
    assert len(panels) == len(plan.stages)
    for ax, stage, points in zip(panels, plan.stages, memory, strict=True):
        assert ax.get_ylim()[0] == 0.0 and ax.get_ylim()[1] >= max(stage.memory.available_gb, *(g for _, g in points))
        flat = {round(line.get_ydata()[0], 9) for line in ax.lines if len(set(line.get_ydata())) == 1}
        assert round(stage.memory.available_gb, 9) in flat and round(0.9 * stage.memory.available_gb, 9) in flat
        assert f"{stage.memory.available_gb:.1f} GB usable" in ax.get_title(loc="left")
    gantt_text = [t.get_text() for t in fig.axes[0].texts]
    assert sum(t.startswith("STEP") for t in gantt_text) == len(plan.stages)
    plt.close(fig)
