"""The `hetero` command: one-line errors with exit code 2, `show` on a hand-built plan, the text Gantt,
delegation to the runtime, and (once compiler + planner exist) `hetero compile` end to end."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from cli_calls import assert_one_line_error, run_main

from hetero import cli
from hetero.cli.show import describe_span, gantt_lines
from hetero.graph import CutEdge, LayerGraph, LayerNode, TensorSpec
from hetero.hardware import build_cluster
from hetero.plan import Baseline, MemoryBreakdown, Plan, Prediction, SolverReport, StagePlan
from hetero.planner.schedule.simulator import Event, Timeline
from hetero.specs import DataSpec, ModelSpec, PlannerOptions, TrainSpec

ROOT = Path(__file__).parents[2]


def _node(name: str, kind: str) -> LayerNode:
    return LayerNode(name, kind, [f"model.{name}.weight"], 1000, 800, 2000.0, 64, 2e6, 4e6, 512.0)  # type: ignore[arg-type]


def make_plan() -> Plan:
    """A two-stage plan on two CPU devices, built by hand (no compiler, no solver)."""
    nodes = [_node("embed", "embedding")] + [_node(f"layers.{i}", "decoder") for i in range(4)]
    nodes += [_node("norm", "norm"), _node("head", "head")]
    edges = [
        CutEdge(n.name, [TensorSpec("hidden", ["batch", "seq", 64], "float32", 256.0)]) for n in nodes[:-1]
    ]
    graph = LayerGraph("tiny", "llama", 128, "float32", "none", 64, 512, 4, nodes, edges)
    cluster = build_cluster(
        {"name": "local", "hosts": [{"name": "localhost", "devices": [{"type": "cpu", "count": 2}]}]}
    )
    train = TrainSpec(micro_batch_size=4, num_micro_batches=8)
    mem = MemoryBreakdown(0.1, 0.02, 0.3, 0.5, 0.92, 14.4)
    stages = [
        StagePlan(0, "localhost", "localhost.cpu0", "cpu", "cpu", "float32", "none", 0, 2, ["embed", "layers.0", "layers.1"],
                  "tcp://127.0.0.1:29500", 1, 0.0123, 0.0246, 0.0005, mem,
                  [a for i in range(8) for a in (f"F{i}", f"SA{i}")] + [a for i in range(8) for a in (f"RG{i}", f"B{i}")]
                  + ["STEP"]),
        StagePlan(1, "localhost", "localhost.cpu1", "cpu", "cpu", "float32", "none", 3, 6,
                  ["layers.2", "layers.3", "norm", "head"], "tcp://127.0.0.1:29501", 1, 0.015, 0.03, 0.0,
                  MemoryBreakdown(0.1, 0.02, 0.3, 0.5, 15.0, 14.4),
                  [a for i in range(8) for a in (f"RA{i}", f"F{i}", f"B{i}", f"SG{i}")] + ["STEP"]),
    ]  # fmt: skip
    pred = Prediction(0.75, 4096, 5461.3, 0.18, [0.81, 0.83], [0.92, 15.0])
    baselines = [
        Baseline("best_single_device", "all layers on the fastest device that fits", True, "", ["localhost.cpu0"], [4],
                 Prediction(1.2, 4096, 3413.3, 0.0, [1.0], [1.5])),
        Baseline("even_split", "same number of layers per device", False, "localhost.cpu1 short by 2.1 GB"),
    ]  # fmt: skip
    solver = SolverReport(
        "PULP_CBC_CMD", "Optimal", "Optimal Solution Found", True, 0.0, 0.75, 0.4, 30.0, 120, 340
    )
    return Plan(ModelSpec("tiny", {"model_type": "llama", "num_hidden_layers": 4}), cluster, train, DataSpec(),
                PlannerOptions(), graph, stages, pred, baselines, solver,
                ["2 stages beat the best single device by 1.60x."])  # fmt: skip


# --- show ---------------------------------------------------------------------------------------------


def test_show_prints_every_section_of_a_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.json"
    make_plan().save(path)
    code, out, err = run_main(["show", str(path), "--no-gantt"], capsys)
    assert code == 0, err
    assert "model tiny (4 decoder layers" in out and "fleet local (2 devices, 1 hosts)" in out
    assert "8 micro-batches x 4 sequences = 4096 tokens" in out
    # No data statistics in this plan: its tokens/s are computed tokens, and it says so.
    assert "predicted step 750.0 ms, 5461 tok/s computed (padding included: the data was not measured), " \
           "pipeline bubble 18%" in out
    assert "data: not measured; tokens/s count computed tokens, padding included" in out
    assert "embed + layers 0-1 (2L)" in out and "layers 2-3 + norm + head (2L)" in out
    assert "12.3 ms" in out and "24.6 ms" in out and "15.0 / 14.4" in out  # times, an over-full stage
    assert "best_single_device" in out and "1.60x" in out and "infeasible" in out and "short by 2.1 GB" in out
    assert "PULP_CBC_CMD: Optimal / Optimal Solution Found, proven optimal, gap 0.0%" in out
    assert "2 stages beat the best single device by 1.60x." in out


def test_show_rejects_a_plan_from_another_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.json"
    data = json.loads(make_plan().to_json())
    data["schema_version"] = 99
    path.write_text(json.dumps(data))
    code, _, err = run_main(["show", str(path)], capsys)
    assert_one_line_error(code, err, f"{path}: plan schema v99")
    code, _, err = run_main(["show", str(tmp_path / "missing.json")], capsys)
    assert_one_line_error(code, err, f"{tmp_path / 'missing.json'}: no such plan file")


def test_a_plan_directory_stands_for_its_plan_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`hetero show DIR` / `hetero run DIR`: the directory `hetero compile` wrote (was: "Is a directory")."""
    (tmp_path / "out").mkdir()
    make_plan().save(tmp_path / "out" / "plan.json")
    code, out, err = run_main(["show", str(tmp_path / "out"), "--no-gantt"], capsys)
    assert code == 0 and "model tiny (4 decoder layers" in out, err
    (tmp_path / "empty").mkdir()
    code, _, err = run_main(["run", str(tmp_path / "empty")], capsys)
    assert_one_line_error(code, err, f"{tmp_path / 'empty' / 'plan.json'}: no such plan file")


