"""Profiles: schema and refusal, the profile cost model moving layers, and a real one-layer measurement."""

from __future__ import annotations

import json
import random
import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest
from fleets import _fit, local_fleet, synthetic_profile
from metrics_rows import read_metrics, step_lines

from hetero.errors import HeteroError
from hetero.hardware import build_cluster, load_device_types
from hetero.planner import plan as make_plan
from hetero.planner.model.cost_model import RooflineCostModel
from hetero.planner.model.profile_cost import ProfileCostModel
from hetero.profile import (
    LinearFit,
    Profile,
    ProfileError,
    check_profile,
    fit_line,
)
from hetero.specs import DataSpec, ModelSpec, PlannerOptions, TrainSpec


@pytest.fixture(scope="module")
def tiny_graph(tiny_spec: ModelSpec):
    from hetero.compiler.trace import trace

    return trace(tiny_spec)


def test_fit_line_recovers_a_noisy_line() -> None:
    rng = random.Random(0)
    xs = [128, 256, 512, 1024, 2048]
    ys = [0.002 + 3e-5 * x + rng.gauss(0, 1e-5) for x in xs]
    fit = fit_line(xs, ys)
    assert fit.a_s == pytest.approx(0.002, abs=2e-4)
    assert fit.b_s_per_token == pytest.approx(3e-5, rel=0.02)
    assert fit.r2 > 0.999
    assert fit.at(4096) == pytest.approx(0.002 + 3e-5 * 4096, rel=0.02)
    assert LinearFit(-1.0, 0.0, 1.0).at(10) == 0.0  # a noisy negative intercept never gives negative time


def test_profile_roundtrip_and_refusals(tmp_path: Path, tiny_spec: ModelSpec) -> None:
    cluster = local_fleet([1, 1])
    prof = synthetic_profile(cluster, tiny_spec, {d.name: 1e-5 for d in cluster.devices})
    path = tmp_path / "p.json"
    prof.save(path)
    back = Profile.load(path)
    assert back == prof
    check_profile(back, cluster, tiny_spec)  # same fleet and model: accepted
    # Another fleet (three stages, or other threads) and another model are refused with one line.
    for other in (local_fleet([1, 1, 1]), local_fleet([2, 1])):
        with pytest.raises(ProfileError, match="re-run `hetero profile hardware=local") as exc:
            check_profile(back, other, tiny_spec)
        assert "\n" not in str(exc.value)
    bigger = ModelSpec(**{**tiny_spec.__dict__, "seq_len": 256})
    with pytest.raises(ProfileError, match="another architecture"):
        check_profile(back, cluster, bigger)
    data = json.loads(path.read_text())
    data["schema_version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="schema v99"):
        Profile.load(path)
    data["schema_version"] = 1
    data["devices"][0]["layers"]["decoder"]["fwd"]["a_s"] = "fast"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"devices\[0\].layers.decoder.fwd.a_s"):
        Profile.load(path)
    with pytest.raises(ProfileError, match="no such profile"):
        Profile.load(tmp_path / "missing.json")


def test_profile_moves_layers_away_from_the_slow_device(tiny_spec: ModelSpec, tiny_graph) -> None:
    cluster = local_fleet([2, 1])
    train, opts = (TrainSpec(micro_batch_size=4, num_micro_batches=8),
                   PlannerOptions(time_limit_s=10, replicas=1, interleave="off"))  # the split of one chunk per device
    tokens = train.micro_batch_size * tiny_spec.seq_len
    fast, slow = cluster.devices[0].name, cluster.devices[1].name
    results = {}
    for ratio in (1.0, 3.0):
        prof = synthetic_profile(cluster, tiny_spec, {fast: 1e-5, slow: ratio * 1e-5})
        cm = ProfileCostModel(prof, RooflineCostModel(), cluster=cluster, model=tiny_spec)
        p = make_plan(tiny_spec, tiny_graph, cluster, train, DataSpec(), opts, cost_model=cm)
        layers = {s.device: sum(1 for n in s.node_names if n.startswith("layers.")) for s in p.stages}
        results[ratio] = layers
        # Stage times are the profile's fits, summed over the stage's nodes.
        s0 = p.stages[0]
        expect = sum(prof.device(s0.device).layers[tiny_graph.nodes[i].kind].fwd.at(tokens)
                     for i in range(s0.first_node, s0.last_node + 1))
        assert s0.fwd_time_s == pytest.approx(expect, rel=1e-9)
        assert all(v == "profile" for k, v in cm.sources.items() if k.startswith(("time", "link")))
    assert results[1.0][fast] == results[1.0][slow] == 3  # equal devices: even split
    assert results[3.0].get(slow, 0) < results[3.0][fast]  # a 3x slower device gets fewer layers


