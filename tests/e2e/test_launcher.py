"""`hetero run`'s stage launcher (runtime/run/launcher.py) when things go wrong before its stages start:
nothing may be left running, and the failure is one line. (Every run test covers the working path.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetero.specs import ModelSpec

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the launcher forks (Linux only)")

# Runs in a fresh interpreter: the launcher refuses to fork a process that already has threads.
SCRIPT = """
import json, os, signal, sys
from pathlib import Path
from hetero.runtime.run.launcher import StageLauncher
from hetero.runtime.base.processes import StageFailedError

launcher = StageLauncher.start(json.loads(sys.argv[1]))
assert launcher is not None, "no launcher on Linux"
pid, outcome = launcher.pid, "unused"
if sys.argv[2] == "killed":
    os.kill(pid, signal.SIGKILL)  # dies while importing (out of memory, a crash)
    try:
        launcher.spawn(Path(sys.argv[3]) / "plan.json", [0, 1], Path(sys.argv[3]), "tcp://127.0.0.1:9")
        outcome = "spawned"
    except StageFailedError as exc:
        outcome = str(exc)
launcher.close()
try:
    os.kill(pid, 0)
    alive = True
except ProcessLookupError:
    alive = False
try:
    os.waitpid(-1, os.WNOHANG)
    children = True
except ChildProcessError:
    children = False
print(json.dumps({"outcome": outcome, "launcher_alive": alive, "children": children}))
"""


def _run(tiny_spec: ModelSpec, mode: str, tmp_path: Path) -> dict:
    arch = json.dumps(tiny_spec.architecture)
    result = subprocess.run([sys.executable, "-c", SCRIPT, arch, mode, str(tmp_path)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_an_unused_launcher_is_ended_and_reaped(tiny_spec: ModelSpec, tmp_path: Path) -> None:
    # `hetero run` refused in a check after the launcher was forked: no process may outlive it.
    got = _run(tiny_spec, "unused", tmp_path)
    assert got == {"outcome": "unused", "launcher_alive": False, "children": False}


def test_a_launcher_that_died_is_one_line_and_leaves_nothing(tiny_spec: ModelSpec, tmp_path: Path) -> None:
    got = _run(tiny_spec, "killed", tmp_path)
    # It died before or after taking the request: either way the same one line.
    assert got["outcome"].startswith("could not start this host's stages: the stage launcher "), got
    assert "\n" not in got["outcome"]
    assert got["launcher_alive"] is False and got["children"] is False


def test_stages_forked_where_the_streams_have_no_descriptor_train_and_log(
        tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`hetero run` called where sys.stdout and sys.stderr are objects without a descriptor (a notebook's, pytest's
    capsys): the launcher's stages write their logs to their files and train. They died before (faulthandler asked
    for a descriptor) and said nothing: the traceback went to the parent's stream object."""
    import threading

    from plans import make_plan

    from hetero.runtime.cli import main_run
    from hetero.runtime.run import coordinator_greeting
    from hetero.specs import TrainSpec

    if threading.active_count() != 1:
        pytest.skip("a thread of another test is alive here: the launcher forks only a one-thread process")

    def fresh_interpreters(*_: object, **__: object) -> None:
        raise AssertionError("the stages started as fresh interpreters, not from the launcher")

    monkeypatch.setattr(coordinator_greeting, "spawn_stages", fresh_interpreters)
    make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3], train=TrainSpec(micro_batch_size=1, num_micro_batches=2,
                                                                             steps=1)).save(tmp_path / "plan.json")
    assert main_run([str(tmp_path / "plan.json"), "--run-dir", str(tmp_path / "run"), "--no-progress"]) == 0
    for k in (0, 1):
        log = (tmp_path / "run" / "logs" / f"stage{k}.log").read_text()
        assert f"stage {k} built in" in log and "training finished" in log, log