def test_gantt_places_forwards_backwards_and_idle_time() -> None:
    # 2 stages, 2 micro-batches, unit-time ops on a 10-column axis (one column per 0.1 s).
    events = [Event(0, "F", 0, 0.0, 0.1), Event(0, "SA", 0, 0.1, 0.2), Event(1, "F", 0, 0.2, 0.3), Event(0, "F", 1, 0.1, 0.2),
              Event(1, "B", 0, 0.3, 0.4), Event(1, "F", 1, 0.4, 0.5), Event(1, "B", 1, 0.5, 0.6), Event(0, "B", 0, 0.5, 0.6),
              Event(0, "B", 1, 0.7, 0.8), Event(0, "STEP", -1, 0.8, 0.9), Event(1, "STEP", -1, 0.6, 0.7)]  # fmt: skip
    rows = gantt_lines(Timeline(events, 1.0, [], 0.0), 2, width=10)
    assert rows[0] == "stage 0 |01...a.b#.|"
    assert rows[1] == "stage 1 |..0a1b#...|"
    assert rows[2].rstrip().endswith("1.00 s")


def test_describe_span_names_layer_ranges() -> None:
    graph = make_plan().graph
    assert describe_span(graph, 0, 6) == "embed + layers 0-3 + norm + head"
    assert describe_span(graph, 4, 4) == "layer 3"


def test_show_draws_the_simulated_schedule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    fake = types.ModuleType("hetero.planner.schedule.simulator")
    fake.simulate_plan = lambda plan: Timeline([Event(0, "F", 0, 0.0, 0.5), Event(1, "F", 0, 0.5, 1.0)], 1.0, [], 0.0)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "hetero.planner.schedule.simulator", fake)
    path = tmp_path / "plan.json"
    make_plan().save(path)
    code, out, err = run_main(["show", str(path), "--width", "8"], capsys)
    assert code == 0, err
    assert "stage 0 |0000....|" in out and "stage 1 |....0000|" in out


# --- errors and delegation ------------------------------------------------------------------------------


