"""What one box needs to run its part of a plan, checked before any stage starts: `hetero worker --check` (and
`hetero run`'s check of every host it starts over ssh) prints one line per problem, each with its fix.

Checked: the plan's stages and this host's keys (runtime/run/host.py check_host), the same hetero version as the
plan's, the model's weights on this box (stages read them with ``local_files_only``), bitsandbytes where a stage
quantizes, each stage's port free, and each GPU the card the fleet declares (runtime/stage/device.py card_problem:
index, model, memory, a torch build with kernels for it). Nothing here starts a process or binds a port for longer
than the check.
"""

from __future__ import annotations

import errno
import socket
from pathlib import Path

from hetero import __version__
from hetero.errors import HeteroError
from hetero.plan import Plan


def box_problems(plan_path: Path, plan: Plan, host: str) -> list[str]:
    """Every reason ``host`` (this box) cannot run its stages of ``plan``, one line each with its fix; [] when none."""
    from hetero.runtime.run.host import check_host

    try:
        check_host(plan_path, plan, host)
    except HeteroError as exc:
        if not any(s.host == host for s in plan.stages):
            return [str(exc)]  # no stage here: nothing else to check
        problems = [str(exc)]
    else:
        problems = []
    if plan.hetero_version != __version__:
        problems.append(f"this box runs hetero {__version__}, the plan was compiled by {plan.hetero_version}: install "
                        f"hetero {plan.hetero_version} here (or recompile with this version everywhere)")
    problems += _weights_problems(plan)
    problems += _quantization_problems(plan, host)
    problems += _port_problems(plan, host)
    problems += _card_problems(plan, host)
    return problems


def _weights_problems(plan: Plan) -> list[str]:
    from hetero.runtime.pretrained import TINY, resolve_dir

    if plan.model.pretrained == TINY:
        return []  # built on this box from its recipe, as the stage would
    try:
        directory = resolve_dir(plan.model)
    except HeteroError as exc:
        source = str(plan.model.pretrained)
        if source.startswith(("/", ".", "~")):  # a directory (a hub id's message says `hf download` itself)
            return [f"the model's weights are not on this box: {source} ({Path(source).expanduser()}) is missing: "
                    "copy the model's directory there (its config.json, tokenizer and *.safetensors)"]
        return [f"the model's weights: {exc}"]
    if not any(directory.glob("*.safetensors")):
        return [f"the model's weights: {directory} holds no *.safetensors file (stages read only those): download "
                f"the weights (`hf download {plan.model.pretrained}`) or convert them to safetensors"]
    return []


def _quantization_problems(plan: Plan, host: str) -> list[str]:
    quantized = sorted({s.quantization for s in plan.stages if s.host == host and s.quantization != "none"})
    if not quantized:
        return []
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:  # ImportError, and the library's own errors when its binary does not load
        text = " ".join(str(exc).split())[:160] or type(exc).__name__
        return [f"bitsandbytes does not load on this box ({text}), and a stage here quantizes "
                f"({', '.join(quantized)}): `pip install bitsandbytes` for this box's torch build"]
    return []


def _port_problems(plan: Plan, host: str) -> list[str]:
    from hetero.runtime.wire.endpoints import bind_address, endpoint_port

    problems = []
    for stage in (s for s in plan.stages if s.host == host):
        port = endpoint_port(stage.endpoint)
        try:
            address = bind_address(stage.endpoint).removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
        except HeteroError as exc:
            problems.append(f"stage {stage.index}: {exc}")
            continue
        if port is None:
            continue
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds: TIME_WAIT does not count
            try:
                probe.bind((address, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    problems.append(f"port {port} (stage {stage.index}'s inbox, {address}) is in use on this box: "
                                    f"stop what holds it (`ss -ltnp 'sport = :{port}'`), or give hosts.{host}.port "
                                    "in the fleet file another value and recompile")
                elif exc.errno == errno.EADDRNOTAVAIL:
                    problems.append(f"stage {stage.index} listens on {address}, which is not an address of this box: "
                                    f"set hosts.{host}.address in the fleet file to this box's address and recompile")
                else:
                    problems.append(f"stage {stage.index} cannot listen on {address}:{port} ({exc.strerror})")
    return problems


def _card_problems(plan: Plan, host: str) -> list[str]:
    devices = [plan.cluster.device(s.device) for s in plan.stages if s.host == host]
    if all(d.backend == "cpu" for d in devices):
        return []
    from hetero.runtime.stage.device import card_problem

    return [problem for d in devices if (problem := card_problem(d)) is not None]
