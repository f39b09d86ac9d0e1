"""Weight streaming from host RAM (planner.offload): the solvers against exhaustive search, the modes, host RAM.

The brute force (planner/search/bruteforce.py) tries every per-stage (recompute, stream) pair explicitly; the exact
DP (planner.search.solve) and the ILP (layered and flat) must reach its optimum under 1F1B, where the pair of least
added time that fits is provably the best per stage (planner/search/exact.py's docstring).
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter

import pytest
from cli_calls import assert_one_line_error, compile_plan, run_main
from fleets import make_cluster, make_graph, table_for
from tables import random_table

from hetero.planner.model.cost import CostTable
from hetero.planner.model.objective import Placement, evaluate, ram_may_bind
from hetero.planner.search.bruteforce import brute_force
from hetero.planner.search.ilp import solve_ilp
from hetero.planner.search.solve import solve


def with_streaming(table: CostTable, rng: random.Random, mode: str = "auto", ram: float = 1e12) -> CostTable:
    """``table`` whose middle layers may stream: a share of their weights, a share of their forward per copy;
    devices stream by host (so a class of identical devices streams alike)."""
    n, nd = table.num_nodes, table.num_devices
    streamable = [0 < i < n - 1 and rng.random() < 0.8 for i in range(n)]
    share = [rng.uniform(0.6, 0.95) for _ in range(n)]
    copy = [rng.uniform(0.0, 0.4) for _ in range(n)]
    hosts = max(table.host_of) + 1
    host_can = [rng.random() < 0.85 for _ in range(hosts)]
    can = [host_can[table.host_of[d]] for d in range(nd)]
    nbytes = [[table.weights[i][d] * share[i] if streamable[i] and can[d] else 0.0 for d in range(nd)]
              for i in range(n)]
    fetch = [[table.fwd_s[i][d] * copy[i] if nbytes[i][d] else 0.0 for d in range(nd)] for i in range(n)]
    start = [max([table.fwd_s[i][d] * 0.1 for i in range(n) if nbytes[i][d]], default=0.0) for d in range(nd)]
    # A buffer slot smaller than the largest layer (arrays only: the solvers need not know why), so that
    # streaming two or three of these few layers already saves memory.
    slot = rng.uniform(0.2, 1.0)
    buffer = [slot * max([nbytes[i][d] for i in range(n)], default=0.0) for d in range(nd)]
    return dataclasses.replace(table, stream_bytes=nbytes, stream_fetch_s=fetch, stream_start_s=start,
                               stream_buffer=buffer, can_stream=can, streamable=streamable, stream_mode=mode,
                               host_ram_bytes=[ram] * hosts, _prefix={}, _classes=[], _stream_prefix={})


def check(table: CostTable, forced: int | None, stats: Counter) -> None:
    """The DP and both ILPs reach the brute force's optimum; evaluate by itself picks the same pairs."""
    best = brute_force(table, forced)
    result = solve(table, forced, time_limit_s=60)
    if best is None:
        assert result.evaluation is None
        stats["infeasible"] += 1
        return
    ev = result.evaluation
    assert ev is not None and ev.feasible and result.report.proven_optimal, result.report
    assert ev.step_time_s == pytest.approx(best.step_time_s, rel=1e-9)
    again = evaluate(table, Placement(ev.placement.devices, ev.placement.spans))
    assert (again.recompute, again.stream) == (ev.recompute, ev.stream)
    for layered in (True, False):
        ilp = solve_ilp(table, forced, time_limit_s=30, layered=layered)
        assert ilp.evaluation is not None and ilp.evaluation.step_time_s == pytest.approx(best.step_time_s, rel=1e-6)
    stats["stream"] += any(ev.stream)
    stats["both"] += any(r and s for r, s in zip(ev.recompute, ev.stream, strict=True))
    stats["stages>1"] += len(ev.placement.devices) > 1


@pytest.mark.parametrize("chunk", range(4))
def test_streaming_matches_brute_force_on_random_arrays(chunk: int) -> None:
    stats: Counter = Counter()
    for seed in range(5000 + chunk * 25, 5000 + (chunk + 1) * 25):
        rng = random.Random(seed)
        table = with_streaming(random_table(rng, max_devices=3, max_nodes=5, schedule="1f1b"), rng,
                               mode=rng.choice(["auto", "auto", "auto", "full", "none"]))
        forced = rng.choice([None, None, 1, 2])
        if forced and forced > min(table.num_nodes, table.num_devices):
            forced = None
        try:
            check(table, forced, stats)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}: {exc}") from exc
    assert stats["stream"] and stats["stages>1"] >= 5, stats


