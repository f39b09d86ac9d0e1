"""`hetero run` starts the `hetero worker` of every host whose fleet entry has ``ssh:`` (docs/running.md).

Before anything starts, ``check_ssh_hosts`` runs ``hetero worker --check`` on each such host (same
plan hash, same hetero version, its keys present). ``SshWorkers`` then starts one ``ssh HOST python
-m hetero.cli worker ... --watch-stdin`` per host, its output going to RUN_DIR/logs/host-<name>.log.

Nothing outlives the run: ssh keeps the remote worker's stdin open for as long as the local ssh
client lives, and the worker stops its stages when that stdin closes. Closing the pipe to ssh
(``SshWorkers.stop``), ssh exiting, or `hetero run` dying (even by SIGKILL: the kernel closes the pipe)
all close it; no terminal (``ssh -t``) is needed. A host cut off from the network still ends when its
stages stop hearing the coordinator (runtime.failure_timeout_s).
"""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetero import __version__
from hetero.errors import HeteroError
from hetero.plan import Plan
from hetero.runtime.base.processes import last_line, module_argv
from hetero.security import is_loopback
from hetero.specs import SshSpec

CHECK_PREFIX = "hetero-check: "  # the line `hetero worker --check` answers with (a login banner may precede it)
CHECK_TIMEOUT_S = 60.0  # ssh's ConnectTimeout, a login, and one Python import of hetero
STOP_GRACE_S = 15.0  # after its stdin closes, a remote worker stops its stages (SIGTERM after 3 s, SIGKILL 5 s later)
# BatchMode: never ask for a password or a host key (`hetero run` is not interactive); keep-alives end a
# session whose host went away. Options given in the fleet file come first: ssh takes an option's first value.
SSH_OPTIONS = ("BatchMode=yes", "ConnectTimeout=10", "ServerAliveInterval=5", "ServerAliveCountMax=3")


class RemoteHostError(HeteroError):
    """A host that `hetero run` starts over ssh cannot run its part of the plan (one line, what to fix)."""


@dataclass(frozen=True)
class SshHost:
    """A host `hetero run` starts over ssh, and where that host has the plan file."""

    name: str
    ssh: SshSpec
    plan: str  # the plan file's path on that host (``~/`` means that host's home)
    local_dir: Path  # the plan's directory here (what to copy there)

    @property
    def plan_dir(self) -> str:
        return self.plan.rsplit("/", 1)[0] or "/"


def ssh_hosts(plan: Plan, plan_path: Path, local_host: str) -> list[SshHost]:
    """The hosts with stages and ``ssh:`` settings, other than this one, in the fleet's order."""
    used = {s.host for s in plan.stages}
    local_dir = plan_path.resolve().parent
    out = []
    for host in plan.cluster.hosts:
        if host.ssh is None or host.name == local_host or host.name not in used:
            continue
        there = host.ssh.plan_dir.rstrip("/") if host.ssh.plan_dir else str(local_dir)
        out.append(SshHost(host.name, host.ssh, f"{there or '/'}/{plan_path.name}", local_dir))
    return out


def remote_word(text: str) -> str:
    """``text`` quoted for the remote shell, except a leading ``~/`` (that host's home, as in the fleet file)."""
    if text == "~":
        return "~"
    if text.startswith("~/"):
        return "~/" + shlex.quote(text[2:]) if text[2:] else "~/"
    return shlex.quote(text)


def ssh_argv(ssh: SshSpec, command: list[str]) -> list[str]:
    """The local ``ssh`` command line that runs ``command`` (a list of words) on the host."""
    argv = ["ssh"]
    for option in [*ssh.options, *SSH_OPTIONS]:
        argv += ["-o", option]
    if ssh.port is not None:
        argv += ["-p", str(ssh.port)]
    if ssh.identity is not None:
        argv += ["-i", str(Path(ssh.identity).expanduser())]
    return [*argv, "--", ssh.target, " ".join(remote_word(word) for word in command)]


def worker_command(host: SshHost, *args: str) -> list[str]:
    """``python -u -m hetero.cli worker PLAN --host NAME ARGS...`` as run on ``host`` (from its home directory,
    which may hold the clone of hetero: module_argv)."""
    return [*module_argv("hetero.cli", host.ssh.python, ("-u",)), "worker", host.plan, "--host", host.name, *args]


# -- on the remote host: `hetero worker PLAN --host NAME --check` ------------------------------------------