def test_missing_numbers_fall_back_to_the_roofline_and_say_so(tiny_spec: ModelSpec, tiny_graph) -> None:
    cluster = local_fleet([1, 1])
    prof = synthetic_profile(cluster, tiny_spec, {d.name: 1e-5 for d in cluster.devices}, kinds=("decoder",))
    prof = replace(prof, links=[])
    cm = ProfileCostModel(prof, RooflineCostModel(), path="p.json")
    roof = RooflineCostModel()
    dev = cluster.devices[0]
    head = tiny_graph.node_index("head")
    tokens = 512
    assert cm.node_time_s(tiny_graph, tiny_spec, head, dev, tokens) == roof.node_time_s(tiny_graph, tiny_spec, head, dev, tokens)
    assert cm.transfer_time_s(cluster, "localhost", "localhost", 1e6) == roof.transfer_time_s(cluster, "localhost", "localhost", 1e6)
    dec = tiny_graph.decoder_indices()[0]
    assert cm.node_time_s(tiny_graph, tiny_spec, dec, dev, tokens)[0] == pytest.approx(1e-4 + 1e-5 * tokens)
    assert cm.sources[f"time {dev.name}/head"].startswith("roofline")
    assert cm.sources[f"time {dev.name}/decoder"] == "profile"
    assert cm.sources["link localhost<->localhost"].startswith("fleet file")
    summary = " ".join(cm.summary())
    assert "p.json" in summary and f"time {dev.name}/head" in summary


def test_real_decoder_layer_measurement(tiny_spec: ModelSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    """One real tiny decoder layer with LoRA: time grows with tokens, saved bytes match the layer's tensors."""
    import torch

    from hetero.runtime.tools import profiler
    from hetero.runtime.tools.profiler import build_probe, profile_layer

    monkeypatch.setattr(profiler, "TARGET_S", 0.05)  # fewer repeats: the test checks shape, not precision
    torch.set_num_threads(1)
    probe = build_probe(tiny_spec, torch.device("cpu"), "float32", "none")
    prof, tokens = profile_layer(probe, "decoder", [1, 4], tiny_spec.seq_len)
    assert tokens == [128, 512]
    assert prof.fwd.b_s_per_token > 0 and prof.bwd.b_s_per_token > 0
    assert prof.fwd.at(512) > prof.fwd.at(128)
    # LoRA r=8 on 7 projections of a 64-wide layer: (in + out) * r parameters each.
    arch = tiny_spec.architecture
    h, i, kv = arch["hidden_size"], arch["intermediate_size"], arch["num_key_value_heads"] * arch["head_dim"]
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]
    assert prof.lora_params == sum((a + b) * 8 for a, b in shapes)
    # What the layer keeps for backward, as it runs and recomputing: the LayerGraph's numbers (fp32).
    from dataclasses import replace

    from hetero.compiler.trace import trace

    node = trace(replace(tiny_spec, dtype="float32")).nodes[1]
    assert prof.activation_bytes_per_token == pytest.approx(node.activation_bytes_per_token, rel=0.1)
    assert prof.recompute_bytes_per_token == pytest.approx(node.recompute_bytes_per_token, rel=0.1)
    assert node.recompute_bytes_per_token == 4 * h  # its fp32 input