def test_config_errors_are_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["compile", "model=llama9b"], capsys)
    assert_one_line_error(code, err, "unknown model 'llama9b'; available: deepseek_v2_lite, gemma3_12b, glm45_air, "
                          "glm4_9b, gpt_oss_120b, gpt_oss_20b, hf, llama4_scout, llama70b")
    fleets = tmp_path / "fleets" / "hardware"
    fleets.mkdir(parents=True)
    (fleets / "typo.yaml").write_text("hosts:\n  - name: a\n    devices: [{type: rtx9090}]\n")
    (fleets / "broken.yaml").write_text("hosts:\n  - name: a\n    devices: [{type: rtx3090\n")
    code, _, err = run_main(["compile", "-cd", str(tmp_path / "fleets"), "hardware=typo"], capsys)
    assert_one_line_error(code, err, "unknown GPU type 'rtx9090' in hardware.hosts[0].devices[0] (a typo of rtx5090?); "
                                     "closest of the")
    code, _, err = run_main(["compile", "--config-dir", str(tmp_path / "fleets"), "hardware=broken"], capsys)
    assert_one_line_error(code, err, f"{fleets / 'broken.yaml'}:")
    assert "malformed YAML" in err
    code, _, err = run_main(["compile", "model=llama8b", "hardware=homelab", "planner.split=[16,8]"], capsys)
    assert_one_line_error(code, err, "planner.split [16, 8] covers 24 decoder layers but llama8b has 32")
    code, _, err = run_main(["inspect", "train.micro_batch_size=four"], capsys)
    assert_one_line_error(code, err, "train.micro_batch_size must be an integer, got 'four'")


def test_runtime_commands_get_their_argv_verbatim(monkeypatch, capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[tuple[str, list[str]]] = []
    fake = types.ModuleType("hetero.runtime.cli")
    fake.main_run = lambda argv: calls.append(("run", argv)) or 0  # type: ignore[attr-defined]
    fake.main_worker = lambda argv: calls.append(("worker", argv)) or 3  # type: ignore[attr-defined]
    fake.main_generate = lambda argv: calls.append(("generate", argv)) or None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "hetero.runtime.cli", fake)
    assert cli.main(["run", "plan.json", "train.steps=5", "--help"]) == 0
    assert cli.main(["worker", "--host", "strix"]) == 3
    assert cli.main(["generate", "-h"]) == 0
    assert calls == [("run", ["plan.json", "train.steps=5", "--help"]), ("worker", ["--host", "strix"]),
                     ("generate", ["-h"])]  # fmt: skip


def test_missing_runtime_says_not_built(monkeypatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "hetero.runtime.cli", None)  # makes the import fail
    code, _, err = run_main(["run", "plan.json"], capsys)
    assert_one_line_error(code, err, "hetero.runtime.cli.main_run is not built yet")