def test_modes_none_full_auto() -> None:
    # none never streams; full streams every streamable layer of every stage; auto only where memory needs it.
    stats: Counter = Counter()
    for seed in range(40):
        rng = random.Random(9000 + seed)
        base = random_table(rng, max_devices=2, max_nodes=5, schedule="1f1b")
        roomy = dataclasses.replace(base, usable_bytes=[1e9] * base.num_devices, _prefix={}, _classes=[])
        for mode in ("none", "full", "auto"):
            table = with_streaming(roomy, random.Random(seed), mode=mode)
            ev = solve(table, None, time_limit_s=30).evaluation
            assert ev is not None
            if mode == "full":
                for k, (d, (a, b)) in enumerate(zip(ev.placement.devices, ev.placement.spans, strict=True)):
                    assert ev.stream[k] == table.stream_choices(d, a, b)[-1]
                    stats["full"] += ev.stream[k] > 0
            else:
                assert not any(ev.stream)  # none: never; auto: memory is loose and streaming only costs time
    assert stats["full"]


def test_host_ram_is_checked() -> None:
    # Streaming that the host's RAM cannot hold makes a placement infeasible, with one line naming the host.
    rng = random.Random(4)
    table = with_streaming(random_table(rng, max_devices=1, max_nodes=5, schedule="1f1b"), rng, mode="full")
    d, last = 0, table.num_nodes - 1
    s = table.stream_choices(d, 0, last)[-1]
    tight = dataclasses.replace(table, host_ram_bytes=[0.5 * sum(r[0] for r in table.stream_bytes)] * len(
        table.host_ram_bytes), _prefix={}, _classes=[], _stream_prefix={})
    ev = evaluate(tight, Placement((d,), ((0, last),), (0,), (s,)))
    if s:
        assert not ev.feasible and any("streamed weights in RAM" in r for r in ev.reasons), ev.reasons


def test_graph_tables_stream_only_where_needed() -> None:
    # A real graph on two small cards with host RAM: without streaming nothing fits; with it the solvers
    # agree with the brute force, and the plan's streamed layers are the stages' last decoder layers.
    graph = make_graph(4, hidden=4096, rng=random.Random(3), recompute=True)
    cluster = make_cluster([("a", "rtx4090", 1.6), ("a", "rtx3090", 1.6)])
    cluster = dataclasses.replace(cluster, hosts=[dataclasses.replace(
        h, ram_gb=64.0, devices=[dataclasses.replace(d, host_link_gbs=31.5) for d in h.devices])
        for h in cluster.hosts])
    none, _, _ = table_for(graph, cluster, m=4, quantization="nf4")
    none = dataclasses.replace(none, stream_mode="none", _prefix={}, _classes=[], _stream_prefix={})
    auto = dataclasses.replace(none, stream_mode="auto", _prefix={}, _classes=[], _stream_prefix={})
    assert brute_force(none) is None
    stats: Counter = Counter()
    check(auto, None, stats)
    assert stats["stream"]


# Input hashes of plans compiled before weight streaming existed (commit df2a518): fleets without ram_gb
# keep them, and their placement, byte for byte (with the padded rows those plans ran: data.packing=false, and links
# priced without the CurveZMQ cipher, as they were: security=none).
BEFORE = {("model=tiny", "hardware=local"): "17b7560cf33d",
          ("model=llama8b", "hardware=homelab"): "9d5bbe18cdfc"}


@pytest.mark.parametrize("overrides", list(BEFORE))
def test_plans_without_ram_keep_hash_and_placement(tmp_path, capsys, overrides) -> None:  # type: ignore[no-untyped-def]
    code, _, err, plan = compile_plan(tmp_path, capsys, *overrides, "data.packing=false", "security=none")
    assert code == 0 and plan is not None, err
    assert plan.input_hash.startswith(BEFORE[overrides])
    assert not any(s.stream_layers or s.memory.host_gb or s.frozen_resident_cap_bytes for s in plan.stages)
    raw = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert all("host_link_gbs" not in d or d["host_link_gbs"] is None
               for h in raw["cluster"]["hosts"] for d in h["devices"])