def test_load_runs_until_a_message_arrives(tiny_spec: ModelSpec) -> None:
    """A loading worker repeats a real decoder step between polls and hands over the message that ends it."""
    import torch

    from hetero.errors import WireError
    from hetero.runtime.tools import profile_worker
    from hetero.runtime.tools.profiler import decoder_load

    torch.set_num_threads(1)
    small = ModelSpec(**{**tiny_spec.__dict__, "seq_len": 16})
    step = decoder_load(small, local_fleet([1]).devices[0], torch.device("cpu"), 1)
    calls = []

    class Mailbox:  # two empty polls, then the message that ends the load
        polls = 0

        def recv(self, timeout_s: float) -> str:
            assert timeout_s < 0.1  # a poll, not a wait: the load must keep the core busy
            self.polls += 1
            if self.polls < 3:
                raise WireError("no message within 0.001 s")
            return "next"

    def counted() -> None:
        calls.append(1)
        step()

    profile_worker.LOAD_SLICE_S, saved = 0.0, profile_worker.LOAD_SLICE_S
    try:
        assert profile_worker._load_until_message(Mailbox(), counted) == "next"
    finally:
        profile_worker.LOAD_SLICE_S = saved
    assert len(calls) == 3  # one step per slice (slice 0 s): the load ran between every poll


def test_profile_cli_refuses_a_foreign_profile(tmp_path: Path, tiny_spec: ModelSpec) -> None:
    from hetero.cli import main

    cluster = local_fleet([1, 1])
    prof = synthetic_profile(cluster, tiny_spec, {d.name: 1e-5 for d in cluster.devices})
    prof = replace(prof, fleet_hash="0" * 16)
    path = tmp_path / "p.json"
    prof.save(path)
    from hetero import config as config_mod
    from hetero.cli import profile_cost_model

    # The re-run hint keeps the user's own overrides, and writes where the refused profile was.
    with pytest.raises(HeteroError, match=f"re-run `hetero profile hardware=local lora.r=4 output={path}`$"):
        profile_cost_model(config_mod.load(["hardware=local", "lora.r=4", f"profile={path}"]))
    assert main(["compile", f"profile={path}", f"output={tmp_path / 'out'}"]) == 2


def test_typical_is_a_trimmed_mean() -> None:
    """Preempted calls are part of what a run pays (the mean of both modes); rare outliers are not."""
    from hetero.runtime.tools.profiler import typical

    bimodal = [1.0] * 12 + [3.0] * 8  # 40% of the calls lose a scheduler slice
    assert typical(bimodal) == pytest.approx(1.75)  # the median would say 1.0
    assert typical([1.0] * 18 + [100.0, 0.0]) == pytest.approx(1.0)  # one stall, one glitch: trimmed
    assert typical([2.0]) == 2.0