def check_report(plan_path: Path, host: str) -> str:
    """One line for `hetero run`'s check: this hetero's version, the plan's hash, or why this host cannot run."""
    from hetero.runtime.run.box_check import box_problems
    from hetero.runtime.run.host import check_host

    report: dict[str, Any] = {"hetero_version": __version__, "python": sys.executable,
                              "plan": str(plan_path.resolve()), "input_hash": None, "error": None}
    try:
        plan = Plan.load(plan_path)
        report["input_hash"] = plan.input_hash
        check_host(plan_path, plan, host)
        # Another plan's hash is the one thing to say (copy the plan); else what else this box lacks.
        report["problems"] = box_problems(plan_path, plan, host)
    except HeteroError as exc:
        report["error"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        report["missing"] = not plan_path.is_file()
    return CHECK_PREFIX + json.dumps(report)


def said_problems(line: str) -> list[str]:
    """The problems a ``check_report`` line names (its error, else what the box lacks), for a person to read."""
    report = json.loads(line[len(CHECK_PREFIX):])
    if report.get("error"):
        return [str(report["error"])]
    return [str(p) for p in report.get("problems") or []]


# -- on this host: checking and starting the remote workers --------------------------------------------------


def _copy_hint(host: SshHost) -> str:
    port = f"-e 'ssh -p {host.ssh.port}' " if host.ssh.port is not None else ""
    return (f"copy {host.local_dir} there, e.g. `rsync -a {port}{shlex.quote(str(host.local_dir))}/ "
            f"{host.ssh.target}:{remote_word(host.plan_dir)}/`")


def _check_one(host: SshHost) -> subprocess.CompletedProcess | str:
    argv = ssh_argv(host.ssh, worker_command(host, "--check"))
    try:
        return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace",
                              timeout=CHECK_TIMEOUT_S)
    except FileNotFoundError:
        return "`ssh` (the OpenSSH client) is not installed on this host"
    except subprocess.TimeoutExpired:
        return f"`{shlex.join(argv)}` did not answer within {CHECK_TIMEOUT_S:g} s"


def _problem(plan: Plan, host: SshHost, done: subprocess.CompletedProcess | str) -> tuple[str | None, str | None]:
    """(the error, a warning) of one host's check."""
    where = f"host {host.name} ({host.ssh.target})"
    if isinstance(done, str):
        return f"{where}: {done}", None
    out, err = done.stdout or "", done.stderr or ""
    lines = [ln for ln in out.splitlines() if ln.startswith(CHECK_PREFIX)]
    if not lines:
        said = last_line(err) or last_line(out) or f"exit code {done.returncode}"
        if done.returncode == 255:
            fix = "fix its ssh settings in the fleet file (ssh runs with BatchMode=yes: no password prompt)"
            if "Host key verification failed" in said:
                fix = (f"connect once with `ssh {host.ssh.target}` to accept its host key (or add "
                       "StrictHostKeyChecking=accept-new to its ssh options)")
            elif "Permission denied" in said:
                fix = (f"set up key authentication (`ssh-copy-id {host.ssh.target}`, or ssh.identity in the "
                       "fleet file): hetero runs ssh with BatchMode=yes, which never asks for a password")
            return f"cannot reach {where} over ssh: {said}: {fix}", None
        if "No module named hetero" in err or "No module named 'hetero" in err:
            return (f"hetero is not installed for {host.ssh.python} on {where}: install it there "
                    "(pip install hetero), or set ssh.python to the interpreter that has it"), None
        if done.returncode == 127 or "No such file or directory" in said or "not found" in said:
            return (f"{where} has no {host.ssh.python} ({said}): set ssh.python in the fleet file to the "
                    "interpreter that has hetero"), None
        if "--check" in err:
            return (f"{where} runs a hetero without `hetero worker --check` ({said}): install hetero "
                    f"{__version__} there"), None
        return f"{where}: `hetero worker --check` failed: {said}", None
    try:
        report = json.loads(lines[-1][len(CHECK_PREFIX):])
    except ValueError:
        return f"{where}: `hetero worker --check` answered {lines[-1][:120]!r}: install hetero {__version__} there", None
    warning = None
    if report.get("hetero_version") != __version__:
        warning = (f"hetero run: {where} runs hetero {report.get('hetero_version')}, this host {__version__}: "
                   "install the same version on every host if the run fails")
    if report.get("missing"):
        return f"{where} has no {host.plan}: {_copy_hint(host)}", warning
    if report.get("error"):
        return f"{where}: {report['error']}", warning
    if report.get("input_hash") != plan.input_hash:
        return (f"{where} has another {Path(host.plan).name} at {host.plan} (hash {report.get('input_hash')}, "
                f"this one {plan.input_hash}): {_copy_hint(host)}"), warning
    problems = report.get("problems")
    if isinstance(problems, list) and problems:
        return "\n".join(f"{where}: {p}" for p in problems), warning  # one line each
    return None, warning