@pytest.mark.parametrize("fleet", ["two_3090", "3090_4090"])
def test_llama70b_qlora_streams_on_two_24gb_cards(tmp_path, capsys, fleet) -> None:  # type: ignore[no-untyped-def]
    # The acceptance: without ram_gb this is refused (49.8 GB needed, 42.2 GB usable); with it, the last
    # decoder layers of each stage stream, and plan.json, `hetero show` and the picture say which and what it costs.
    code, _, err, plan = compile_plan(tmp_path, capsys, "model=llama70b", "model.quantization=nf4", f"hardware={fleet}")
    assert code == 0 and plan is not None, err
    assert plan.model.seq_len == 2048
    streaming = [s for s in plan.stages if s.stream_layers]
    assert streaming
    decoders = [n.name for n in plan.graph.nodes if n.kind == "decoder"]
    for s in plan.stages:
        assert s.memory.total_gb <= s.memory.available_gb + 1e-9
        own = [n for n in s.node_names if n in decoders]
        assert s.stream_layers == own[len(own) - len(s.stream_layers):]  # the stage's last decoder layers
    for s in streaming:
        assert s.stream_time_s > 0 and s.streamed_bytes_per_step > 0 and s.memory.host_gb > 0
        assert s.frozen_resident_cap_bytes == pytest.approx(s.memory.weights_gb * 1e9)
        per_mb = s.streamed_bytes_per_step / plan.train.num_micro_batches
        bytes_per_layer = s.memory.host_gb * 1e9 / len(s.stream_layers)
        # A forward and a backward copy per layer and micro-batch, less what the two-layer buffer still holds at
        # each turn between them (at most two layers at each of a micro-batch's two turns).
        layers = len(s.stream_layers)
        assert (2 * layers - 4) * bytes_per_layer <= per_mb + 1 <= 2 * layers * bytes_per_layer + 1
    for host in plan.cluster.hosts:
        assert sum(s.memory.host_gb for s in plan.stages if s.host == host.name) <= (host.ram_gb or 0)
    code, out, _ = run_main(["show", str(tmp_path / "out" / "plan.json")], capsys)
    assert code == 0 and "stream from host RAM" in out
    assert (tmp_path / "out" / "placement.png").stat().st_size > 0


