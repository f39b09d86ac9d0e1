"""The run is a profile: `hetero run` writes RUN_DIR/profile.json, `hetero compile profile=RUN_DIR` plans with
it (merged with a profile file), a run of another fleet or model is refused, and NF4 is priced as NF4."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from metrics_rows import step_line

from hetero.plan import Plan
from hetero.profile import LAYER_KINDS, PROFILE_SCHEMA_VERSION, Profile, ProfileError, typical
from hetero.specs import ModelSpec

TOKENS = 4 * 128  # the tiny config's micro_batch_size x seq_len


def _prior(tmp_path: Path) -> Path:
    """A `hetero profile` file of the local 2-CPU fleet for the tiny model (synthetic, both CPUs alike)."""
    from fleets import synthetic_profile

    from hetero import config as config_mod
    from hetero.profile import LinearFit

    cfg = config_mod.load(["model=tiny", "hardware=local"])
    prof = synthetic_profile(cfg.cluster, cfg.model, {d.name: 2e-5 for d in cfg.cluster.devices})
    message = LinearFit(2e-4, 1e-10, 1.0, [[1e3, 2e-4], [1e6, 3e-4]])
    prof = replace(prof, devices=[replace(d, message_send=message, message_recv=message) for d in prof.devices])
    path = tmp_path / "prior.json"
    prof.save(path)
    return path


@pytest.fixture(scope="module")
def loop(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """compile with a profile file -> run 4 steps (2 pipeline stages) -> the run directory."""
    from procs import default_ports

    from hetero.cli import main

    tmp = tmp_path_factory.mktemp("loop")
    prior = _prior(tmp)
    # One chunk per device: the profile's arithmetic reads each stage's own span.
    common = ["model=tiny", "hardware=local", "planner.num_stages=2", "planner.time_limit_s=10", "planner.interleave=off"]
    assert main(["compile", *common, f"profile={prior}", f"output={tmp / 'plan'}"]) == 0
    with default_ports():
        assert main(["run", str(tmp / "plan" / "plan.json"), "steps=4", "--run-dir", str(tmp / "run"),
                     "--no-progress"]) == 0
    return {"tmp": tmp, "prior": prior, "plan": tmp / "plan" / "plan.json", "run": tmp / "run"}


def _measured_per_mb(run: Path, k: int, op: str, micro_batches: int) -> float:
    """Stage k's op seconds per micro-batch as metrics.jsonl has them (typical over the steps after the first)."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"stage_ops"' in line]
    return typical([float(line["stage_ops"][k][op]) for line in lines[1:]]) / micro_batches


@pytest.mark.slow
def test_a_run_writes_a_profile_of_what_it_measured(loop: dict[str, Path]) -> None:
    """profile.json loads; every stage's device has every layer kind, its optimizer and its sends; the kinds
    a stage ran add up to the forward and backward metrics.jsonl measured; links come from the prior."""
    plan = Plan.load(loop["plan"])
    assert len(plan.stages) == 2 and not plan.replicas
    prof = Profile.load(loop["run"])  # the directory: its profile.json
    assert prof.schema_version == PROFILE_SCHEMA_VERSION
    assert prof.origin == f"run {loop['run'].resolve()}, step 4"
    assert [d.device for d in prof.devices] == [s.device for s in plan.stages]
    assert {(lk.a, lk.b) for lk in prof.links} == {("localhost", "localhost")}
    m = plan.train.num_micro_batches
    for k, (sp, dev) in enumerate(zip(plan.stages, prof.devices, strict=True)):
        assert set(dev.layers) == set(LAYER_KINDS)
        ran = [plan.graph.nodes[i].kind for i in range(sp.first_node, sp.last_node + 1)]
        for op, direction in (("F", "fwd"), ("B", "bwd")):
            total = sum(getattr(dev.layers[kind], direction).at(TOKENS) for kind in ran)
            assert total == pytest.approx(_measured_per_mb(loop["run"], k, op, m), rel=1e-9)
        for kind in LAYER_KINDS:
            assert dev.sources[kind].startswith(prof.origin)
            assert ("scaled" in dev.sources[kind]) == (kind not in ran)
        assert dev.optimizer is not None and dev.optimizer.at(dev.optimizer.samples[0][0]) > 0
        assert dev.message_send is not None and dev.message_send.at(1) > 0
        assert dev.message_recv is not None  # from the prior: a run's receives include their waits


