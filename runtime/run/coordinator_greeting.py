"""The coordinator's line to every stage: starting this host's stages, the sockets, gathering one message from each,
and the handshake.

``StageLink`` owns what the run talks to its stages through: this host's stage processes (and their pids, remote
ones' from their hello), the transport, the mailbox that watches for silence, the watch for stages of another plan
and the ssh workers. ``gather`` waits for one message of a kind from every stage and names the ones that stay
silent (which host, and what to check there). ``handshake`` checks every stage's hello (plan, wire version), sends
the run's settings and a resumed run's state. The coordinator (runtime/run/coordinator.py) holds one StageLink.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetero.errors import WireError
from hetero.plan import Plan
from hetero.protocol import WIRE_VERSION, Hello, Record, Start, Welcome
from hetero.runtime.base.processes import StageFailedError, spawn_stages, stop_processes
from hetero.runtime.run.handshake import HandshakeWatch, connect_stages
from hetero.runtime.run.options import RunOptions, step_timeout_hint, step_timeout_s
from hetero.runtime.run.run_files import write_environments
from hetero.runtime.wire.control import Mailbox, is_timeout
from hetero.runtime.wire.frames import record_of
from hetero.security import COORDINATOR
from hetero.serde import to_dict


class StageLink:
    """This host's stages started, the dials to every stage, the mailbox; see the module docstring. ``plan`` is the
    plan the stages run now (a rebalancing move changes its spans); ``resume_hint`` says how a trained run goes on
    (None before training), for the line that names a silent stage."""

    def __init__(self, plan: Plan, plan_path: Path, options: RunOptions, host: str, endpoint: str,
                 on_idle: Callable[[], None]) -> None:
        from hetero.runtime.wire.rules import coordinator_rules, max_message_bytes
        from hetero.runtime.wire.transport import Transport
        from hetero.security import install_keys, load_identity

        self.plan, self.plan_path, self.options, self.host, self.endpoint = plan, plan_path, options, host, endpoint
        self.run_dir = options.run_dir
        self.step_timeout_s = step_timeout_s(plan, options.step_timeout_s)
        self.resume_hint: Callable[[], str | None] = lambda: None
        self.ssh: Any = None  # runtime/run/ssh.py SshWorkers: the workers of the hosts started over ssh
        # This host's keys go to RUN_DIR/keys, where the local stages (started from RUN_DIR/plan.json) look.
        local_names = [COORDINATOR, *(plan.stage_id(s.index) for s in plan.stages if s.host == host)]
        install_keys(plan.security, local_names, [*options.key_dirs, self.run_dir / "keys"], self.run_dir / "keys")
        identity = load_identity(plan.security, COORDINATOR, [self.run_dir / "keys"])
        # This host's stages first: their keys are in place, and a failure below stops them.
        local = [s.index for s in plan.stages if s.host == host]
        launcher = options.launcher
        self.procs = (launcher.spawn(plan_path, local, self.run_dir, endpoint) if launcher is not None
                      else spawn_stages(plan_path, local, self.run_dir, endpoint))
        self.pids = {k: p.pid for k, p in self.procs.items()}  # stage -> pid (remote ones: from their hello)
        self.names = plan.stage_ids()
        try:
            self.transport = Transport(COORDINATOR, endpoint, plan.input_hash, recv_timeout_s=300.0,
                                       identity=identity, peer_keys=plan.security.public_keys,
                                       max_message_bytes=max_message_bytes(plan, None), rules=coordinator_rules(plan))
        except BaseException:
            stop_processes(self.procs, grace_s=0.0)
            raise
        # Before anything is read: what a stage sent under an earlier plan of this run is no misconfiguration (a lost
        # device's hello, or a message sent before the run went on under this plan).
        self.transport.inbox.returning = (set(options.earlier_plans), set(self.names))
        try:
            connect_stages(self.transport, plan, self.names)  # watched from the first attempt (handshake.py)
            self.mailbox = Mailbox(self.transport, silence_s=options.failure_timeout_s, on_idle=on_idle)
            self.greeting = HandshakeWatch(plan, self.transport, self.names, endpoint, plan_path,  # other plans
                                           earlier=set(options.earlier_plans))
        except BaseException:
            self.abandon()
            raise

    @property
    def num_stages(self) -> int:
        return len(self.names)

    def abandon(self) -> None:
        """Before the run could start: this host's stages stopped at once, the sockets closed."""
        stop_processes(self.procs, grace_s=0.0)
        if hasattr(self, "mailbox"):
            self.mailbox.close()
        self.transport.close()

    def close(self) -> None:
        self.greeting.close()
        self.mailbox.close()  # its connection monitors first: the transport's context waits for them
        self.transport.close()

    def send_all(self, record: Record | str, **fields: Any) -> None:
        for name in self.names:
            self.transport.send(name, record, **fields)

    def broadcast(self, record: Record) -> None:
        """``record`` to every stage, best effort (while shutting down)."""
        for name in self.names:
            try:
                self.transport.send(name, record)
            except Exception:  # best effort while shutting down
                pass

    def gather(self, kind: str, step: int, timeout_s: float) -> dict[int, Any]:
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
                raise StageFailedError(self.missing(kind, step, timeout_s, missing)) from None
            if msg.sender not in self.names:
                raise WireError(f"'{kind}' from unknown peer {msg.sender!r}")
            got[self.names.index(msg.sender)] = msg
            if kind == "start":
                self.mailbox.bounds.pop(msg.sender, None)  # built: from now on the failure bound applies
        return got

    def missing(self, kind: str, step: int, timeout_s: float, missing: list[int]) -> str:
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
            resume = self.resume_hint()
            hint = step_timeout_hint(self.plan, timeout_s, hint) + (f"; {resume}" if resume else "")
        dropped = next((why for k in missing if (why := self.transport.last_rejection(self.names[k]))), None)
        if dropped:
            hint = f"a message claiming to be from it was dropped: {dropped}"
        elif kind == "hello" and (refused := self.greeting.refused()):
            hint += f"; {refused}"
        return f"{what} within {timeout_s:g} s: {hint}"

    def hellos(self, environments: dict[str, Any]) -> None:
        """hello from every stage (same plan, same wire version), its environment kept in ``environments`` (and
        environments.json); from then on a silent stage is a lost one."""
        plan = self.plan
        for k, msg in sorted(self.gather("hello", 0, self.options.handshake_timeout_s).items()):
            hello = record_of(msg, Hello)
            if hello.input_hash != plan.input_hash or hello.stage != k:
                raise StageFailedError(
                    f"stage {k} runs plan {hello.input_hash} as stage {hello.stage}, this coordinator "
                    f"runs {plan.input_hash}: restart every host with the same plan.json"
                )
            if hello.wire_version != WIRE_VERSION:
                raise StageFailedError(f"stage {k} speaks wire v{hello.wire_version}, this coordinator v{WIRE_VERSION}: "
                                       "install the same hetero version on every host")
            environments[f"stage{k}"] = {"host": plan.stages[k].host, "pid": hello.pid, **(hello.env or {})}
            if hello.pid is not None:
                self.pids.setdefault(k, hello.pid)
        write_environments(self.run_dir, environments)
        now = time.monotonic()
        self.mailbox.last_seen = {name: now for name in self.names}  # from now on, silence means death
        self.mailbox.bounds = {name: self.options.load_timeout_s for name in self.names}  # ... once built
        self.greeting.close()  # its watch on our own dials: the mailbox's watch takes them over
        self.mailbox.watch_connections(self.names)