def check_ssh_hosts(plan: Plan, hosts: list[SshHost], local_host: str) -> None:
    """Ask every ssh host, in parallel, whether it can run its part; raise RemoteHostError if one cannot.

    Each problem is one line: all but the last are printed, the last is raised (the CLI prints it)."""
    if not hosts:
        return
    here = plan.cluster.host(local_host).address
    far = [h for h in hosts if not is_loopback(plan.cluster.host(h.name).address)]
    if is_loopback(here) and far:
        other = plan.cluster.host(far[0].name)
        raise RemoteHostError(f"the coordinator's host {local_host} has address {here}, where host {other.name} "
                              f"({other.address}) cannot reach it: give {local_host} an address {other.name} "
                              "reaches in the fleet file and recompile")
    with ThreadPoolExecutor(max_workers=min(8, len(hosts))) as pool:
        results = list(pool.map(_check_one, hosts))
    problems = []
    for host, done in zip(hosts, results, strict=True):
        problem, warning = _problem(plan, host, done)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        if problem:
            problems += problem.splitlines()
    for problem in problems[:-1]:
        print(f"hetero: error: {problem}", file=sys.stderr, flush=True)
    if problems:
        raise RemoteHostError(problems[-1])


class SshWorkers:
    """The `hetero worker` of each ssh host of a run: started, watched, and stopped with the run."""

    def __init__(self, hosts: list[SshHost], run_dir: Path) -> None:
        self.hosts = {h.name: h for h in hosts}
        self.run_dir = run_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def log(self, name: str) -> Path:
        return self.run_dir / "logs" / f"host-{name}.log"

    def remote_run_dir(self, name: str) -> str:
        """Where that host's worker writes its stage logs: PLAN_DIR/runs/<this run directory's name>."""
        return f"{self.hosts[name].plan_dir.rstrip('/')}/runs/{self.run_dir.resolve().name}"

    def start(self, coordinator: str) -> None:
        """Start every host's worker, told to reach the coordinator at ``coordinator``."""
        self.launch(lambda name: ["--coordinator", coordinator, "--run-dir", self.remote_run_dir(name), "--watch-stdin"])

    def launch(self, args_for: Callable[[str], list[str]]) -> None:
        """Start ``hetero worker PLAN --host NAME ARGS`` on every host, ``args_for(NAME)`` its arguments."""
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        for name, host in self.hosts.items():
            argv = ssh_argv(host.ssh, worker_command(host, *args_for(name)))
            with open(self.log(name), "ab") as log:
                log.write(f"+ {shlex.join(argv)}\n".encode())
                log.flush()
                # stdin: a pipe nobody writes to; its end is the remote worker's signal to stop. A new session:
                # a terminal's Ctrl-C reaches `hetero run` only, which checkpoints before stopping hosts.
                self.procs[name] = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log,
                                                    stderr=subprocess.STDOUT, start_new_session=True)

    def ended(self, hosts: set[str] | None = None) -> tuple[str, str] | None:
        """(host, one line) for the first ssh session (of ``hosts``, default all) that ended with an error, or None."""
        for name, proc in self.procs.items():
            if hosts is not None and name not in hosts:
                continue  # a host the run went on without (runtime.elastic)
            code = proc.poll()
            if code is not None and code != 0:
                from hetero.runtime.base.processes import exit_cause, last_error_line

                said = last_error_line(self.log(name)) or last_line(self.log(name).read_text(errors="replace"))
                cause = "ssh failed" if code == 255 else exit_cause(code)
                return name, f"{cause}: {said}" if said else cause
        return None

    def wait(self, timeout_s: float) -> None:
        """Give every session up to ``timeout_s`` to end by itself."""
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Close every session's stdin (the remote worker stops its stages), then end what is left."""
        for proc in self.procs.values():
            try:
                if proc.stdin is not None:
                    proc.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)  # ssh closes the connection: the remote side sees EOF too
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
