"""Support for the tests (helpers, not tests): what a finished or failed run left: its metrics, its adapter, its
one error line, its stage processes and ports."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
from metrics_rows import read_metrics, step_lines
from peft import get_peft_model_state_dict
from plans import RTOL
from procs import PIDS
from reference import assert_close_to_scale

from hetero.runtime.stage.adapter import load_adapter_state


def _port(proc: subprocess.Popen) -> str:
    args = list(proc.args)
    return str(args[args.index("--port") + 1])


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("hetero:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _stage_pids(run_dir: Path) -> list[int]:
    envs = json.loads((run_dir / "environments.json").read_text())
    pids = [int(envs[f"stage{k}"]["pid"]) for k in range(len([n for n in envs if n.startswith("stage")]))]
    PIDS.extend(pids)
    return pids


def _assert_no_process_left(run_dir: Path, pids: list[int]) -> None:
    deadline = time.monotonic() + 2.0  # the kernel may take a moment to reap
    while (any(_alive(p) for p in pids) or _processes_of(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "stage processes outlived the run"
    assert _processes_of(run_dir) == []


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return step_lines(read_metrics(path)) if path.is_file() else []


def _adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    from hetero.runtime.stage.adapter import load_adapter_state

    return load_adapter_state(run_dir / "adapter")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _processes_of(run_dir: Path) -> list[int]:
    """Every live process whose command line names this run directory (the stages name its plan.json)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(run_dir) in cmdline and _alive(int(proc.name)):
            found.append(int(proc.name))
    return found


def _check_against_reference(run_dir: Path, setup: dict, steps: list[int], rtol: float = RTOL) -> None:
    metrics = step_lines(read_metrics(run_dir / "metrics.jsonl"))
    assert [m["step"] for m in metrics] == steps
    assert all(m.get("engine") == "torch" for m in metrics)
    for m in metrics:
        want = setup["losses"][m["step"] - 1]  # steps are numbered from 1
        assert m["loss"] == pytest.approx(want, rel=rtol), f"step {m['step']}: loss {m['loss']} vs reference {want}"
    trained = load_adapter_state(run_dir / "adapter", setup["lora"])
    assert set(trained) == set(setup["state"])
    initial = load_adapter_state(Path(setup["lora"].init_from))
    for key, want in setup["state"].items():
        assert not torch.equal(initial[key], want)
        assert_close_to_scale(key, trained[key], want, rtol)


def check_loads_with_auto_peft(adapter: Path) -> None:
    """A run's adapter names a real base directory (or a hub id), so AutoPeftModelForCausalLM loads it
    with no help and generates; the loaded LoRA tensors are the adapter's."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert Path(base).is_dir() and (Path(base) / "config.json").is_file(), base
    model = AutoPeftModelForCausalLM.from_pretrained(str(adapter)).eval()
    tokenizer = AutoTokenizer.from_pretrained(base)
    ids = tokenizer("Name three colours.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5,
                             do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 5
    trained = load_adapter_state(adapter)
    loaded = get_peft_model_state_dict(model)
    assert set(loaded) == set(trained) and all(torch.equal(loaded[k], trained[k]) for k in trained)


@contextlib.contextmanager
def forgers(endpoint: str, logins: list[dict[str, bytes]], frames: list[Any]) -> Iterator[None]:
    """One forging PUSH socket per login (send_from_forger), each with ``frames`` queued; closed on exit."""
    ctx = zmq.Context()
    socks = [send_from_forger(ctx, endpoint, options, frames) for options in logins]
    try:
        yield
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()


def send_from_forger(ctx: zmq.Context, endpoint: str, options: dict[str, bytes], frames: list[Any]) -> zmq.Socket:
    """A PUSH socket with ``options`` that connects from FORGER's address and queues ``frames``."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        setattr(sock, name, value)
    sock.connect(f"tcp://{FORGER}:0;{endpoint.removeprefix('tcp://')}")
    try:
        sock.send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.Again:
        pass  # the inbox already refused this login and ZeroMQ dropped its pipe: nothing left here (CI saw it)
    return sock


FORGER = "127.0.0.2"  # the forger connects from its own loopback address, so a log naming the peer is checkable