@pytest.mark.slow
def test_compile_from_a_run_plans_with_its_measurements(loop: dict[str, Path]) -> None:
    """profile=RUN_DIR: the plan's costs cite the run; with the same split, each stage's predicted forward is
    the forward the run measured. profile=[RUN_DIR,FILE]: the run wins (a CPU stage's receives too, by their CPU
    time, and the link it timed)."""
    from hetero.cli import main

    tmp, run = loop["tmp"], loop["run"]
    # One chunk per device: the profile's arithmetic reads each stage's own span.
    common = ["model=tiny", "hardware=local", "planner.num_stages=2", "planner.time_limit_s=10", "planner.interleave=off"]
    assert main(["compile", *common, f"profile={run}", f"output={tmp / 'again'}"]) == 0
    again = Plan.load(tmp / "again" / "plan.json")
    cited = f"run {run.resolve()}, step 4"
    assert again.cost_sources["profile"] == str(run)
    assert again.cost_sources["time localhost.cpu0/decoder"] == cited
    assert again.cost_sources["optimizer localhost.cpu1"] == cited
    assert any(cited in line for line in again.verdict)
    # Each stage's predicted forward is the run's per-kind times of its device summed over its layers.
    prof = Profile.load(run)
    for sp in again.stages:
        dev = prof.device(sp.device)
        assert dev is not None
        kinds = [again.graph.nodes[i].kind for i in range(sp.first_node, sp.last_node + 1)]
        assert sp.fwd_time_s == pytest.approx(sum(dev.layers[kind].fwd.at(TOKENS) for kind in kinds), rel=1e-6)
    assert main(["compile", *common, f"profile=[{run},{loop['prior']}]", f"output={tmp / 'merged'}"]) == 0
    merged = Plan.load(tmp / "merged" / "plan.json")
    assert merged.cost_sources["time localhost.cpu1/head"] == cited
    assert merged.cost_sources["link localhost<->localhost"].startswith(f"{cited} (message hand-off times")
    assert merged.cost_sources["messages localhost.cpu0"] == f"send: {cited}; receive: {cited} (CPU time)"


