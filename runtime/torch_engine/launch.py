"""The launcher side of `--engine torch`: one torch launcher per host, started by `hetero run`.

`torch.distributed.launcher.api.elastic_launch` is what `torchrun` runs: a rendezvous, one worker per rank on
its host, their exit watched. hetero uses the static rendezvous (`torchrun --rdzv-backend=static`): its TCP
store holds plain keys and JSON; the dynamic ones (c10d, etcd) keep serialized Python objects in the store,
and nothing here deserializes objects a socket holds.

On one host the rendezvous takes a free port of 127.0.0.1. On several, each host is a node (node 0 is stage
0's host, where `hetero run` runs: rank 0, the rendezvous and the run's records), the rendezvous listens on the
coordinator port of that host's plan address, and every process binds its collectives to the interface that
holds its host's plan address (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``). `hetero run` starts the
launcher of each host with ``ssh:`` in the fleet file as `hetero worker --engine torch` over ssh (stopped
with the run, as hetero's own workers are: runtime/run/ssh.py), and prints the command for the others.

Ranks other than 0 write their output to RUN_DIR/logs/torch (a host's own run directory elsewhere); rank 0
draws the progress bar. The run's records are rank 0's files (metrics.jsonl, checkpoints, adapter), read back
here into the RunResult the end-of-run report is made from.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetero.errors import PlanError
from hetero.plan import Plan
from hetero.runtime.base.processes import StageFailedError
from hetero.runtime.run.records import RunResult
from hetero.runtime.torch_engine.network import addresses, answers, bind_collectives, rendezvous

RENDEZVOUS_TIMEOUT_S = 600.0  # how long node 0 waits for every host's launcher (started by hand, too)
REMOTE_REPORT_S = 10.0
# A host's launcher checks node 0's rendezvous store every WATCH_PERIOD_S, and stops its ranks when it has not
# answered for LOST_AFTER_S (node 0 notices a host that dropped through ssh's keep-alives: 3 x 5 s).
WATCH_PERIOD_S, LOST_AFTER_S = 2.5, 15.0  # after a failure here, how long to wait for a failed host's own line
# What a rank says when another rank (or its host) went away first: a consequence, not the cause.
CONSEQUENCE = re.compile(r"closed by peer|Connection reset|Broken pipe|[Tt]imed out|Socket Timeout|ECONNRESET|"
                         r"Connection refused|DistNetworkError|terminated with signal SIGTERM|SIGTERM")


@dataclass(frozen=True)
class Node:
    """One host's torch launcher: its node rank, the rendezvous and the processes it starts."""

    plan: Plan
    rank: int  # node rank: the host's index in rank_order's host order
    host: str
    endpoint: str  # ADDRESS:PORT of the static rendezvous (node 0's TCP store)
    address: str  # this host's address: the agent's, and (through its interface) the collectives'
    run_dir: Path  # where this host writes its logs (rank 0's host: the run directory)

    @property
    def ranks(self) -> list[int]:
        """The global ranks this host runs, in order."""
        from hetero.runtime.torch_engine.rank import rank_order

        order = rank_order(self.plan)
        return [r for r, k in enumerate(order) if self.plan.stages[k].host == self.host]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(node: Node, nodes: int) -> Any:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    local = len(node.ranks)
    quiet = range(1, local) if node.rank == 0 else range(local)  # global rank 0 keeps the terminal
    logs = DefaultLogsSpecs(log_dir=str(node.run_dir / "logs" / "torch"), redirects={r: Std.ALL for r in quiet})
    return LaunchConfig(min_nodes=nodes, max_nodes=nodes, nproc_per_node=local, run_id=f"hetero-{node.plan.input_hash}",
                        rdzv_backend="static", rdzv_endpoint=node.endpoint,
                        rdzv_configs={"rank": node.rank, "timeout": int(RENDEZVOUS_TIMEOUT_S)}, max_restarts=0,
                        monitor_interval=0.1, start_method="spawn", logs_specs=logs, local_addr=node.address)


_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b:?")


