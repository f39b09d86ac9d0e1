"""The coordinator's conversation with every stage at once: gathering one message from each, and the handshake.

``Greeting`` is a part of ``Coordinator`` (runtime/run/coordinator.py): ``_gather`` waits for one message of a
kind from every stage and names the ones that stay silent (``_missing``: which host, and what to check there);
``_handshake`` checks every stage's hello (plan, wire version), sends the run's settings and a resumed run's state.
"""

from __future__ import annotations

import json
import time
from typing import Any

from hetero.errors import WireError
from hetero.protocol import (
    WIRE_VERSION,
    Welcome,
)
from hetero.runtime.base.processes import (
    StageFailedError,
)
from hetero.runtime.base.rundir import write_run_file
from hetero.runtime.run.options import step_timeout_hint
from hetero.runtime.wire.control import (
    is_timeout,
)
from hetero.serde import to_dict


class Greeting:
    """Messages from every stage, and the handshake (module docstring)."""

    def _gather(self, kind: str, step: int, timeout_s: float) -> dict[int, Any]:
        """One ``kind`` message for ``step`` from every stage, keyed by stage index."""
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < self.num_stages:
            try:
                msg = self.mailbox.recv(kind, step=step, timeout_s=max(0.0, deadline - time.monotonic()))
            except WireError as exc:
                if not is_timeout(exc):
                    raise
                missing = sorted(set(range(self.num_stages)) - set(got))
                raise StageFailedError(self._missing(kind, step, timeout_s, missing)) from None
            if msg.sender not in self.names:
                raise WireError(f"'{kind}' from unknown peer {msg.sender!r}")
            got[self.names.index(msg.sender)] = msg
            if kind == "start":
                self.mailbox.bounds.pop(msg.sender, None)  # built: from now on the failure bound applies
        return got

    def _missing(self, kind: str, step: int, timeout_s: float, missing: list[int]) -> str:
        """A one-line explanation of who did not answer, and what to do about it."""
        hosts = sorted({self.plan.stages[k].host for k in missing})
        remote = [h for h in hosts if h != self.host]
        what = f"stage(s) {', '.join(map(str, missing))} on {', '.join(hosts)} sent no '{kind}'"
        what += f" for step {step}" if kind not in ("hello", "start") else ""
        hint = f"see {self.run_dir / 'logs'}"
        if kind == "hello" and remote:
            hint = (f"is `hetero worker plan.json --host {remote[0]} --coordinator {self.endpoint}` running there, "
                    "and can it reach this host?")
            if self.ssh is not None and remote[0] in self.ssh.hosts:
                hint = f"can {remote[0]} reach this host? (its `hetero worker` output: {self.ssh.log(remote[0])})"
        if timeout_s == self.step_timeout_s and kind not in ("hello", "start"):  # a step's wait
            hint = step_timeout_hint(self.plan, timeout_s, hint) + (f"; {self._resume_hint()}" if self.trained else "")
        dropped = next((why for k in missing if (why := self.transport.last_rejection(self.names[k]))), None)
        if dropped:
            hint = f"a message claiming to be from it was dropped: {dropped}"
        elif kind == "hello" and (refused := self.greeting.refused()):
            hint += f"; {refused}"
        return f"{what} within {timeout_s:g} s: {hint}"

    def _handshake(self) -> None:
        """hello from every stage (same plan, same wire version), then welcome with the run settings."""
        timeout = self.options.handshake_timeout_s
        hellos = self._gather("hello", 0, timeout)
        for k, msg in sorted(hellos.items()):
            meta = msg.meta
            if meta.get("input_hash") != self.plan.input_hash or meta.get("stage") != k:
                raise StageFailedError(
                    f"stage {k} runs plan {meta.get('input_hash')} as stage {meta.get('stage')}, this coordinator "
                    f"runs {self.plan.input_hash}: restart every host with the same plan.json"
                )
            if meta.get("wire_version") != WIRE_VERSION:
                raise StageFailedError(f"stage {k} speaks wire v{meta.get('wire_version')}, this coordinator v{WIRE_VERSION}: "
                                       "install the same hetero version on every host")
            self.result.environments[f"stage{k}"] = {"host": self.plan.stages[k].host, "pid": meta.get("pid"),
                                                     **meta.get("env", {})}
            if isinstance(meta.get("pid"), int):
                self.pids.setdefault(k, int(meta["pid"]))
        write_run_file(self.run_dir, "environments.json", json.dumps(self.result.environments, indent=1, default=str))
        now = time.monotonic()
        self.mailbox.last_seen = {name: now for name in self.names}  # from now on, silence means death
        self.mailbox.bounds = {name: self.options.load_timeout_s for name in self.names}  # ... once built
        self.greeting.close()  # its watch on our own dials: the mailbox's watch takes them over
        self.mailbox.watch_connections(self.names)
        resume = None
        if self.options.resume is not None or self.options.checkpoint is not None:  # a checkpoint, or a recovery
            from hetero.runtime.run.checkpoint import load_checkpoint_union

            resume = self.options.checkpoint or load_checkpoint_union(self.options.resume)
            self.memory = resume
            self.start_step = int(resume[1]["step"])
            if self.start_step >= self.plan.train.steps:
                raise StageFailedError(f"{self.options.resume} is after step {self.start_step}, train.steps is "
                                       f"{self.plan.train.steps}: raise it (hetero run ... steps=N) to train on")
        on_stages = self.stage_eval.welcome() if self.stage_eval is not None else {}  # else the spare device's
        welcome = Welcome(train=to_dict(self.plan.train), failure_timeout_s=self.options.failure_timeout_s,
                          start_step=self.start_step, resume=resume is not None,
                          eval_every=self.payload_every, **on_stages)
        for name in self.names:
            self.transport.send(name, welcome)
        ready = self._gather("start", 0, timeout)
        if self.records.evaluator is not None:  # it built its model meanwhile
            self.records.evaluator.wait_ready(self.options.handshake_timeout_s)
        self.result.build_s = {k: float(m.meta.get("build_s", 0.0)) for k, m in ready.items()}
        self.mover.started(self.result.build_s)
        if resume is not None:
            from hetero.runtime.run.checkpoint import select_payload

            for k, msg in ready.items():
                tensors, meta = select_payload(*resume, list(msg.meta["keys"]), k)
                self.transport.send(self.names[k], "state", tensors=tensors, meta=meta)
