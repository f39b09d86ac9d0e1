"""Interleaved 1F1B (planner/schedule/schedules.py interleaved_one_f_one_b): programs whose actions name a chunk of layers.

The simulator's result is compared with a separate evaluation written here: each action's end time as
the longest path through its device's program order, the send it waits for, and the link it shares,
with its own mapping of (device, chunk) to virtual stage. Both must agree on every shape and on random
stage and link times, and the uniform case must give the textbook step m (f + b) + (p - 1)(f + b) / v.
"""

from __future__ import annotations

import json
import random
from functools import cache
from pathlib import Path

import pytest

from hetero.errors import ConfigError, PlanError, WireError
from hetero.plan import Plan
from hetero.planner.schedule.schedules import interleaved_one_f_one_b, interleaved_warmup
from hetero.planner.schedule.simulator import ScheduleError, simulate
from hetero.program import Action, format_program, parse_program

SHAPES = [(p, v, m) for p in range(1, 6) for v in range(1, 5) for m in (p, 2 * p, 3 * p, 4 * p)]


def longest_paths(programs: list[list[Action]], fwd_s: list[float], bwd_s: list[float],
                  send_s: list[float]) -> float:
    """The step time of these programs by longest paths (no overheads, no sync): an action ends at
    max(its device's previous action, what it waits for) plus its own time; a send's tensor arrives when
    its link (one per ordered device pair, taken in the sender's program order) has carried it."""
    p = len(programs)
    index = {(k, i): a for k, prog in enumerate(programs) for i, a in enumerate(prog)}
    sends: dict[tuple[str, int, int], tuple[int, int]] = {}  # (kind, virtual receiver, mb) -> (device, index)
    link_prev: dict[tuple[int, int], tuple[int, int] | None] = {}
    previous_on_link: dict[tuple[int, int], tuple[int, int]] = {}
    for k, prog in enumerate(programs):
        for i, a in enumerate(prog):
            if a.op in ("SA", "SG"):
                stage = a.chunk * p + k + (1 if a.op == "SA" else -1)
                sends[("act" if a.op == "SA" else "grad", stage, a.mb)] = (k, i)
                link = (k, stage % p)
                link_prev[(k, i)] = previous_on_link.get(link)
                previous_on_link[link] = (k, i)

    @cache
    def end(k: int, i: int) -> float:
        a = index[(k, i)]
        before = end(k, i - 1) if i else 0.0
        stage = a.chunk * p + k
        if a.op in ("RA", "RG"):
            return max(before, arrival(*sends[("act" if a.op == "RA" else "grad", stage, a.mb)]))
        if a.op == "F":
            return before + fwd_s[stage]
        if a.op == "B":
            return before + bwd_s[stage]
        return before  # SA, SG (the device only queues it), STEP (its barrier: see below)

    @cache
    def arrival(k: int, i: int) -> float:
        a = index[(k, i)]
        stage = a.chunk * p + k
        prev = link_prev[(k, i)]
        start = max(end(k, i), arrival(*prev) if prev else 0.0)
        return start + send_s[stage if a.op == "SA" else stage - 1]

    return max(end(k, len(prog) - 1) for k, prog in enumerate(programs))


@pytest.mark.parametrize(("p", "v", "m"), SHAPES)
def test_every_shape_runs_every_unit_once_and_takes_the_textbook_step(p: int, v: int, m: int) -> None:
    programs = interleaved_one_f_one_b(p, m, v)
    f, b = 1.0, 2.0
    n = p * v
    tl = simulate(programs, [f / v] * n, [b / v] * n, [0.0] * n)
    assert tl.step_time_s == pytest.approx(m * (f + b) + (p - 1) * (f + b) / v)
    for k, prog in enumerate(programs):
        units = sorted((a.op.value, a.mb, a.chunk) for a in prog if a.op in ("F", "B"))
        assert units == sorted((op, mb, c) for op in "FB" for mb in range(m) for c in range(v)), (p, v, m, k)
        # What a device holds at its peak: its warm-up forwards and the one of its first steady pair.
        assert tl.peak_in_flight[k] == min(interleaved_warmup(k, p, m, v) + 1, m * v)
        assert prog[-1] == Action("STEP")
    # Virtual stage 0 (device 0, chunk 0) reads the batch and the last (device p-1, chunk v-1) takes the loss.
    assert not any(a.op in ("RA", "SG") and a.chunk == 0 for a in programs[0])
    assert not any(a.op in ("SA", "RG") and a.chunk == v - 1 for a in programs[-1])
    assert [parse_program(format_program(prog)) for prog in programs] == programs