def _error_line(text: str) -> str:
    """A traceback's exception line (with the next line when its message starts on a new line), on one line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    found = [i for i, ln in enumerate(lines) if _EXCEPTION.match(ln)]
    if not found:
        return lines[-1] if lines else ""
    i = found[-1]
    words = lines[i] if not lines[i].endswith(":") or i + 1 >= len(lines) else f"{lines[i]} {lines[i + 1]}"
    return re.sub(r"\s+", " ", words)


def _failure(exc: BaseException, node: Node) -> str:
    """The first failed rank's error, in one line: which rank (its stage and host), its exception's last line or
    how it ended, and where its logs are. A rank that only saw another go away comes after one that did not."""
    from hetero.runtime.torch_engine.rank import rank_order

    logs = node.run_dir / "logs"
    order = rank_order(node.plan)
    said = {rank: _said(failure) for rank, failure in (getattr(exc, "failures", {}) or {}).items()}
    if said:
        rank = min(said, key=lambda r: (bool(CONSEQUENCE.search(said[r][0])), said[r][1], r))
        line = said[rank][0]
        where = f" (stage {order[rank]} on host {node.host})" if 0 <= rank < len(order) else ""
        return f"rank {rank}{where} failed: {line[:400]} (logs: {logs})"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first} (logs: {logs})"


def _said(failure: Any) -> tuple[str, float]:
    """(one line: how a rank ended, when) from torch's ProcessFailure: a signal's name, else its exception."""
    code = getattr(failure, "exitcode", None)
    if isinstance(code, int) and code < 0:
        try:
            return f"ended by signal {signal.Signals(-code).name}", float(getattr(failure, "timestamp", 0) or 0)
        except ValueError:
            pass
    message = str(getattr(failure, "message", "") or "")
    data = getattr(failure, "error_file_data", None)
    inner = data.get("message") if isinstance(data, dict) else None
    if isinstance(inner, dict):
        message = str(inner.get("message", message))
    elif isinstance(inner, str) and inner and inner != "<NONE>":
        message = inner
    line = _error_line(message) if message and message != "<NONE>" else ""
    return line or f"exit code {code}", float(getattr(failure, "timestamp", 0) or 0)


def _launch(node: Node, nodes: int, entry_args: tuple[Any, ...]) -> None:
    """Run this host's ranks to the end; raises StageFailedError (one line) if one fails."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from hetero.runtime.torch_engine.rank import rank_main

    # A failed rank is one line below (with where its log is), not the launcher's own tracebacks.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    (node.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    from torch.distributed import DistError
    from torch.distributed.elastic.rendezvous import RendezvousError

    try:
        elastic_launch(_config(node, nodes), rank_main)(*entry_args)
    except ChildFailedError as exc:
        raise StageFailedError(f"--engine torch: {_failure(exc, node)}") from None
    except (RendezvousError, DistError, TimeoutError) as exc:  # before any rank started: the hosts never met
        said = _error_line(str(exc)) or type(exc).__name__
        others = "every host's launcher" if node.rank == 0 else "node 0"
        raise StageFailedError(f"--engine torch: host {node.host} could not meet {others} at the rendezvous "
                               f"{node.endpoint}: {said[:300]}") from None


# -- `hetero run`'s side ------------------------------------------------------------------------------------


def run_torch(plan: Plan, plan_path: Path, run_dir: Path, backend: str, resume: Path | None, progress: bool,
              timeout_s: float, *, port: int | None = None, ssh_hosts: list[Any] | None = None,
              trusted: bool = False, compiled: Path | None = None) -> RunResult:
    """Train ``plan`` on torch.distributed.pipelining; raises StageFailedError (one line) if a rank fails.

    ``compiled``: the plan file as the user named it (what a host started by hand runs; default ``plan_path``)."""
    from hetero.runtime.base.rundir import latest_checkpoint
    from hetero.runtime.run.metrics_file import NAME, read_metrics
    from hetero.runtime.torch_engine.rank import node_hosts

    hosts = node_hosts(plan)
    entry = (str(plan_path), str(run_dir), backend, str(resume) if resume is not None else None, progress, timeout_s)
    if len(hosts) == 1:
        _launch(Node(plan, 0, hosts[0], f"127.0.0.1:{_free_port()}", "127.0.0.1", run_dir), 1, entry)
    else:
        where = addresses(plan, trusted)
        endpoint = rendezvous(plan, port, where[hosts[0]])
        bind_collectives(backend, hosts[0], where[hosts[0]])
        node = Node(plan, 0, hosts[0], endpoint, where[hosts[0]], run_dir)
        _run_hosts(node, len(hosts), entry, ssh_hosts or [], trusted, compiled or plan_path)
    result = RunResult()
    result.steps = read_metrics(run_dir / NAME).steps
    result.checkpoint = latest_checkpoint(run_dir)
    return result