def test_optimizer_and_message_costs_are_measured(tiny_spec: ModelSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor's own optimizer step grows with LoRA parameters; messages cost CPU on both sides."""
    import torch

    from hetero.runtime.tools import profiler
    from hetero.runtime.tools.profiler import build_probe, profile_messages, profile_optimizer

    monkeypatch.setattr(profiler, "TARGET_S", 0.05)
    torch.set_num_threads(1)
    probe = build_probe(tiny_spec, torch.device("cpu"), "float32", "none")
    fit = profile_optimizer(probe)
    assert fit is not None and len(fit.samples) == len(profiler.OPTIMIZER_COPIES)
    xs = [x for x, _ in fit.samples]
    assert xs == sorted(xs) and xs[-1] == xs[0] * profiler.OPTIMIZER_COPIES[-1]
    assert fit.b_s_per_token > 0 and fit.samples[-1][1] > fit.samples[0][1]  # 8 layers' LoRA cost more than 1
    send, recv = profile_messages(probe, [128, 2048])
    assert [x for x, _ in send.samples] == [128 * 64 * 4.0, 2048 * 64 * 4.0]  # bytes of a [tokens, hidden] fp32
    assert all(t > 0 for _, t in send.samples + recv.samples)


def test_the_codec_is_measured_and_prices_compressed_hand_offs(tiny_spec: ModelSpec,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`hetero profile` times runtime/wire/compress.py's encode and decode of [tokens, hidden] hand-offs per scheme
    (int4's rotation costs more than int8); a profile that has them prices a compressed link's messages with them,
    one without falls back to the datasheet estimate, and the plan's sources say which."""
    import torch

    from hetero.planner.model.cost_model import codec_s
    from hetero.runtime.tools import profiler

    monkeypatch.setattr(profiler, "TARGET_S", 0.05)
    torch.set_num_threads(1)
    probe = profiler.build_probe(tiny_spec, torch.device("cpu"), "float32", "none")
    encode, decode = profiler.profile_codec(probe, [256, 2048])
    assert set(encode) == set(decode) == {"int8", "int4"}
    assert [x for x, _ in encode["int8"].samples] == [256 * 64.0, 2048 * 64.0]  # values of a [tokens, hidden]
    assert all(t > 0 for fit in (*encode.values(), *decode.values()) for _, t in fit.samples)
    assert encode["int4"].at(2048 * 64) > encode["int8"].at(2048 * 64)
    cluster = local_fleet([1, 1])
    prof = synthetic_profile(cluster, tiny_spec, {d.name: 1e-5 for d in cluster.devices})
    first = replace(prof.devices[0], codec_encode={"int8": _fit(0.0, 1e-6)}, codec_decode={"int8": _fit(0.0, 2e-7)})
    model = ProfileCostModel(replace(prof, devices=[first, *prof.devices[1:]]), RooflineCostModel())
    measured, unmeasured = cluster.devices
    assert model.codec_s(measured, "int8", 1e4) == pytest.approx((1e-2, 2e-3))
    assert model.sources[f"codec {measured.name}"] == "profile"
    assert model.codec_s(unmeasured, "int8", 1e4) == codec_s(unmeasured, "int8", 1e4)
    assert model.sources[f"codec {unmeasured.name}"].startswith("roofline")
    assert model.codec_s(measured, "none", 1e4) == (0.0, 0.0)


def test_the_host_link_is_the_runtimes_own_streaming_copy(tiny_spec: ModelSpec,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`hetero profile` times the WeightStreamer copying the probe's decoder layer: its frozen Linears (no LoRA),
    every byte of them, at a positive rate; and it reads the host's available RAM."""
    import torch

    from hetero.runtime.stage.streaming import WeightStreamer
    from hetero.runtime.tools import profiler
    from hetero.runtime.tools.device_facts import available_ram_gb
    from hetero.runtime.tools.profiler import build_probe, profile_host_link

    monkeypatch.setattr(profiler, "TARGET_S", 0.05)
    torch.set_num_threads(1)
    probe = build_probe(tiny_spec, torch.device("cpu"), "float32", "none")
    copied: list[int] = []
    real_copy = WeightStreamer.copy_layer

    def spy(self: WeightStreamer, layer: int) -> None:
        copied.append(self.layer_bytes(layer))
        real_copy(self, layer)

    monkeypatch.setattr(WeightStreamer, "copy_layer", spy)
    rate = profile_host_link(probe)
    arch = tiny_spec.architecture
    h, i, kv = arch["hidden_size"], arch["intermediate_size"], arch["num_key_value_heads"] * arch["head_dim"]
    frozen = 4 * (h * h + 2 * h * kv + h * h + 3 * h * i)  # q, k, v, o, gate, up, down in fp32, no bias
    assert rate is not None and rate > 0
    assert len(copied) > profiler.MIN_REPEATS and set(copied) == {frozen}
    assert (available_ram_gb() or 0) > 0


def test_streaming_is_priced_at_the_measured_copy_rate_within_the_ram_measured(tiny_spec: ModelSpec,
                                                                                tiny_graph) -> None:
    """A profile's host link replaces the roofline's copy rate (no efficiency factor: it is what a copy reached),
    and a host's ram_gb above the RAM it had available is lowered to it; the plan cites both."""
    from hetero.planner.model.cost import build_cost_table

    fleet = {"name": "local", "hosts": [{"name": "localhost", "ram_gb": 64, "devices": [
        {"type": "cpu", "threads": 1}, {"type": "cpu", "threads": 1}]}]}
    cluster = build_cluster(fleet, load_device_types())
    train, opts = TrainSpec(micro_batch_size=4, num_micro_batches=8), PlannerOptions(split=[3, 3], offload="full")
    prof = synthetic_profile(cluster, tiny_spec, {d.name: 1e-5 for d in cluster.devices})
    measured = replace(prof, devices=[replace(d, host_link_gbs=0.5, host_ram_gb=20.04) for d in prof.devices])
    dec = tiny_graph.decoder_indices()[0]
    for profile, rate in ((measured, 0.5e9), (prof, RooflineCostModel().host_copy_bytes_per_s(cluster.devices[0]))):
        cm = ProfileCostModel(profile, RooflineCostModel(), cluster=cluster, model=tiny_spec)
        table = build_cost_table(tiny_graph, tiny_spec, cluster, train, opts, cm)
        assert table.stream_bytes[dec][0] > 0
        assert table.stream_fetch_s[dec][0] == pytest.approx(table.stream_bytes[dec][0] / rate, rel=1e-12)
        assert cm.sources[f"host link {cluster.devices[0].name}"] == ("profile" if profile is measured
                                                                      else "roofline (not measured)")
    cm = ProfileCostModel(measured, RooflineCostModel(), cluster=cluster, model=tiny_spec)
    p = make_plan(tiny_spec, tiny_graph, cluster, train, DataSpec(), opts, cost_model=cm)
    assert p.cluster.host("localhost").ram_gb == 20.0
    assert p.cost_sources["ram_gb localhost"] == "profile (20.0 GB available when measured; the fleet file says 64)"
    assert all(s.stream_layers for s in p.stages)
    # A host with more RAM available than its ram_gb keeps its ram_gb: it is what the user lets hetero use.
    roomy = replace(prof, devices=[replace(d, host_ram_gb=100.0) for d in prof.devices])
    cm = ProfileCostModel(roomy, RooflineCostModel(), cluster=cluster, model=tiny_spec)
    assert make_plan(tiny_spec, tiny_graph, cluster, train, DataSpec(), opts, cost_model=cm).cluster.host(
        "localhost").ram_gb == 64


def test_stage_overheads_come_from_the_profile_or_the_roofline(tiny_spec: ModelSpec, tiny_graph) -> None:
    """Optimizer and message costs per stage, in the plan and in its prediction; roofline when absent."""
    from hetero.plan import Plan
    from hetero.planner.model.cost_model import lora_tensors, wire_bytes_per_token
    from hetero.planner.schedule.simulator import simulate_plan
    from hetero.serde import to_dict

    cluster = local_fleet([1, 1])
    train = TrainSpec(micro_batch_size=4, num_micro_batches=8)
    opts = PlannerOptions(split=[3, 3])
    tokens = train.micro_batch_size * tiny_spec.seq_len
    prof = synthetic_profile(cluster, tiny_spec, {d.name: 1e-5 for d in cluster.devices})
    prof = replace(prof, devices=[replace(d, optimizer=LinearFit(1e-3, 1e-8, 1.0), message_send=LinearFit(1e-4, 1e-10, 1.0),
                                          message_recv=LinearFit(2e-4, 2e-10, 1.0)) for d in prof.devices])
    cm = ProfileCostModel(prof, RooflineCostModel(), cluster=cluster, model=tiny_spec)
    p = make_plan(tiny_spec, tiny_graph, cluster, train, DataSpec(), opts, cost_model=cm)
    s0, s1 = p.stages
    nodes0 = range(s0.first_node, s0.last_node + 1)
    lora0 = sum(tiny_graph.nodes[i].lora_params for i in nodes0)
    cut = wire_bytes_per_token(tiny_graph, s0.last_node, cluster.device(s0.device), tiny_spec) * tokens
    assert cut > 0
    assert s0.overhead_s == pytest.approx({"STEP": 1e-3 + 1e-8 * lora0, "SA": 1e-4 + 1e-10 * cut,
                                           "RG": 2e-4 + 2e-10 * cut})
    assert set(s1.overhead_s) == {"STEP", "RA", "SG"}
    assert s1.overhead_s["RA"] == pytest.approx(2e-4 + 2e-10 * cut)
    assert s0.step_sync_s == pytest.approx(2 * prof.links[0].transfer_s(256.0))
    assert cm.sources[f"optimizer {s0.device}"] == cm.sources[f"messages {s0.device}"] == "profile"
    # The plan's prediction is the simulator's with these overheads, and they cost time.
    assert simulate_plan(p).step_time_s == pytest.approx(p.prediction.step_time_s)
    bare = Plan.from_dict({**to_dict(p), "stages": [{**to_dict(s), "overhead_s": {}, "step_sync_s": 0.0}
                                                    for s in p.stages]})
    assert simulate_plan(bare).step_time_s < p.prediction.step_time_s
    # A plan written before these fields existed still loads (no overheads).
    old = to_dict(p)
    for st in old["stages"]:
        del st["overhead_s"], st["step_sync_s"]
    assert Plan.from_dict(old).stages[0].overhead_s == {}
    # A profile without them (written by an older hetero) falls back to the roofline, and says so.
    prof = replace(prof, devices=[replace(d, optimizer=None, message_send=None, message_recv=None) for d in prof.devices])
    cm = ProfileCostModel(prof, RooflineCostModel(), cluster=cluster, model=tiny_spec)
    p = make_plan(tiny_spec, tiny_graph, cluster, train, DataSpec(), opts, cost_model=cm)
    dev = cluster.device(p.stages[0].device)
    roof = RooflineCostModel().optimizer_step_s(dev, tiny_spec, lora0, sum(lora_tensors(tiny_graph, tiny_spec, i)
                                                                            for i in nodes0))
    assert p.stages[0].overhead_s["STEP"] == pytest.approx(roof)
    assert cm.sources[f"optimizer {dev.name}"] == "roofline (not measured)"


def check_measured_fleet(profile: Profile) -> None:
    """What `hetero profile hardware=local` (two CPU worker processes) measured: every part of each device,
    one at a time while the other ran a load, and the loopback link."""
    devices, links = profile.devices, profile.links
    assert [d.device for d in devices] == ["localhost.cpu0", "localhost.cpu1"]
    assert all(set(d.layers) == {"embedding", "decoder", "norm", "head"} for d in devices)
    assert all(d.threads == 1 and d.environment["torch_threads"] == 1 for d in devices)
    assert len(links) == 1 and links[0].a == links[0].b == "localhost"
    assert links[0].bandwidth_gbps > 0 and links[0].latency_us > 0
    for d in devices:  # what a stage pays outside its layers was measured too, and what streaming needs
        assert d.optimizer is not None and all(t > 0 for _, t in d.optimizer.samples)
        assert d.host_link_gbs is not None and d.host_link_gbs > 0
        assert d.host_ram_gb is not None and d.host_ram_gb > 0
        assert d.message_send is not None and d.message_recv is not None
        assert all(t > 0 for _, t in d.message_send.samples + d.message_recv.samples)
    # One CPU stage of a host at a time, the other running a load meanwhile: the two measurements
    # do not overlap in time (measuring both at once shares the cores only by chance).
    first, second = sorted(devices, key=lambda d: d.started_unix_s)
    assert first.started_unix_s > 0 and first.started_unix_s + first.seconds <= second.started_unix_s
    assert devices[0].measured_with == [devices[1].device] and devices[1].measured_with == [devices[0].device]


def test_profile_compile_run_predicts_the_step(tmp_path: Path, capsys, monkeypatch) -> None:
    """The whole loop on this machine, as a user follows the hints: a datasheet plan's "measure the fleet"
    hints, run as printed (they keep the user's overrides), profile hardware=local and compile with it; run,
    compare; the demo model's adapter then loads with AutoPeftModelForCausalLM.

    The bound is loose on purpose: this machine's speed drifts by +-25% within a minute (the
    same stage step takes 25-43 ms), so one profile and one run can disagree by that much (1.72x was seen); the
    15% check is bench/bench_prediction.py, over rounds. This catches plumbing errors (a profile
    number lost, a unit off), which put the prediction off by far more.
    """
    from procs import default_ports

    with default_ports():  # the profile's workers and the run listen on hardware=local's ports
        _whole_loop(tmp_path, capsys, monkeypatch)


def _whole_loop(tmp_path: Path, capsys, monkeypatch) -> None:
    import json
    import statistics

    from metrics_rows import step_line
    from procs import clone_beside

    from hetero.cli import main
    from hetero.plan import Plan
    from hetero.runtime.run.run_compare import compare_run

    # A user's datasheet plan with a choice of their own (lora.r=4: a profile for r=8 would be refused).
    monkeypatch.chdir(clone_beside(tmp_path))  # the profile's workers and the run's stages start beside the clone
    user = ["model=tiny", "hardware=local", "lora.r=4", "output=plan"]
    assert main(["compile", *user]) == 0
    capsys.readouterr()
    # Its run came out far off the prediction: the hints say how to measure and re-plan; follow them as printed.
    datasheets = Plan.load(tmp_path / "plan" / "plan.json")
    off = [step_line(step=n, step_time_s=3 * datasheets.prediction.step_time_s) for n in range(1, 4)]
    hint = next(line for line in compare_run(datasheets, off) if "come from datasheets" in line)
    measure, again = re.findall(r"`([^`]+)`", hint)
    assert measure == "hetero profile model=tiny hardware=local lora.r=4 output=profile.json", hint
    assert main(shlex.split(measure)[1:]) == 0
    check_measured_fleet(Profile.load(tmp_path / "profile.json"))
    follow = capsys.readouterr().out.splitlines()[-1]
    assert follow == "next: hetero compile model=tiny hardware=local lora.r=4 profile=profile.json", follow
    assert again == "hetero compile model=tiny hardware=local lora.r=4 output=plan profile=profile.json", hint
    assert main(shlex.split(again)[1:]) == 0
    out, run, prof = tmp_path / "plan", tmp_path / "run", "profile.json"
    plan = json.loads((out / "plan.json").read_text())
    assert plan["cost_sources"]["profile"] == prof and plan["model"]["lora"]["r"] == 4
    assert all(s["overhead_s"].get("STEP", 0) > 0 for s in plan["stages"])
    assert main(["run", str(out / "plan.json"), "steps=6", "--run-dir", str(run), "--no-progress"]) == 0
    steps = [line["step_time_s"] for line in step_lines(read_metrics(run / "metrics.jsonl"))]
    ratio = statistics.median(steps[1:]) / plan["prediction"]["step_time_s"]
    # 1.72 was seen on a quiet CI rehearsal (2026-11-29): the bound catches a lost number or a unit, not drift.
    assert 0.4 < ratio < 2.5, f"measured/predicted {ratio:.2f}"
    capsys.readouterr()
    assert main(["simulate", str(out / "plan.json"), "--no-replan", "--run", str(run)]) == 0
    assert "measured/replayed" in capsys.readouterr().out
    # The demo model (bundled: no hub id): its adapter loads with AutoPeftModelForCausalLM and generates.
    from runs import check_loads_with_auto_peft

    check_loads_with_auto_peft(run / "adapter")