@pytest.mark.slow
def test_a_run_of_another_fleet_or_model_is_refused(loop: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    """One line each, naming what differs; exit code 2."""
    from hetero.cli import main

    tmp, run = loop["tmp"], loop["run"]
    for override, what in (("hardware.num_devices=3", "another fleet"), ("lora.r=4", "another model")):
        capsys.readouterr()
        assert main(["compile", "model=tiny", "hardware=local", override, f"profile={run}",
                     f"output={tmp / 'refused'}"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"is a run of {what}" in err, err


def test_a_plan_without_a_profile_is_split_by_the_roofline(tmp_path: Path, tiny_spec: ModelSpec) -> None:
    """No profile behind the plan: the roofline divides each stage's measured times among the kinds, and the
    optimizer and send costs are the measured ones, per LoRA parameter and per message."""
    from fleets import local_fleet

    from hetero.compiler.trace import trace
    from hetero.planner import plan as make_plan
    from hetero.planner.model.cost_model import RooflineCostModel
    from hetero.runtime.run.run_profile import run_profile
    from hetero.specs import DataSpec, PlannerOptions, TrainSpec

    graph, cluster = trace(tiny_spec), local_fleet([1, 1])
    plan = make_plan(tiny_spec, graph, cluster, TrainSpec(micro_batch_size=4, num_micro_batches=4), DataSpec(),
                     PlannerOptions(num_stages=2, time_limit_s=10, interleave="off"))
    ops = [{"F": 0.4, "B": 0.8, "SA": 0.004, "STEP": 0.05, "clip_wait": 0.01},
           {"F": 0.2, "B": 0.6, "SG": 0.008, "STEP": 0.03, "clip_wait": 0.02}]
    lines = [step_line(step=s, stage_ops=ops) for s in range(1, 4)]
    prof = run_profile(plan, tmp_path, lines)
    assert prof is not None
    roof = RooflineCostModel(plan.planner.efficiency)
    tokens = 4 * tiny_spec.seq_len
    for k, sp in enumerate(plan.stages):
        dev = prof.device(sp.device)
        assert dev is not None
        nodes = range(sp.first_node, sp.last_node + 1)
        prior = [roof.node_time_s(graph, tiny_spec, i, cluster.device(sp.device), tokens)[0] for i in nodes]
        scale = ops[k]["F"] / 4 / sum(prior)
        assert dev.layers["decoder"].fwd.at(tokens) == pytest.approx(scale * prior[[graph.nodes[i].kind for i in
                                                                                      nodes].index("decoder")])
        lora = sum(graph.nodes[i].lora_params for i in nodes)
        assert dev.optimizer is not None and dev.optimizer.at(lora) == pytest.approx(ops[k]["STEP"] - ops[k]["clip_wait"])
        assert dev.message_send is not None and dev.message_send.at(0) == pytest.approx(0.004 / 4 if k == 0 else 0.008 / 4)
        assert dev.message_recv is None and "message_recv" not in dev.sources


def test_a_version_1_profile_still_loads(tmp_path: Path) -> None:
    """Schema v2 added fields with defaults: a file `hetero profile` wrote before loads as it was."""
    data = json.loads(_prior(tmp_path).read_text())
    data["schema_version"] = 1
    for dev in data["devices"]:
        del dev["sources"]
    del data["origin"]
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(data))
    old = Profile.load(path)
    assert old.origin == "" and old.devices[0].sources == {}
    assert old == Profile.load(tmp_path / "prior.json")


def test_nf4_is_priced_as_a_quantized_layer(tiny_spec: ModelSpec) -> None:
    """The roofline charges NF4 the dense matmul plus a dequantization pass in forward and in backward (read
    the NF4 bytes, write the compute-dtype weight: planner/model/cost_model.py), so NF4 is slower than bf16, never
    faster; a profile measured without quantization is not used for an NF4 layer."""
    from fleets import local_fleet, synthetic_profile

    from hetero.compiler.trace import trace
    from hetero.hardware import build_cluster, load_device_types
    from hetero.planner.model.cost_model import QUANT_BYTES_PER_PARAM, RooflineCostModel
    from hetero.planner.model.profile_cost import ProfileCostModel

    graph = trace(tiny_spec)
    gpu = build_cluster({"name": "g", "hosts": [{"name": "h", "devices": [{"type": "rtx4090"}]}]},
                        load_device_types()).devices[0]
    dense = replace(tiny_spec, dtype="bfloat16", quantization="none")
    nf4 = replace(dense, quantization="nf4")
    cm = RooflineCostModel()
    node = graph.decoder_indices()[0]
    pass_s = graph.nodes[node].linear_params * (QUANT_BYTES_PER_PARAM["nf4"] + 2) / (gpu.memory_bandwidth_gbs * 1e9)
    for tokens in (1, 512, 8192):
        f16, b16 = cm.node_time_s(graph, dense, node, gpu, tokens)
        f4, b4 = cm.node_time_s(graph, nf4, node, gpu, tokens)
        assert f4 == pytest.approx(f16 + pass_s) and b4 == pytest.approx(b16 + pass_s)
    # A CPU profile measured without quantization does not price the NF4 layer: the roofline does, and says why.
    cluster = local_fleet([1, 1])
    measured = synthetic_profile(cluster, tiny_spec, {d.name: 1e-5 for d in cluster.devices})
    pcm = ProfileCostModel(measured, cm)
    cpu = cluster.devices[0]
    assert pcm.node_time_s(graph, replace(tiny_spec, quantization="nf4"), node, cpu, 512) == \
        cm.node_time_s(graph, replace(tiny_spec, quantization="nf4"), node, cpu, 512)
    assert pcm.sources[f"time {cpu.name}/decoder"] == "roofline (profiled with quantization none)"


def test_a_directory_without_a_profile_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="a directory without profile.json") as exc:
        Profile.load(tmp_path)
    assert "\n" not in str(exc.value)


def test_a_link_is_timed_by_its_messages_whatever_the_clock_offset(tmp_path: Path, tiny_spec: ModelSpec) -> None:
    """Each direction's hand-off time less the sender's encode and the receiver's decode is the link's transfer;
    a clock offset between the hosts adds to one direction what it takes from the other, so it cancels; the link
    keeps the prior's shape (fleet file here) scaled through the measured point."""
    from fleets import local_fleet

    from hetero.compiler.trace import trace
    from hetero.planner import plan as make_plan
    from hetero.runtime.run.run_profile import run_profile
    from hetero.specs import DataSpec, PlannerOptions, TrainSpec

    plan = make_plan(tiny_spec, trace(tiny_spec), local_fleet([1, 1]), TrainSpec(micro_batch_size=4, num_micro_batches=4),
                     DataSpec(), PlannerOptions(num_stages=2, time_limit_s=10, interleave="off"))
    ops = [{"F": 0.4, "B": 0.8, "SA": 0.004, "RG": 0.3, "STEP": 0.05, "clip_wait": 0.01},
           {"F": 0.2, "B": 0.6, "RA": 0.2, "SG": 0.008, "STEP": 0.03, "clip_wait": 0.02}]
    cpu = [{"F": 0.4, "B": 0.8, "SA": 0.004, "RG": 0.002, "STEP": 0.04}, {"F": 0.2, "B": 0.6, "RA": 0.004, "SG": 0.008,
                                                                           "STEP": 0.01}]
    transfer, offset = 0.003, 0.0021  # the link's seconds per message; stage 1's clock ahead of stage 0's
    own_fwd, own_bwd = 0.004 / 4 + 0.004 / 4, 0.008 / 4 + 0.002 / 4  # SA0 + RA1, SG1 + RG0 per message
    found = []
    for off in (0.0, offset, -offset):
        links = [{"grad": own_bwd + transfer - off}, {"act": own_fwd + transfer + off}]
        lines = [step_line(step=s, stage_ops=ops, stage_cpu_ops=cpu, stage_links=links) for s in range(1, 4)]
        prof = run_profile(plan, tmp_path, lines)
        assert prof is not None and len(prof.links) == 1
        link = prof.links[0]
        (num_bytes, seconds), = link.samples
        assert seconds == pytest.approx(transfer)
        assert link.transfer_s(num_bytes) == pytest.approx(transfer)
        fleet = plan.cluster.link("localhost", "localhost")
        assert link.bandwidth_gbps * link.latency_us == pytest.approx(fleet.bandwidth_gbps * fleet.latency_us)
        assert link.method.startswith(f"run {tmp_path.resolve()}, step 3 (message hand-off times")
        found.append(link)
    assert all(f.bandwidth_gbps == pytest.approx(found[0].bandwidth_gbps) for f in found)
    no_links = run_profile(plan, tmp_path, [step_line(step=s, stage_ops=ops) for s in range(1, 4)])
    assert no_links is not None and no_links.links == []
