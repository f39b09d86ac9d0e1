"""The coordinator's side of held-out evaluation: which device evaluates, and the client of the evaluator process.

The evaluator itself (``python -m hetero.runtime.tools.evaluator``, runtime/tools/evaluator.py) builds the whole
model on a device the plan leaves out of training; ``EvalClient`` starts it, hands it adapters and collects its
answers over a local pipe, never blocking training.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetero.errors import ConfigError, HeteroError
from hetero.plan import Plan
from hetero.runtime.base.processes import module_argv
from hetero.specs import EvalSpec

if TYPE_CHECKING:
    import torch


def eval_device_name(plan: Plan, evaluation: EvalSpec, host: str) -> str:
    """The device that evaluates: eval.device, else the first device of ``host`` no stage uses."""
    used = {s.device for s in plan.stages}
    if evaluation.device is not None:
        try:
            spec = plan.cluster.device(evaluation.device)
        except KeyError:
            raise ConfigError(f"eval.device={evaluation.device} is not a device of the plan's fleet "
                              f"'{plan.cluster.name}'") from None
        if spec.name in used:
            raise ConfigError(f"eval.device={spec.name} trains in this plan: recompile with "
                              f"`hetero compile ... eval.device={spec.name}` to keep it out of training")
        if spec.host != host:
            raise ConfigError(f"eval.device={spec.name} is on host {spec.host}; the evaluator runs on the "
                              f"coordinator's host {host}: choose one of its devices")
        return spec.name
    free = [d.name for d in plan.cluster.host(host).devices if d.name not in used]
    if not free:
        raise ConfigError(f"eval.every={evaluation.every} needs a device the plan leaves out of training; every "
                          f"device of host {host} trains: recompile with `hetero compile ... eval.device=NAME`")
    return free[0]


class EvalClient:
    """The coordinator's side: starts the evaluator process, hands it adapters, collects its answers.

    Never blocks training: a request while the previous evaluation is still running is skipped (and
    counted), answers are read by a thread and taken with ``poll``; ``finish`` waits for the last one.
    """

    def __init__(self, plan_path: Path, plan: Plan, device: str, run_dir: Path) -> None:
        import subprocess
        import threading
        from queue import Queue

        from hetero.serde import to_dict

        self.dir = run_dir / "eval"
        self.dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.log = run_dir / "logs" / "eval.log"
        self.device = device
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(
                [*module_argv("hetero.runtime.tools.evaluator"), str(plan_path), "--device", device,
                 "--eval", json.dumps(to_dict(plan.eval))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logf, text=True, start_new_session=True)
        self.answers: Queue[dict[str, Any]] = Queue()
        self.busy: int | None = None  # the step being evaluated
        self.skipped: list[int] = []
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True, name="hetero-eval-reader")
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                answer = json.loads(line)
            except ValueError:
                continue
            if isinstance(answer, dict) and answer.get("ready"):
                if answer.get("skipped"):  # held-out records left out: one line among the run's eval_errors
                    self.answers.put({"error": str(answer["skipped"])})
                self.ready.set()
            elif isinstance(answer, dict) and isinstance(answer.get("step"), int):
                self.answers.put(answer)
        self.answers.put({"exited": self.proc.wait()})

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the evaluator has built its model; a one-line HeteroError when it cannot."""
        from hetero.runtime.base.processes import last_error_line

        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(timeout=0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = last_error_line(self.log) or (f"exit code {self.proc.returncode}" if self.proc.returncode is not None
                                                else f"not ready within {timeout_s:g} s")
                raise HeteroError(f"the evaluator on {self.device} did not start: {why} (log: {self.log})")

    def request(self, step: int, lora: dict[str, torch.Tensor], wait_s: float = 0.0) -> list[dict[str, Any]]:
        """Evaluate the adapter after step number ``step`` (from 1: its answer's ``step``). While the previous evaluation still runs, wait up to
        ``wait_s`` for it, then skip this one. Returns the answers that arrived meanwhile."""
        from safetensors.torch import save_file

        arrived: list[dict[str, Any]] = []
        deadline = time.monotonic() + wait_s
        while self.busy is not None and self.proc.poll() is None and time.monotonic() < deadline:
            arrived += self.poll(timeout_s=min(1.0, max(0.01, deadline - time.monotonic())))
        if self.busy is not None or self.proc.poll() is not None or self.proc.stdin is None:
            self.skipped.append(step)
            return arrived
        path = self.dir / f"step-{step:06d}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file({k: v.contiguous() for k, v in lora.items()}, str(tmp))
        tmp.replace(path)
        try:
            self.proc.stdin.write(json.dumps({"step": step, "adapter": str(path)}) + "\n")
            self.proc.stdin.flush()
        except OSError:
            self.skipped.append(step)
            return arrived
        self.busy = step
        return arrived

    def poll(self, timeout_s: float = 0.0) -> list[dict[str, Any]]:
        """The answers that arrived (waiting up to ``timeout_s`` for the first); frees the evaluator."""
        from queue import Empty

        out: list[dict[str, Any]] = []
        try:
            while True:
                answer = self.answers.get(timeout=timeout_s) if not out and timeout_s > 0 else self.answers.get_nowait()
                if "exited" in answer:
                    self.busy = None
                    code = answer["exited"]
                    if code:
                        out.append({"error": f"the evaluator exited with code {code} (log: {self.log})"})
                    continue
                if answer.get("step") == self.busy:
                    self.busy = None
                out.append(answer)
        except Empty:
            pass
        return out

    def finish(self, timeout_s: float) -> list[dict[str, Any]]:
        """Wait (at most ``timeout_s``) for the evaluation in flight, then end the process."""
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout_s
        while self.busy is not None and self.proc.poll() is None and time.monotonic() < deadline:
            out += self.poll(timeout_s=min(1.0, max(0.01, deadline - time.monotonic())))
        out += self.poll()
        self.close()
        return out

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except Exception:
            self.proc.kill()
            self.proc.wait()