@dataclass
class Started:
    """What the handshake left: the step the run starts from, the state it resumes (None: a new run), each stage's
    build seconds."""

    start_step: int
    resume: tuple[dict[str, Any], dict[str, Any]] | None
    build_s: dict[int, float]


def handshake(link: StageLink, records: Any, welcome_fields: dict[str, Any]) -> Started:
    """hello from every stage, then welcome with the run settings (``welcome_fields``: the evaluation's), the stages'
    ``start``, and a resumed run's state to each."""
    plan, options = link.plan, link.options
    link.hellos(records.result.environments)
    resume, start_step = None, 0
    if options.resume is not None or options.checkpoint is not None:  # a checkpoint, or a recovery
        from hetero.runtime.run.checkpoint import load_checkpoint_union

        resume = options.checkpoint or load_checkpoint_union(options.resume)
        start_step = int(resume[1]["step"])
        if start_step >= plan.train.steps:
            raise StageFailedError(f"{options.resume} is after step {start_step}, train.steps is "
                                   f"{plan.train.steps}: raise it (hetero run ... steps=N) to train on")
    link.send_all(Welcome(train=to_dict(plan.train), failure_timeout_s=options.failure_timeout_s,
                          start_step=start_step, resume=resume is not None, **welcome_fields))
    ready = link.gather("start", 0, options.handshake_timeout_s)
    if records.evaluator is not None:  # it built its model meanwhile
        records.evaluator.wait_ready(options.handshake_timeout_s)
    if resume is not None:
        from hetero.runtime.run.checkpoint import select_payload

        for k, msg in ready.items():
            tensors, meta = select_payload(*resume, list(record_of(msg, Start).keys), k)
            link.transport.send(link.names[k], "state", tensors=tensors, meta=meta)
    return Started(start_step, resume, {k: float(record_of(m, Start).build_s or 0.0) for k, m in ready.items()})
