"""`hetero run --engine torch`: the same plan on torch.distributed.pipelining trains like one process.

The same reference as hetero's own engine (tests/reference.py, plain transformers+peft): tiny Llama, fp32,
4 micro-batches, active clipping, warmup + cosine. Three CPU stages under Schedule1F1B (gloo), and two
replicas of a 2-stage pipeline (a 2 x 2 DeviceMesh, uneven shares): losses and every LoRA tensor within 1e-4.
A checkpoint of either engine resumes on the other (another split too) and continues the same curve; the adapter loads with
AutoPeftModelForCausalLM; plans this engine cannot run are refused in one line before a run directory exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from metrics_rows import read_metrics, step_lines
from plans import RTOL, SEQ_LEN, TRAIN, make_plan  # the default engine's settings: the same reference
from reference import assert_close_to_scale
from runs import _check_against_reference

from hetero.errors import PlanError
from hetero.plan import Plan
from hetero.runtime.cli import main_run
from hetero.runtime.stage.adapter import load_adapter_state
from hetero.runtime.torch_engine.support import EngineUnsupportedError, check_supported
from hetero.specs import ModelSpec


@pytest.fixture(scope="module")
def setup(references: Callable[..., dict], tiny_model_dir: Path) -> dict:
    return references(tiny_model_dir, TRAIN, SEQ_LEN, packing=False)


def _run(plan: Plan, root: Path, name: str, *extra: str) -> Path:
    path = root / f"plan-{name}.json"
    plan.save(path)
    run_dir = root / f"run-{name}"
    assert main_run([str(path), "--run-dir", str(run_dir), "--no-progress", *extra]) == 0
    return run_dir


@pytest.mark.slow
def test_three_stages_1f1b_equal_the_reference(setup: dict, tiny_model_dir: Path, tiny_spec: ModelSpec) -> None:
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, packing=False, split=[2, 2, 2], train=TRAIN, lora=setup["lora"],
                     seq_len=SEQ_LEN)
    run_dir = _run(plan, setup["root"], "three", "--engine", "torch", "checkpoint_every=2")
    metrics = step_lines(read_metrics(run_dir / "metrics.jsonl"))
    assert min(m["clip_coef"] for m in metrics) < 0.99 and len({round(m["lr"], 12) for m in metrics}) >= 3
    _check_against_reference(run_dir, setup, list(range(1, TRAIN.steps + 1)))
    for step in (2, 4):  # hetero's checkpoint layout: every stage's file, then COMPLETE
        ckpt = run_dir / "checkpoints" / f"step-{step:06d}"
        assert (ckpt / "COMPLETE").is_file() and len(list(ckpt.glob("stage*.safetensors"))) == 3
    assert not (run_dir / ".torch-engine-state").exists()
    setup["three"] = run_dir


@pytest.mark.slow
def test_two_replicas_on_a_device_mesh_equal_the_reference(setup: dict, tiny_model_dir: Path,
                                                           tiny_spec: ModelSpec) -> None:
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, packing=False, split=[[3, 3], [3, 3]], train=TRAIN,  # type: ignore[list-item]
                     lora=setup["lora"], seq_len=SEQ_LEN, shares=[2, 2])
    run_dir = _run(plan, setup["root"], "mesh", "--engine", "torch")
    _check_against_reference(run_dir, setup, list(range(1, TRAIN.steps + 1)))


@pytest.mark.slow
@pytest.mark.parametrize(("first", "then"), [("torch", "hetero"), ("hetero", "torch")])
def test_a_checkpoint_of_one_engine_resumes_on_the_other(setup: dict, tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                         first: str, then: str) -> None:
    """6 steps on one engine; its step-3 checkpoint resumed for 3 more on the other engine (and another split):
    the same losses and adapter as the 6 steps on one."""
    root = setup["root"]
    train = replace(TRAIN, steps=6)
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, packing=False, split=[3, 3], train=train, lora=setup["lora"], seq_len=SEQ_LEN)
    whole = _run(plan, root, f"{first}-whole", "--engine", first, "checkpoint_every=3")
    resumed = make_plan(tiny_model_dir, tiny_spec.architecture, packing=False, split=[2, 4], train=train, lora=setup["lora"],
                        seq_len=SEQ_LEN)
    path = root / f"plan-{then}-after.json"
    resumed.save(path)
    after = root / f"run-{then}-after"
    assert main_run([str(path), "--run-dir", str(after), "--no-progress", "--engine", then, "--resume",
                     str(whole / "checkpoints" / "step-000003")]) == 0
    want = step_lines(read_metrics(whole / "metrics.jsonl"))
    got = step_lines(read_metrics(after / "metrics.jsonl"))
    assert [m["step"] for m in got] == [4, 5, 6]
    assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in want[3:]], rel=RTOL)
    assert [m["lr"] for m in got] == pytest.approx([m["lr"] for m in want[3:]], rel=1e-9)
    trained = load_adapter_state(after / "adapter", setup["lora"])
    for key, value in load_adapter_state(whole / "adapter", setup["lora"]).items():
        assert_close_to_scale(key, trained[key], value, RTOL)


@pytest.mark.slow
def test_the_torch_engines_adapter_loads_with_auto_peft(setup: dict) -> None:
    if "three" not in setup:
        pytest.skip("needs the 3-stage run above")
    from peft import AutoPeftModelForCausalLM

    model = AutoPeftModelForCausalLM.from_pretrained(str(setup["three"] / "adapter"))
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape[:2] == (1, 4) and torch.isfinite(logits).all()
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert loaded and any(not torch.all(v == 0) for k, v in loaded.items() if "lora_B" in k)


def test_plans_it_cannot_run_are_refused_in_one_line(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                     tmp_path: Path) -> None:
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, packing=False, split=[3, 3], train=TRAIN, seq_len=SEQ_LEN,
                     hosts=["alpha", "beta"])
    assert check_supported(plan, None) == check_supported(plan, "alpha") == "gloo"  # several hosts: from stage 0's
    with pytest.raises(EngineUnsupportedError, match=r"^--engine torch cannot run this plan: on several hosts it starts "
                       r"on stage 0's host, 'alpha' .* not on 'beta'; run it with `--engine hetero`"):
        check_supported(plan, "beta")
    mixed = replace(plan, stages=[plan.stages[0], replace(plan.stages[1], backend="cuda")])
    with pytest.raises(EngineUnsupportedError, match=r"different device kinds \(cpu, cuda\)"):
        check_supported(mixed, None)
    one_host = replace(plan, stages=[replace(s, host="alpha") for s in plan.stages])
    vendors = replace(one_host, stages=[replace(one_host.stages[0], backend="cuda"),
                                        replace(one_host.stages[1], backend="rocm")])
    with pytest.raises(EngineUnsupportedError, match=r"mixes NVIDIA \(cuda\) and AMD \(rocm\) cards, .*"
                                                     r"run it with `--engine hetero`"):
        check_supported(vendors, "alpha")
    one = make_plan(tiny_model_dir, tiny_spec.architecture, packing=False, split=[3, 3], train=TRAIN, seq_len=SEQ_LEN)
    assert check_supported(one, None) == "gloo"
    split = make_plan(tiny_model_dir, tiny_spec.architecture, packing=False, split=[[3, 3], [2, 4]], train=TRAIN,  # type: ignore[list-item]
                      seq_len=SEQ_LEN, shares=[2, 2])
    with pytest.raises(EngineUnsupportedError, match=r"replica 1 splits the layers otherwise than replica 0"):
        check_supported(split, None)
    few = make_plan(tiny_model_dir, tiny_spec.architecture, packing=False, split=[[3, 3], [3, 3]], train=TRAIN,  # type: ignore[list-item]
                    seq_len=SEQ_LEN, shares=[1, 3])
    with pytest.raises(EngineUnsupportedError, match=r"replica 0 has 1 micro-batch\(es\) for 2 stages"):
        check_supported(few, None)
    packed = replace(one, data=replace(one.data, packing=True))
    with pytest.raises(EngineUnsupportedError, match=r"data\.packing=true .* recompile with data\.packing=false"):
        check_supported(packed, None)
    evaluating = replace(one, eval=replace(one.eval, every=2))
    with pytest.raises(EngineUnsupportedError, match=r"eval\.every=2"):
        check_supported(evaluating, None)
    # Through the command line: one line (HeteroError), before any run directory exists.
    plan.save(tmp_path / "plan.json")
    with pytest.raises(EngineUnsupportedError):
        main_run([str(tmp_path / "plan.json"), "--run-dir", str(tmp_path / "run"), "--engine", "torch", "--host", "beta"])
    assert not (tmp_path / "run").exists()


def test_a_box_of_amd_cards_compiles_to_a_torch_engine_plan_on_nccl(tmp_path: Path) -> None:
    """ROCm's torch calls AMD cards "cuda" devices and serves the "nccl" backend with RCCL (tested on the plan: no
    GPU here)."""
    from hetero.cli import main

    fleets = tmp_path / "fleets" / "hardware"
    fleets.mkdir(parents=True)
    (fleets / "amd.yaml").write_text("name: amd\nhosts:\n  - name: box\n    address: 127.0.0.1\n    port: 29500\n"
                                     "    devices: [{type: rx7900xtx, count: 2}]\n")
    assert main(["compile", "model=tiny", "-cd", str(tmp_path / "fleets"), "hardware=amd", "data.packing=false",
                 f"output={tmp_path / 'out'}", "planner.time_limit_s=20"]) == 0
    plan = Plan.load(tmp_path / "out" / "plan.json")
    assert {s.backend for s in plan.stages} == {"rocm"}
    assert check_supported(plan, None) == "nccl"


@pytest.mark.slow
def test_the_torch_engine_does_not_check_ports_it_never_binds(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                               tmp_path: Path) -> None:
    """Another program on hetero's coordinator port (the plan's base port - 1) stops `--engine hetero` at the
    pre-check, not `--engine torch`, whose rendezvous takes a free port of its own."""
    import socket

    from hetero.runtime.run.preflight import PortBusyError

    plan = make_plan(tiny_model_dir, tiny_spec.architecture, packing=False, split=[3, 3],
                     train=replace(TRAIN, steps=2), seq_len=SEQ_LEN)
    plan.save(tmp_path / "plan.json")
    port = int(plan.stages[0].endpoint.rsplit(":", 1)[1]) - 1
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen()
        with pytest.raises(PortBusyError, match="another process .* holds the port"):
            main_run([str(tmp_path / "plan.json"), "--run-dir", str(tmp_path / "hetero"), "--no-progress"])
        assert main_run([str(tmp_path / "plan.json"), "--run-dir", str(tmp_path / "torch"), "--no-progress",
                         "--engine", "torch"]) == 0
    assert len(step_lines(read_metrics(tmp_path / "torch" / "metrics.jsonl"))) == 2


def test_hosts_outside_private_ranges_are_refused_unless_trusted(tiny_model_dir: Path, tiny_spec: ModelSpec) -> None:
    from hetero.runtime.torch_engine.network import addresses, interface_of

    plan = make_plan(tiny_model_dir, tiny_spec.architecture, packing=False, split=[3, 3], train=TRAIN, seq_len=SEQ_LEN,
                     hosts=["alpha", "beta"])
    assert addresses(plan, trusted=False) == {"alpha": "127.0.0.1", "beta": "127.0.0.1"}
    public = replace(plan, cluster=replace(plan.cluster, hosts=[replace(h, address="8.8.8.8" if h.name == "beta"
                                                                          else "10.0.0.1") for h in plan.cluster.hosts]))
    with pytest.raises(PlanError, match=r"^--engine torch: host 'beta' is at 8\.8\.8\.8, outside private and loopback "
                                        r"ranges, .* --engine hetero, or pass --trusted-network") as err:
        addresses(public, trusted=False)
    assert "\n" not in str(err.value)
    assert addresses(public, trusted=True)["beta"] == "8.8.8.8"
    lan = replace(plan, cluster=replace(plan.cluster, hosts=[replace(h, address="10.0.0.2") if h.name == "beta"
                                                               else h for h in plan.cluster.hosts]))
    with pytest.raises(PlanError, match=r"host 'alpha' address '127\.0\.0\.1' is 127\.0\.0\.1 \(loopback\) here, which "
                                        r"other hosts cannot reach"):
        addresses(lan, trusted=True)
    assert interface_of("127.0.0.1") == "lo" and interface_of("192.0.2.1") is None  # TEST-NET-1: nobody's


@pytest.mark.slow
def test_a_host_without_ssh_joins_with_the_command_hetero_run_prints(setup: dict, tiny_model_dir: Path,
                                                                      tiny_spec: ModelSpec, tmp_path: Path) -> None:
    """Two plan hosts on this machine's loopback, neither with ``ssh:``: `hetero run` prints beta's command,
    which, run as printed, trains beta's stage; the run equals the reference. A taken rendezvous port is one
    line before anything starts."""
    import shlex
    import socket

    from procs import clean_up, finish, start

    plan = make_plan(tiny_model_dir, tiny_spec.architecture, packing=False, split=[2, 2, 2], train=TRAIN,
                     lora=setup["lora"], seq_len=SEQ_LEN, hosts=["alpha", "alpha", "beta"])
    plan.save(tmp_path / "plan.json")
    port = plan.cluster.host("alpha").port - 1
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen()
        with pytest.raises(PlanError, match=rf"^--engine torch: the rendezvous port {port} on host alpha "
                                            r"is not free .*: pass another with --port$"):
            main_run([str(tmp_path / "plan.json"), "--run-dir", str(tmp_path / "run"), "--engine", "torch"])
    assert not (tmp_path / "run").exists()
    try:
        run = start(["run", "plan.json", "--engine", "torch", "--run-dir", "run", "--no-progress"], tmp_path)
        assert run.stdout is not None
        printed = ""
        while "start host beta's part there" not in printed:
            line = run.stdout.readline()
            assert line, finish(run)
            printed = line
        argv = shlex.split(printed.split(" s): ", 1)[1])
        assert argv[:3] == ["hetero", "worker", "plan.json"] and "--rendezvous" in argv  # the plan as given
        beta = start([*argv[1:], "--run-dir", "beta"], tmp_path)
        code, _, err = finish(run)
        assert code == 0, err[-3000:]
        assert finish(beta)[0] == 0
    finally:
        clean_up()
    _check_against_reference(tmp_path / "run", setup, list(range(1, TRAIN.steps + 1)))
    assert (tmp_path / "beta" / "logs" / "stage2.log").is_file()