def test_ctrl_c_exits_130(monkeypatch, capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(*args: object, **kwargs: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_show", interrupted)
    assert cli.main(["show", "plan.json"]) == 130


# --- end to end (needs hetero.compiler.trace, hetero.planner.plan, hetero.compiler.emit) ------------------


def _hetero(args: list[str], cwd: Path, **env_vars: str) -> subprocess.CompletedProcess[str]:
    from procs import run_hetero

    return run_hetero(args, cwd, COLUMNS="160", **env_vars)


THREE_BOXES = """name: three_boxes
hosts:
  - {name: tower, address: 192.168.1.10, devices: [{type: rtx3090}, {type: rtx3080}]}
  - {name: nas, address: 192.168.1.11, devices: [{type: v100_16gb}]}
  - name: laptop
    address: 192.168.1.12
    devices:  # an RTX 4060 Laptop GPU: 3072 CUDA cores at ~2.37 GHz, 8 GB at 256 GB/s
      - {type: rtx4060ti_16gb, memory_gb: 8, memory_bandwidth_gbs: 256, tflops_fp32: 14.6, tflops_fp16: 29.1,
         tflops_bf16: 29.1}
links:
  - {a: tower, b: nas, bandwidth_gbps: 1, latency_us: 200}
  - {a: tower, b: laptop, bandwidth_gbps: 1, latency_us: 200}
  - {a: nas, b: laptop, bandwidth_gbps: 1, latency_us: 200}
"""


def test_a_device_worth_little_is_named_with_how_to_leave_it_out(tmp_path: Path) -> None:
    """The tower (3090 + 3080), NAS (V100) and laptop of issue 53 on 1 GbE: the laptop relays a few layers over a
    second hop for ~2 %; the verdict says so with the key that drops it, and planner.exclude plans without it."""
    (tmp_path / "fleets" / "hardware").mkdir(parents=True)
    (tmp_path / "fleets" / "hardware" / "three_boxes.yaml").write_text(THREE_BOXES)
    args = ["compile", "-cd", str(tmp_path / "fleets"), "hardware=three_boxes", "model=llama8b"]
    done = _hetero([*args, "output=all"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    verdict = json.loads((tmp_path / "all" / "plan.json").read_text())["verdict"]
    named = [line for line in verdict if "adds little" in line]
    assert len(named) == 1 and named[0].startswith("laptop.rtx4060ti_16gb0 adds little: without it"), verdict
    ratio = float(re.search(r"\((\d\.\d\d)x;", named[0]).group(1))  # type: ignore[union-attr]
    assert ratio < 1.05 and named[0].endswith("recompile with planner.exclude=[laptop.rtx4060ti_16gb0]"), named
    done = _hetero([*args, "output=less", "planner.exclude=[laptop.rtx4060ti_16gb0]"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    plan = json.loads((tmp_path / "less" / "plan.json").read_text())
    assert "laptop" not in {s["host"] for s in plan["stages"]} and len(plan["stages"]) == 3
    step = plan["prediction"]["step_time_s"]
    assert re.search(rf"without it the plan takes {step:.3g} s/step", named[0]), (step, named)
    bad = _hetero([*args, "output=bad", "planner.exclude=[laptop.gpu9]"], tmp_path)
    assert bad.returncode == 2 and "planner.exclude names unknown device(s) ['laptop.gpu9']" in bad.stderr, bad.stderr


def test_compile_refuses_data_run_could_not_use_in_one_line(tmp_path: Path) -> None:
    """An explicit data.path that is missing, or of another format than data.format, stops the compile (exit 2, one
    line, the setting that reads it) instead of a plan whose run fails at its first step (issue 53)."""
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "a"},
                                                                  {"role": "assistant", "content": "b"}]}) + "\n")
    # Prompts longer than seq_len: every response is cut away, and the run would stop at its first step.
    (tmp_path / "long.jsonl").write_text("".join(json.dumps({"instruction": "word " * 400, "output": "b"}) + "\n"
                                                 for _ in range(3)))
    for data, said in (("missing.jsonl", "data.path 'missing.jsonl': no such file"),
                       ("chat.jsonl", "this file has 'messages': use data.format=chat"),
                       ("long.jsonl", "data.path 'long.jsonl': no record keeps a label token after truncation to "
                                      "seq_len=128 (the prompts fill the rows): raise model.seq_len or "
                                      "data.train_on_prompt=true")):
        done = _hetero(["compile", "model=tiny", "hardware=local", f"data.path={data}", "output=out"], tmp_path)
        assert done.returncode == 2 and said in done.stderr, done.stderr[-2000:]
        assert [ln for ln in done.stderr.splitlines() if ln.strip()] == [done.stderr.strip()], done.stderr
        assert not (tmp_path / "out" / "plan.json").exists()


@pytest.mark.parametrize(
    ("model", "hardware", "devices"), [("tiny", "local", {"localhost.cpu0", "localhost.cpu1"}),
                                       ("llama8b", "homelab", {"desktop.rtx5090_0", "strix.strix_halo0"})]
)  # fmt: skip
def test_compile_end_to_end(
    tmp_path: Path, model: str, hardware: str, devices: set[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # micro_batch_size=1: at seq 2048, four sequences of llama8b activations do not fit the 5090's stage.
    args = [f"model={model}", f"hardware={hardware}", "output=out", "planner.time_limit_s=20", "train.micro_batch_size=1"]
    # Every warning switched on: none of torch's / transformers' may reach the terminal (they go to the logs;
    # the README main command's `hetero run` is checked the same way by test_runtime_failures' reference run).
    result = _hetero(["compile", *args], tmp_path, PYTHONWARNINGS="always")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Warning" not in result.stdout + result.stderr, result.stderr[-3000:]
    plan = Plan.load(tmp_path / "out" / "plan.json")
    assert plan.model.name == model and plan.config["hardware"]["name"] == hardware
    # The one change after plan(): the keys, which need the chosen stages' hosts (hetero.cli.compile_config).
    assert plan.security.mode == ("token" if hardware == "local" else "curve")
    assert (tmp_path / "out" / "artifacts" / plan.stages[0].host / "keys" / "stage0.key").is_file()
    assert {s.device for s in plan.stages} <= devices
    for rep in plan.pipelines:  # every node on exactly one stage of each pipeline replica, in order
        covered = [i for k in rep.stages for a, b in plan.stages[k].spans() for i in range(a, b + 1)]
        assert sorted(covered) == list(range(len(plan.graph.nodes)))  # (interleaved: chunks in virtual-stage order)
    assert "predicted step" in result.stdout and "plan.json" in result.stdout
    code, out, err = run_main(["show", str(tmp_path / "out" / "plan.json")], capsys)  # in-process: no 2nd startup
    assert code == 0, err
    assert "stage 0 |" in out


def test_compile_too_big_for_the_fleet_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["compile", "model=llama70b", "hardware=mixed_fleet", f"output={tmp_path / 'out'}"],
                            capsys)  # in-process: the subprocess path is test_compile_end_to_end's
    assert code == 2, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hetero: error: "), err
    assert "GB" in lines[0]  # the infeasibility message gives the numbers
    assert not (tmp_path / "out" / "plan.json").exists()


def test_compile_help_lists_models_fleets_and_keys_with_defaults() -> None:
    out = subprocess.run([sys.executable, "-m", "hetero.cli", "compile", "--help"], capture_output=True, text=True,
                         timeout=60).stdout
    for name in ("llama8b", "llama70b", "tiny", "hf", "homelab", "mining_rig", "mixed_fleet", "local"):
        assert name in out, name
    for key in ("train.*", "micro_batch_size=4", "planner.*", "recompute=auto", "replicas=null", "lora.*", "r=8",
                "data.*", "format=alpaca", "eval.*", "every=0", "profile=null", "seq_len=128",
                "DIR/hardware/NAME.yaml"):
        assert key in out, key
    top = subprocess.run([sys.executable, "-m", "hetero.cli", "--help"], capture_output=True, text=True,
                         timeout=60).stdout
    assert "mining_rig" in top and "llama8b" in top and "hetero compile --help" in top


def test_library_warnings_go_to_the_log_and_heteros_own_still_print(tmp_path: Path, monkeypatch, capsys) -> None:
    import warnings

    from hetero.runtime.base import warnings_log

    # A fresh router over Python's own hook (an earlier cli.main in this process installed one); restored after.
    monkeypatch.setattr(warnings, "showwarning", getattr(warnings.showwarning, "original", warnings.showwarning))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    router = warnings_log.route_to_log()
    assert warnings_log.route_to_log() is router  # installed once
    library = "/usr/lib/python3/site-packages/transformers/modeling_utils.py"
    ours = str(ROOT / "runtime" / "stage.py")
    warnings.showwarning("kept until the log is known", FutureWarning, library, 1)
    warnings_log.log_to(tmp_path / "run" / "logs" / "warnings.log")
    warnings.showwarning("straight to the log", DeprecationWarning, library, 2)
    with warnings.catch_warnings(record=True) as shown:  # what the original showwarning shows
        router("a hetero warning", UserWarning, ours, 3)
        router("another library's", UserWarning, library, 4)
    logged = (tmp_path / "run" / "logs" / "warnings.log").read_text()
    assert "FutureWarning: kept until the log is known" in logged and "DeprecationWarning: straight" in logged
    assert "another library's" in logged and "hetero warning" not in logged
    assert [str(w.message) for w in shown] == ["a hetero warning"]
    assert "Warning" not in capsys.readouterr().err


def test_config_dir_and_multirun_may_come_anywhere_on_the_line(monkeypatch) -> None:
    """Hydra's users write `-cd DIR` and `-m` after overrides too; argparse alone took them only first
    (`unrecognized arguments: output=x`)."""
    calls: list[tuple[str | None, list[str], bool]] = []
    monkeypatch.setattr(cli, "cmd_compile", lambda d, o, multirun=False: calls.append((d, o, multirun)) or 0)
    monkeypatch.setattr(cli, "cmd_inspect", lambda d, o: calls.append((d, o, False)) or 0)
    assert cli.main(["compile", "model=tiny", "-cd", "fleets", "output=x"]) == 0
    assert cli.main(["compile", "model=tiny", "lr=1e-4,2e-4", "-m", "--config-dir=fleets"]) == 0
    assert cli.main(["inspect", "model=tiny", "--config-dir", "fleets"]) == 0
    assert calls == [("fleets", ["model=tiny", "output=x"], False), ("fleets", ["model=tiny", "lr=1e-4,2e-4"], True),
                     ("fleets", ["model=tiny"], False)]