def test_replicas_may_stream_too(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    # One RTX 3090 holds Llama-70B QLoRA by streaming every layer, so two replicas fit (one per card, 77 of the
    # box's 128 GB of RAM): the replica search's memory bound once said they did not, a false verdict.
    code, _, err, plan = compile_plan(tmp_path, capsys, "model=llama70b", "model.quantization=nf4",
                                      "hardware=two_3090", "planner.replicas=2")
    assert code == 0 and plan is not None, err
    assert [len(r.stages) for r in plan.replicas] == [1, 1]
    # All but one layer stream: the chunked loss head leaves each card room for one resident decoder layer.
    assert all(len(s.stream_layers) == 79 for s in plan.stages)
    assert sum(s.memory.host_gb for s in plan.stages) <= 128
    assert not any("do not fit" in line for line in plan.verdict)


def test_offload_none_refuses_with_one_line_counting_streaming(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    code, _, err, _ = compile_plan(tmp_path, capsys, "model=llama70b", "model.quantization=nf4", "hardware=two_3090",
                                   "planner.offload=none")
    assert code == 2 and "needs 49.8 GB with recomputation, the fleet has 42.2 GB usable" in err
    code, _, err, _ = compile_plan(tmp_path, capsys, "model=llama70b", "model.quantization=nf4", "hardware=two_3090",
                                   "model.seq_len=16384")
    assert_one_line_error(code, err, "llama70b (bfloat16, quantization nf4) needs")
    assert "with recomputation and streaming" in err and "streaming from host RAM" in err


def test_offload_full_needs_ram_gb(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    code, _, err, _ = compile_plan(tmp_path, capsys, "planner.offload=full")
    assert_one_line_error(code, err, "planner.offload=full: host 'localhost' has no ram_gb")


def test_fleet_keys_for_host_memory_and_links() -> None:
    # x1 risers are 1/16 of x16; ram_gb is validated like cores; a host without ram_gb keeps datasheet links out.
    from hetero.config import load
    from hetero.errors import ConfigError
    from hetero.hardware import build_cluster

    rig = load(["hardware=mining_rig"]).cluster
    x16 = load(["hardware=two_3090"]).cluster
    assert rig.devices[0].host_link_gbs == pytest.approx(15.75 / 16, rel=0.01)
    assert x16.devices[0].host_link_gbs == 31.5 and x16.hosts[0].ram_gb == 128
    assert load(["hardware=homelab"]).cluster.devices[0].host_link_gbs is None
    host = {"name": "h", "devices": [{"type": "rtx3090"}]}
    for bad, needle in (({"ram_gb": -1}, "ram_gb must be positive"), ({"ram_gb": "lots"}, "ram_gb must be a number")):
        with pytest.raises(ConfigError, match=needle):
            build_cluster({"hosts": [{**host, **bad}]})
    with pytest.raises(ConfigError, match="host_link_gbs or pcie, not both"):
        build_cluster({"hosts": [{"name": "h", "devices": [{"type": "rtx3090", "pcie": {"gen": 4}, "host_link_gbs": 9}]}]})
    pcie = build_cluster({"hosts": [{"name": "h", "ram_gb": 32, "devices": [{"type": "rtx3090", "pcie": {"gen": 4, "lanes": 8}}]}]})
    assert pcie.devices[0].host_link_gbs == pytest.approx(31.5 / 2, rel=0.01)


def needs_streaming(rng: random.Random) -> tuple[CostTable, float] | None:
    """A table that fits only by streaming (memory shrunk until it does), and the host RAM its optimum uses."""
    table = with_streaming(random_table(rng, max_devices=3, max_nodes=5, schedule="1f1b"), rng)
    for factor in (0.9, 0.8, 0.7, 0.6, 0.5, 0.4):
        tight = dataclasses.replace(table, usable_bytes=[u * factor for u in table.usable_bytes], _prefix={},
                                    _classes=[], _stream_prefix={})
        best = brute_force(tight)
        if best is None:
            return None
        if any(best.stream):
            return tight, max(sum(b for d, b in zip(best.placement.devices, best.stream_bytes, strict=True)
                                  if tight.host_of[d] == h) for h in range(len(tight.host_ram_bytes)))
    return None


@pytest.mark.parametrize("chunk", range(2))
def test_binding_host_ram_matches_brute_force(chunk: int) -> None:
    # RAM smaller than what the unconstrained optimum streams: the ILP carries every (time, RAM) Pareto pair per
    # arc and one RAM row per host (the DP is skipped); its optimum is the brute force's (which checks RAM).
    stats: Counter = Counter()
    for seed in range(6000 + chunk * 40, 6000 + (chunk + 1) * 40):
        rng = random.Random(seed)
        found = needs_streaming(rng)
        if found is None:
            continue
        table = dataclasses.replace(found[0], host_ram_bytes=[found[1] * rng.uniform(0.3, 0.99)] * len(
            found[0].host_ram_bytes), _prefix={}, _classes=[], _stream_prefix={})
        assert ram_may_bind(table)
        best = brute_force(table)
        ev = solve(table, None, time_limit_s=60).evaluation
        try:
            assert (best is None) == (ev is None)
            if best is not None and ev is not None:
                assert ev.feasible and ev.step_time_s == pytest.approx(best.step_time_s, rel=1e-6)
                stats["stream"] += any(ev.stream)
            stats["cases"] += 1
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}: {exc}") from exc
    assert stats["cases"] >= 3, stats


def test_short_host_ram_says_so(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    # 30 GB of RAM for ~37 GB of streamable weights: RAM may bind, the ILP's RAM-aware search needs minutes
    # for 70B; with a short limit the one-line error says what is slow and what to raise.
    conf = tmp_path / "conf" / "hardware"
    conf.mkdir(parents=True)
    (conf / "small_ram.yaml").write_text("name: small_ram\nhosts:\n  - name: box\n    ram_gb: 30\n    devices:\n"
                                         "      - type: rtx3090\n        count: 2\n")
    code, _, err, _ = compile_plan(tmp_path, capsys, "model=llama70b", "model.quantization=nf4", "hardware=small_ram",
                                   "planner.time_limit_s=3", config_dir=tmp_path / "conf")
    assert_one_line_error(code, err, "the solver found no placement within planner.time_limit_s=3: host RAM")


def test_cpu_stages_stream_only_when_full(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    # RAM to the same RAM saves nothing: auto never streams a CPU stage; full does (so runs can test it), each
    # copy priced as a memcpy at the memory bandwidth, nothing hidden.
    conf = tmp_path / "conf" / "hardware"
    conf.mkdir(parents=True)
    (conf / "local_ram.yaml").write_text("name: local_ram\nhosts:\n  - name: localhost\n    ram_gb: 8\n    devices:\n"
                                         "      - type: cpu\n        count: 2\n")
    for mode, streams in (("auto", False), ("full", True)):
        code, _, err, plan = compile_plan(tmp_path / mode, capsys, "hardware=local_ram", f"planner.offload={mode}",
                                          config_dir=tmp_path / "conf")
        assert code == 0 and plan is not None, err
        assert any(s.stream_layers for s in plan.stages) == streams
        decoders = {n.name for n in plan.graph.nodes if n.kind == "decoder"}
        for s in plan.stages:
            if streams:
                assert set(s.stream_layers) == decoders & set(s.node_names) and s.stream_time_s > 0