def node_args(endpoint: str, timeout_s: float, trusted: bool) -> list[str]:
    """`hetero worker PLAN --host NAME` arguments that make a host's torch launcher join this run."""
    return ["--engine", "torch", "--rendezvous", endpoint, "--timeout", f"{timeout_s:g}",
            *(["--trusted-network"] if trusted else [])]


def _run_hosts(node: Node, nodes: int, entry: tuple[Any, ...], ssh_hosts: list[Any], trusted: bool,
               compiled: Path) -> None:
    """Node 0: start (or name) every other host's launcher, run this host's ranks, and end with the run."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from hetero.runtime.run.ssh import SshWorkers
    from hetero.runtime.torch_engine.rank import node_hosts

    plan = node.plan
    extra = node_args(node.endpoint, entry[-1], trusted)
    workers = SshWorkers(ssh_hosts, node.run_dir)
    workers.launch(lambda name: [*extra, "--run-dir", workers.remote_run_dir(name), "--watch-stdin"])
    if workers.procs:
        print(f"hetero run: started hosts {', '.join(sorted(workers.procs))} over ssh (their output: "
              f"{node.run_dir / 'logs'}/host-*.log)", flush=True)
    for name in node_hosts(plan)[1:]:
        if name not in workers.procs:
            argv = ["hetero", "worker", str(compiled), "--host", name, *extra]
            print(f"hetero run: start host {name}'s part there, with its copy of the plan (within "
                  f"{RENDEZVOUS_TIMEOUT_S:g} s): {shlex.join(argv)}", flush=True)
    stopper = Stopper()
    threading.Thread(target=_watch, args=(workers, stopper), daemon=True, name="ssh-hosts").start()
    try:
        with _sigterm_raises():
            _launch(node, nodes, entry)
    except StageFailedError as exc:
        stopper.finish()
        raise StageFailedError(_root_cause(str(exc), workers, stopper)) from None
    except SignalException:
        stopper.finish()
        if stopper.reasons:  # a host's launcher failed and the watcher stopped this one: that host's line
            raise StageFailedError(stopper.reasons[0][1]) from None
        raise  # Ctrl-C or SIGTERM from outside: stopped at once
    finally:
        stopper.finish()
        workers.stop()


class Stopper:
    """How a watcher thread ends this host's part of the run, once, for one reason: it ends the ranks (torch's
    launcher then reports them failed, and the main thread names the reason), or, before any rank exists (the
    rendezvous), this process (SIGTERM, raised in the main thread as torch's SignalException). Never a signal
    to this process once its ranks ran: it could land in the main thread's own handling of their end."""

    def __init__(self) -> None:
        self.reasons: list[tuple[str, str]] = []  # (what, one line)
        self._lock = threading.Lock()
        self._over = False
        self._ranks_seen = False

    def stop(self, what: str, line: str) -> None:
        with self._lock:
            if self._over or self.reasons:
                return
            self.reasons.append((what, line))
            ranks = _rank_processes()
            self._ranks_seen = self._ranks_seen or bool(ranks)
            for pid in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            if not self._ranks_seen:
                os.kill(os.getpid(), signal.SIGTERM)

    def note_ranks(self) -> None:
        if not self._ranks_seen and _rank_processes():
            self._ranks_seen = True

    def finish(self) -> None:
        with self._lock:
            self._over = True


def _rank_processes() -> list[int]:
    """This process's children that are torch launcher ranks (multiprocessing spawn); not its ssh clients."""
    me, found = str(os.getpid()), []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if fields[1] == me and fields[0] != "Z":
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if b"spawn_main" in f.read():
                        found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises torch's SignalException in the main thread from now on, as torch's launcher makes it do once
    its ranks start: before that (the rendezvous) SIGTERM would end this process without a word. The handler
    before is put back after."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def raise_it(signum: int, frame: Any) -> None:
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    before = signal.signal(signal.SIGTERM, raise_it)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _watch(workers: Any, stopper: Stopper) -> None:
    """Stop this host's ranks when a host's ssh session fails (its launcher failed, or it dropped off)."""
    while not stopper.reasons:
        stopper.note_ranks()
        ended = workers.ended()
        if ended is not None:
            stopper.stop(ended[0], _host_line(workers, *ended))
            return
        time.sleep(0.5)


def _host_line(workers: Any, host: str, ended: str) -> str:
    """What host ``host``'s launcher said when it failed (its one line), else how its ssh session ended."""
    from hetero.runtime.base.processes import last_error_line

    said = last_error_line(workers.log(host))
    if said is None and ended.startswith("ssh failed"):  # ssh's own exit (255): the connection, not the host's ranks
        said = ("its ssh session ended (ssh exit 255): the host stopped answering ssh's keep-alives or dropped off "
                "the network")
    said = said or ended
    said = re.sub(r"^(--engine torch: )", "", said)
    return f"--engine torch: {said}" if f"host {host}" in said else f"--engine torch: host {host}: {said}"


def _root_cause(local: str, workers: Any, stopper: Stopper) -> str:
    """The line that names the first failure: a rank here, or a host's own line when a rank here only saw
    another go away (its connection closed) or was ended by the watcher."""
    if stopper.reasons:
        return stopper.reasons[0][1]
    if not CONSEQUENCE.search(local):
        return local
    deadline = time.monotonic() + REMOTE_REPORT_S
    while time.monotonic() < deadline:
        ended = workers.ended()
        if ended is not None:
            return _host_line(workers, *ended)
        time.sleep(0.2)
    return f"{local}; a rank on another host may have failed first (see that host's logs)"


# -- a host's side: `hetero worker PLAN --host NAME --engine torch --rendezvous ADDRESS:PORT` -----------------


def serve_torch_node(plan_path: Path, plan: Plan, host: str, run_dir: Path, endpoint: str, timeout_s: float,
                     watch_stdin: bool, trusted: bool) -> int:
    """Run this host's ranks of a multi-host torch-engine run; one line and exit 1 if one fails."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from hetero.runtime.torch_engine.rank import node_hosts
    from hetero.runtime.torch_engine.support import check_supported

    backend = check_supported(plan, None)
    hosts = node_hosts(plan)
    if host not in hosts:
        raise PlanError(f"host '{host}' runs no stage of this plan; its stages run on: {', '.join(hosts)}")
    where = addresses(plan, trusted)
    bind_collectives(backend, host, where[host])
    stopper = Stopper()
    if watch_stdin:
        threading.Thread(target=_stop_on_eof, args=(stopper,), daemon=True, name="stdin").start()
    threading.Thread(target=_watch_rendezvous, args=(endpoint, stopper), daemon=True, name="rendezvous").start()
    node = Node(plan, hosts.index(host), host, endpoint, where[host], run_dir)
    print(f"hetero worker: host {host} runs ranks {node.ranks} of --engine torch (logs in {run_dir / 'logs'}); "
          f"rendezvous {endpoint}", flush=True)
    try:
        with _sigterm_raises():
            _launch(node, len(hosts), (str(plan_path), str(run_dir), backend, None, False, timeout_s))
    except (SignalException, StageFailedError) as exc:
        stopper.finish()
        what, line = stopper.reasons[0] if stopper.reasons else ("", "")
        if what == "eof":  # `hetero run` ended (or its ssh session is gone): nothing to report to it
            return 0
        if what == "lost" or isinstance(exc, SignalException):
            raise StageFailedError(f"--engine torch: host {host}: {line or 'its launcher was stopped by SIGTERM'}; "
                                   "stopped its ranks") from None
        raise
    finally:
        stopper.finish()
    return 0


def _watch_rendezvous(endpoint: str, stopper: Stopper) -> None:
    """Stop this host's ranks when node 0's rendezvous port has not accepted a connection for LOST_AFTER_S: that
    host dropped off the network (or its launcher is gone), and the ranks here would wait for it until their
    timeout. A bare TCP connect (network.answers): the store's own requests wait forever on a silent peer."""
    silent_since = None
    while not stopper.reasons:
        time.sleep(WATCH_PERIOD_S)
        stopper.note_ranks()
        failed = answers(endpoint, WATCH_PERIOD_S)
        if failed is None:
            silent_since = None
            continue
        silent_since = silent_since or time.monotonic()
        if time.monotonic() - silent_since >= LOST_AFTER_S:
            stopper.stop("lost", f"node 0's rendezvous {endpoint} has not answered for {LOST_AFTER_S:g} s "
                                 f"({failed.strerror or type(failed).__name__})")
            return


def _stop_on_eof(stopper: Stopper) -> None:
    """Stop this host's ranks when stdin ends (`hetero run`'s ssh session is gone, or it ended the run)."""
    from hetero.runtime.run.host import _wait_for_eof

    _wait_for_eof(threading.Event())
    with contextlib.suppress(OSError):
        print("hetero worker: stdin closed (`hetero run` ended or its ssh session dropped): stopping", flush=True)
    stopper.stop("eof", "stdin closed")