def torch_order(p: int, m: int, v: int) -> list[list[tuple[str, int, int]]] | None:
    """Each rank's (F or B, micro-batch, chunk) order under torch.distributed.pipelining's ScheduleInterleaved1F1B
    (its order alone, computed without a process group); None where this torch lays it out elsewhere."""
    import types

    from torch.distributed.pipelining import schedules

    single_rank = getattr(schedules.ScheduleInterleaved1F1B, "_calculate_single_rank_operations", None)
    if single_rank is None:
        return None
    order = []
    for rank in range(p):
        rounds = max(1, m // p)
        me = types.SimpleNamespace(n_local_stages=v, microbatches_per_round=m // rounds, pp_group_size=p,
                                   _n_microbatches=m)
        order.append([("F" if a.computation_type.name == "FORWARD" else "B", a.microbatch_index, a.stage_index // p)
                      for a in single_rank(me, rank) if a is not None])
    return order


def test_the_order_is_torchs_interleaved_1f1b() -> None:
    """The compute order of every device is what torch.distributed.pipelining runs (an independent generator)."""
    for p, v, m in SHAPES:
        want = torch_order(p, m, v)
        if want is None:
            pytest.skip("this torch's ScheduleInterleaved1F1B has no _calculate_single_rank_operations")
        got = [[(a.op.value, a.mb, a.chunk) for a in prog if a.op in ("F", "B")]
               for prog in interleaved_one_f_one_b(p, m, v)]
        assert got == want, (p, v, m)


def test_random_times_agree_with_longest_paths() -> None:
    rng = random.Random(7)
    for _ in range(150):
        p, v = rng.randint(1, 5), rng.randint(1, 4)
        m = p * rng.randint(1, 4)
        n = p * v
        f = [rng.uniform(0.05, 2.0) for _ in range(n)]
        b = [x * rng.uniform(1.0, 3.0) for x in f]
        c = [rng.choice([0.0, rng.uniform(0.0, 1.5)]) for _ in range(n - 1)] + [0.0]
        programs = interleaved_one_f_one_b(p, m, v)
        got = simulate(programs, f, b, c).step_time_s
        assert got == pytest.approx(longest_paths(programs, f, b, c), rel=1e-12), (p, v, m)
        # No device finishes before its own work, nor the step before one micro-batch's trip down and back.
        assert got >= max(sum(f[j] + b[j] for j in range(k, n, p)) for k in range(p)) * m - 1e-9
        assert got >= sum(f) + sum(b) + 2 * sum(c) - 1e-9


def test_one_link_carries_one_tensor_at_a_time_each_way() -> None:
    """Two devices, two chunks: device 1 -> 0 carries the gradients of hand-off 0 -> 1 and the activations
    of the wrap 1 -> 0@1; with slow links they queue behind each other (longest_paths says by how much)."""
    programs = interleaved_one_f_one_b(2, 4, 2)
    f, b, c = [0.1] * 4, [0.2] * 4, [1.0, 1.0, 1.0, 0.0]
    tl = simulate(programs, f, b, c)
    assert tl.step_time_s == pytest.approx(longest_paths(programs, f, b, c))
    on_link = sorted((e.start_s, e.end_s) for e in tl.events if e.stage == 1 and e.op in ("SA", "SG"))
    assert all(b0 >= a1 - 1e-12 for (_, a1), (b0, _) in zip(on_link, on_link[1:], strict=False))
    # Interleaving pays its extra hand-offs: on these slow links plain 1F1B of the same layers is faster.
    from hetero.planner.schedule.schedules import one_f_one_b

    plain = simulate(one_f_one_b(2, 4), [0.2, 0.2], [0.4, 0.4], [1.0, 0.0])
    assert plain.step_time_s < tl.step_time_s


def test_interleaving_shrinks_the_bubble_on_fast_links() -> None:
    from hetero.planner.schedule.schedules import one_f_one_b

    plain = simulate(one_f_one_b(4, 8), [1.0] * 4, [2.0] * 4, [0.0] * 4)
    two = simulate(interleaved_one_f_one_b(4, 8, 2), [0.5] * 8, [1.0] * 8, [0.0] * 8)
    assert two.bubble_fraction < plain.bubble_fraction and two.step_time_s == pytest.approx(28.5)
    assert plain.step_time_s == pytest.approx(33.0)


def test_micro_batches_must_come_in_groups_of_the_devices() -> None:
    with pytest.raises(ConfigError, match="not a multiple of 4"):
        interleaved_one_f_one_b(4, 6, 2)
    with pytest.raises(ConfigError, match="at least 1 chunk"):
        interleaved_one_f_one_b(2, 4, 0)


def test_programs_whose_chunks_disagree_are_refused() -> None:
    programs = interleaved_one_f_one_b(2, 2, 2)
    programs[1] = [a for a in programs[1] if a.chunk == 0 or a.op == "STEP"]
    with pytest.raises(ScheduleError, match="stage 1 runs chunks \\[0\\], but another runs 2"):
        simulate(programs, [1.0] * 4, [1.0] * 4, [0.0] * 4)
    good = interleaved_one_f_one_b(2, 2, 2)
    with pytest.raises(ScheduleError, match="2 programs of 2 chunks need 4 fwd/bwd times"):
        simulate(good, [1.0] * 2, [1.0] * 2, [0.0] * 2)
    # A receive moved before the send it waits for can happen is a deadlock, named by device and chunk.
    bad = interleaved_one_f_one_b(2, 2, 2)
    first = next(i for i, a in enumerate(bad[0]) if a.op == "RA")
    bad[0].insert(0, bad[0].pop(first))
    bad[1].insert(0, bad[1].pop(next(i for i, a in enumerate(bad[1]) if a.op == "RG")))
    with pytest.raises(ScheduleError, match="deadlock: stage 0 waits at RA0@1; stage 1 waits at RG0"):
        simulate(bad, [1.0] * 4, [1.0] * 4, [0.0] * 4)


def test_a_plan_whose_program_names_chunks_its_stage_lacks_is_refused(tmp_path: Path) -> None:
    """A program naming a chunk of layers the stage does not hold (plan.json edited) is refused in one line."""
    from fleets import _plan, make_cluster, make_graph

    cluster = make_cluster([("a", "rtx4090", None), ("b", "rtx3090", 6.0)])
    p = _plan(cluster, make_graph(4, rng=random.Random(1)), replicas=1)
    p.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    assert "chunks" not in data["stages"][0]  # one chunk per device: plan.json as before interleaved schedules
    data["stages"][0]["program"] = [t.replace("F0", "F0@1") for t in data["stages"][0]["program"]]
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"stages\[0\]\.program names chunk 1, but the stage holds 1") as exc:
        Plan.load(tmp_path / "plan.json")
    assert "\n" not in str(exc.value)


# --- the planner's choice (planner/search/interleave.py) ------------------------------------------------------------------


def _planned(fleet: list, mode: str, m: int = 4, layers: int = 12, seed: int = 3, gbps: float = 10.0,
             recomputable: bool = False, **opts: object) -> Plan:
    from fleets import _plan, make_cluster, make_graph

    opts.setdefault("replicas", 1)
    return _plan(make_cluster(fleet, gbps), make_graph(layers, rng=random.Random(seed), recompute=recomputable), m=m,
                 interleave=mode, **opts)


ONE_HOST = [("a", "rtx4090", None), ("a", "rtx3090", None)]
TWO_HOSTS = [("a", "rtx3090", None), ("b", "rtx3090", None)]


def test_the_planner_interleaves_inside_a_host_where_it_simulates_faster(tmp_path: Path) -> None:
    from hetero.planner.schedule.simulator import simulate_plan
    from hetero.planner.search.interleave import GAIN

    plain, auto = _planned(ONE_HOST, "off"), _planned(ONE_HOST, "auto")
    assert all(len(s.chunks) == 1 for s in auto.stages) and not any(s.chunks for s in plain.stages)
    assert [s.device for s in auto.stages] == [s.device for s in plain.stages]
    assert auto.prediction.step_time_s <= plain.prediction.step_time_s * (1 - GAIN)
    # The prediction is the stored programs simulated with the stored per-chunk times.
    assert simulate_plan(auto).step_time_s == pytest.approx(auto.prediction.step_time_s, rel=1e-9)
    said = [v for v in auto.verdict if v.startswith("Interleaved:")]
    assert said and f"{plain.prediction.step_time_s:.3g} s for one chunk per device" in said[0], auto.verdict
    auto.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").stages == auto.stages


def test_a_slow_link_is_not_interleaved_and_the_plan_says_why() -> None:
    # Two hosts 0.5 Gbit/s apart: interleaving would send twice the hand-offs over that link.
    plain = _planned(TWO_HOSTS, "off", num_stages=2, gbps=0.5)
    auto = _planned(TWO_HOSTS, "auto", num_stages=2, gbps=0.5)
    forced = _planned(TWO_HOSTS, "always", num_stages=2, gbps=0.5)
    assert not any(s.chunks for s in auto.stages) and all(s.chunks for s in forced.stages)
    assert auto.prediction.step_time_s == plain.prediction.step_time_s < forced.prediction.step_time_s
    assert any(v.startswith("Not interleaved:") and "twice the hand-offs" in v for v in auto.verdict), auto.verdict


def test_auto_never_plans_a_slower_step_than_one_chunk_per_device() -> None:
    fleets = [ONE_HOST, TWO_HOSTS, [("a", "rtx4090", None), ("a", "rtx3090", None), ("a", "rtx3090", None)],
              [("a", "rtx3090", None), ("a", "v100", None), ("b", "rtx4090", None)]]
    chosen = 0
    for fleet in fleets:
        for m, seed in ((6, 1), (12, 2)):
            off, auto = _planned(fleet, "off", m=m, seed=seed), _planned(fleet, "auto", m=m, seed=seed)
            assert auto.prediction.step_time_s <= off.prediction.step_time_s, (fleet, m)
            chosen += any(s.chunks for s in auto.stages)
    assert chosen >= 2, "the fleets should include some where interleaving wins"


def test_what_cannot_interleave_is_said_and_always_refuses_it() -> None:
    auto = _planned([*ONE_HOST, ("a", "rtx3090", None)], "auto", m=4, num_stages=3)
    assert any("not a multiple of 3" in v for v in auto.verdict), auto.verdict
    with pytest.raises(ConfigError, match="planner.interleave=always, but this pipeline cannot interleave"):
        _planned([*ONE_HOST, ("a", "rtx3090", None)], "always", m=4, num_stages=3)


@pytest.mark.parametrize(("fleet", "m", "layers"), [
    ([("a", "rtx4090", None), *[("a", "rtx3090", None)] * 3], 8, 16),
    ([("a", "rtx4090", None), ("a", "rtx3090", None), ("b", "v100", None), ("b", "rtx3090", None)], 4, 24)])
def test_replicas_are_weighed_against_the_interleaved_pipeline(fleet: list, m: int, layers: int) -> None:
    """The replica search weighs its replicas against the best one pipeline, interleaved where that simulates
    faster: on these fleets replicas beat one chunk per device but not the interleaved pipeline, which is planned
    (before, replicas were chosen first and never interleaved: 3.60 s against 3.31 s on the first)."""
    both = _planned(fleet, "auto", m=m, layers=layers, replicas=None)
    replicated = _planned(fleet, "off", m=m, layers=layers, replicas=None)
    interleaved = _planned(fleet, "auto", m=m, layers=layers)
    assert len(replicated.replicas) >= 2 and all(s.chunks for s in interleaved.stages)
    assert both.prediction.step_time_s == pytest.approx(interleaved.prediction.step_time_s, rel=1e-9)
    assert both.prediction.step_time_s < replicated.prediction.step_time_s
    assert not both.replicas and all(s.chunks for s in both.stages)
    assert any(v.startswith("Interleaved:") for v in both.verdict), both.verdict


def test_always_interleaves_one_pipeline_and_refuses_forced_replicas() -> None:
    """Under always the replica search is not run (replicas do not interleave yet), and asking for both is one line."""
    fleet = [("a", "rtx4090", None), *[("a", "rtx3090", None)] * 3]
    assert len(_planned(fleet, "off", m=4, layers=16, replicas=None).replicas) >= 2  # replicas win here, plainly
    forced = _planned(fleet, "always", m=4, layers=16, replicas=None)
    assert not forced.replicas and all(s.chunks for s in forced.stages)
    from hetero import config as config_mod

    with pytest.raises(ConfigError, match=r"planner.interleave=always and planner.replicas=2: interleaved chunks do "
                                          r"not form replicas yet") as exc:
        config_mod.load(["model=llama8b", "planner.interleave=always", "planner.replicas=2"])
    assert "\n" not in str(exc.value)
    assert config_mod.load(["model=llama8b", "planner.interleave=always", "planner.replicas=1"]).planner.replicas == 1


def test_a_schedule_without_a_chunked_form_is_not_interleaved() -> None:
    """GPipe's step form names no chunked form: auto plans GPipe's own programs (before the step form owned it, a
    GPipe plan could be given interleaved 1F1B programs under its GPipe name), and always refuses in one line."""
    auto = _planned(ONE_HOST, "auto", schedule="gpipe")
    assert not any(s.chunks for s in auto.stages)
    assert all(s.program[:2] == ["RA0", "F0"] or s.program[0] == "F0" for s in auto.stages), auto.stages[0].program
    forwards = [[t for t in s.program if t.startswith("F")] for s in auto.stages]
    assert all(f == [f"F{i}" for i in range(4)] for f in forwards)  # GPipe: every forward before the backwards
    assert not any("nterleav" in v for v in auto.verdict), auto.verdict
    with pytest.raises(ConfigError, match=r"train.schedule=gpipe has no interleaved form") as exc:
        _planned(ONE_HOST, "always", schedule="gpipe")
    assert "\n" not in str(exc.value)


def test_a_chunked_form_of_three_chunks_plans_through_the_step_form_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunked form is the one place the planner reads about chunks: given 3 chunks per device (nothing else
    changed), the plan holds 3 chunks on each device in virtual-stage order, its programs are the form's, and the
    prediction is those programs simulated on the plan's per-chunk times."""
    from dataclasses import replace

    from hetero.planner.schedule import step_form
    from hetero.planner.schedule.simulator import simulate_plan

    three = replace(step_form.INTERLEAVED, chunks=3)
    monkeypatch.setitem(step_form.FORMS, "1f1b", replace(step_form.FORMS["1f1b"], chunked=three))
    planned = _planned(ONE_HOST, "always", layers=24)
    p = len(planned.stages)
    assert [len(s.spans()) for s in planned.stages] == [3] * p
    spans = sorted((three.virtual_stage(k, c, p), span) for k, s in enumerate(planned.stages)
                   for c, span in enumerate(s.spans()))
    assert spans[0][1][0] == 0 and spans[-1][1][1] == len(planned.graph.nodes) - 1
    assert all(b[0] == a[1] + 1 for (_, a), (_, b) in zip(spans, spans[1:], strict=False))  # they tile the graph
    programs = three.programs(p, 4)
    assert [s.program for s in planned.stages] == [format_program(prog) for prog in programs]
    assert simulate_plan(planned).step_time_s == pytest.approx(planned.prediction.step_time_s, rel=1e-9)
    assert any(v.startswith("Interleaved: interleaved 1F1B (3 chunks per device") for v in planned.verdict)


def test_the_chunking_search_is_near_the_best_chunking_by_brute_force() -> None:
    """Every way to cut a small graph into 2 devices x 2 chunks, simulated: the local search from even halves
    finds a step within 5 % of the best of them (and, being one of them, never better)."""
    import itertools

    from fleets import make_cluster, make_graph, table_for

    from hetero.planner.model.objective import Placement, evaluate
    from hetero.planner.search.interleave import best_candidate, chunk_spans, price

    for seed in range(4):
        graph = make_graph(6, rng=random.Random(seed))
        plain = _planned(ONE_HOST, "off", layers=6, seed=seed)
        table, _, _ = table_for(graph, make_cluster(ONE_HOST), m=4, quantization="nf4")
        names = [d.name for d in table.devices]
        ev = evaluate(table, Placement(tuple(names.index(s.device) for s in plain.stages),
                                       tuple((s.first_node, s.last_node) for s in plain.stages)))
        n = len(graph.nodes)
        steps = []
        for cuts in itertools.combinations(range(1, n), 3):
            flat = [b - a for a, b in zip((0, *cuts), (*cuts, n), strict=True)]
            cand = price(table, ev, chunk_spans([flat[0::2], flat[1::2]]))
            if not cand.reasons:
                steps.append(cand.timeline.step_time_s)
        found = best_candidate(table, graph, ev, plain.stages).timeline.step_time_s
        assert min(steps) - 1e-12 <= found <= min(steps) * 1.05, (seed, found, min(steps))


def test_a_pipeline_that_recomputes_interleaves_with_its_chunks_recomputing(tmp_path: Path) -> None:
    """Memory binds (90 % headroom kept back): one chunk per device recomputes 8 layers on the first device. The
    interleaved pipeline holds more micro-batches on its first device, so its chunks recompute too, each its
    fewest that fit; it simulates faster and is planned, its memory fits, and the plan round-trips."""
    from hetero.planner.schedule.simulator import simulate_plan

    off = _planned(ONE_HOST, "off", recomputable=True, memory_headroom=0.88)
    auto = _planned(ONE_HOST, "auto", recomputable=True, memory_headroom=0.88)
    assert any(s.recompute_layers for s in off.stages)
    assert all(len(s.chunks) == 1 for s in auto.stages), auto.verdict
    assert any(s.recompute_layers or s.chunks[0].recompute_layers for s in auto.stages)
    assert auto.prediction.step_time_s < off.prediction.step_time_s
    assert simulate_plan(auto).step_time_s == pytest.approx(auto.prediction.step_time_s, rel=1e-9)
    for s in auto.stages:
        assert s.memory.total_gb <= s.memory.available_gb
        # A device's first chunk says the seconds its backward re-runs forwards (inside bwd_time_s), as price() did.
        assert (s.recompute_time_s > 0) == bool(s.recompute_layers) and s.recompute_time_s < s.bwd_time_s
        for names, nodes in ((s.recompute_layers, s.node_names), *((c.recompute_layers, c.node_names) for c in s.chunks)):
            decoders = [n for n in nodes if n.startswith("layers.")]
            assert names == decoders[:len(names)]  # a chunk's first recomputable layers
    auto.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").stages == auto.stages


def test_each_device_recomputes_the_fewest_chunk_layers_that_fit_by_brute_force() -> None:
    """planner/search/interleave.py chunk_recompute against every (r0, r1) of a device's two chunks: the least added
    seconds among those that fit, and the activation bytes walked over the program independently."""
    import itertools

    from fleets import make_cluster, make_graph, table_for

    from hetero.planner.model.objective import recompute_time_s, stage_activations, stage_fits
    from hetero.planner.search.interleave import chunk_recompute, peak_activations

    rng = random.Random(5)
    graph = make_graph(10, rng=rng, recompute=True)
    programs = interleaved_one_f_one_b(2, 4, 2)
    checked = recomputed = 0
    for headroom in (0.5, 0.8, 0.85, 0.88, 0.9, 0.93):
        table, _, _ = table_for(graph, make_cluster(ONE_HOST), m=4, quantization="nf4", headroom=headroom)
        for _ in range(6):
            cuts = sorted(rng.sample(range(1, len(graph.nodes)), 3))
            bounds = list(zip((0, *cuts), (*cuts, len(graph.nodes)), strict=True))
            for d in range(2):
                spans = [(a, b - 1) for a, b in bounds[d::2]]
                weights = sum(table.weights[i][d] for a, b in spans for i in range(a, b + 1))
                lora = sum(table.lora[i][d] for a, b in spans for i in range(a, b + 1))
                best = None
                for rs in itertools.product(*(table.recompute_choices(a, b) for a, b in spans)):
                    working = max([max(table.activations_per_mb[i][d] for i in range(a, b + 1) if table.recomputable[i])
                                   for (a, b), r in zip(spans, rs, strict=True) if r > 0], default=0.0)
                    units = [stage_activations(table, d, a, b, 1, r, working) - (working if r > 0 else 0.0)
                             for (a, b), r in zip(spans, rs, strict=True)]
                    acts = peak_activations(programs[d], units) + working
                    added = sum(recompute_time_s(table, d, a, b, r) for (a, b), r in zip(spans, rs, strict=True))
                    if stage_fits(table, d, weights, lora, acts) and (best is None or added < best[0] - 1e-15):
                        best = (added, acts)
                fit = chunk_recompute(table, d, spans, programs[d])
                checked += 1
                assert fit.fits == (best is not None), (headroom, spans)
                if best is not None:
                    added = sum(recompute_time_s(table, d, a, b, r) for (a, b), r in zip(spans, fit.recompute, strict=True))
                    assert added == pytest.approx(best[0], rel=1e-12, abs=1e-15) and fit.acts <= table.usable_bytes[d]
                    recomputed += any(fit.recompute)
    assert checked and recomputed, "the headrooms should include devices that must recompute"


def test_the_torch_engine_refuses_an_interleaved_plan_in_one_line() -> None:
    from hetero.runtime.torch_engine.support import EngineUnsupportedError, check_supported

    with pytest.raises(EngineUnsupportedError, match=r"devices hold chunks of layers \(planner.interleave\)") as exc:
        check_supported(_planned(ONE_HOST, "always"), None)
    assert "\n" not in str(exc.value)


def test_an_interleaved_plans_readers_count_every_chunk() -> None:
    """What reads a plan after it is made takes every chunk: the state copy's bytes, the replay of a run that took
    the predicted times, the memory curve, the stage manifest, and the wire rules' chunk bound."""
    from hetero.compiler.emit import stage_manifest
    from hetero.planner.replan.whatif import memory_over_time
    from hetero.planner.schedule.simulator import replay_run, simulate_plan
    from hetero.runtime.wire.frames import Message
    from hetero.runtime.wire.rules import stage_rules

    plain, plan = _planned(ONE_HOST, "off"), _planned(ONE_HOST, "always")
    assert plan.prediction.state_copy_bytes == pytest.approx(plain.prediction.state_copy_bytes)
    m = plan.train.num_micro_batches
    timings = []
    for s in plan.stages:
        ops = [a.op.value for a in s.actions()]
        timings.append({"F": m * (s.fwd_time_s + sum(c.fwd_time_s for c in s.chunks)),
                        "B": m * (s.bwd_time_s + sum(c.bwd_time_s for c in s.chunks)),
                        **{op: ops.count(op) * s.overhead_s.get(op, 0.0) for op in ("SA", "SG")},
                        "STEP": s.overhead_s.get("STEP", 0.0) + 0.5, "clip_wait": 0.5, "RA": 3.0, "RG": 3.0})
    # Chunks of unequal predicted times get the device's measured seconds in those proportions: here, their own.
    assert replay_run(plan, timings).step_time_s == pytest.approx(plan.prediction.step_time_s, rel=1e-9)
    timeline = simulate_plan(plan)
    for s, points in zip(plan.stages, memory_over_time(plan, timeline), strict=True):
        assert max(gb for _, gb in points) == pytest.approx(s.memory.total_gb, rel=1e-9)
    last = stage_manifest(plan, len(plan.stages) - 1)
    assert last["computes_loss"] and last["next"]["stage"] == 0 and len(last["chunks"]) == 1
    assert stage_manifest(plan, 0)["prev"]["stage"] == len(plan.stages) - 1
    assert len(last["nodes"]) == len(plan.stages[-1].nodes())
    rules = stage_rules(plan, 1)
    assert rules.chunks == 2
    with pytest.raises(WireError, match="chunk 2, but stage1 holds 2"):
        rules.check(Message("act", "stage0", step=0, mb=0, meta={"chunk": 2}), [])


def test_an_interleaved_plans_more_micro_batches_what_if_prices_each_chunk_as_the_planner_does() -> None:
    """`hetero simulate`'s "num_micro_batches=4" for an interleaved plan of 2: each device's memory is what the
    planner prices for the same chunks, with the same recomputing layers, at 4 micro-batches (planner/search/interleave.py
    price on a table for 4, where the first device holds more than at 2), not a scaled estimate; the memory curve
    walked over the new programs' events peaks there too."""
    from dataclasses import replace

    from fleets import make_model

    from hetero.planner.model.cost import build_cost_table
    from hetero.planner.model.cost_model import RooflineCostModel
    from hetero.planner.model.objective import Placement, evaluate
    from hetero.planner.replan.whatif import memory_over_time, more_micro_batches
    from hetero.planner.schedule.schedules import interleaved_one_f_one_b
    from hetero.planner.schedule.simulator import simulate_plan, virtual_times
    from hetero.planner.search.interleave import price

    plain = _planned(ONE_HOST, "always", m=2, split=[6, 6])
    tight = _planned(ONE_HOST, "always", m=2, split=[6, 6], recomputable=True, memory_headroom=0.88)
    assert tight.stages[0].recompute_layers and tight.stages[0].memory.working_gb > 0
    for plan in (plain, tight):
        assert all(len(s.memory.chunk_gb_per_mb) == 2 for s in plan.stages)
        for s, points in zip(plan.stages, memory_over_time(plan, simulate_plan(plan)), strict=True):
            assert max(gb for _, gb in points) == pytest.approx(s.memory.total_gb, rel=1e-9)  # its own peak
        four = more_micro_batches(plan, (2,))[0]
        table = build_cost_table(plan.graph, make_model("nf4"), plan.cluster, replace(plan.train, num_micro_batches=4),
                                 plan.planner, RooflineCostModel())
        names = [d.name for d in table.devices]
        n = len(plan.graph.nodes)  # price() reads the placement's devices only; its chunks are the plan's spans
        ev = evaluate(table, Placement(tuple(names.index(s.device) for s in plan.stages),
                                       ((0, n // 2 - 1), (n // 2, n - 1))))
        priced = price(table, ev, [s.spans() for s in plan.stages])
        assert priced.recompute == [[len(s.recompute_layers), *(len(c.recompute_layers) for c in s.chunks)]
                                    for s in plan.stages]  # the same recomputing layers at 4
        assert four.peak_memory_gb == pytest.approx([m.total_gb for m in priced.memory], rel=1e-9)
        assert four.peak_memory_gb[0] > plan.stages[0].memory.total_gb  # the first device holds more at 4
        fwd, bwd, send = virtual_times(plan.stages)
        timeline = simulate(interleaved_one_f_one_b(len(plan.stages), 4, 2), fwd, bwd, send)
        walked = [max(gb for _, gb in points) for points in memory_over_time(plan, timeline)]
        assert four.peak_memory_gb == pytest.approx(walked, rel=1e-9)


def test_the_issue_caveat_counts_every_chunk_of_a_device() -> None:
    """planner/explain/caveats.py prices a device's decoder layer over all its chunks: a device whose second chunk holds the
    slow layers is not called issue-bound for its fast first chunk alone."""
    from dataclasses import replace

    from hetero.planner.explain.caveats import ISSUE_FLOOR_S, issue_bound_lines
    from hetero.planner.model.cost_model import RooflineCostModel

    plan = _planned(ONE_HOST, "always", split=[6, 6])
    s = plan.stages[0]
    assert s.chunks
    layers = sum(1 for n in s.node_names + [n for c in s.chunks for n in c.node_names] if n.startswith("layers."))
    fast = replace(s, fwd_time_s=ISSUE_FLOOR_S / 1000, bwd_time_s=ISSUE_FLOOR_S / 1000,
                   chunks=[replace(c, fwd_time_s=ISSUE_FLOOR_S * layers, bwd_time_s=0.0) for c in s.chunks])
    assert issue_bound_lines([fast], RooflineCostModel()) == []  # the chunks together: above the floor
    tiny = replace(fast, chunks=[replace(c, fwd_time_s=ISSUE_FLOOR_S / 1000, bwd_time_s=0.0) for c in s.chunks])
    (line,) = issue_bound_lines([tiny], RooflineCostModel())
    assert f"at {tiny.compute_s() / layers * 1e3:.2g} ms per micro-batch" in line
