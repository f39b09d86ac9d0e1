"""`hetero show --hosts` and the end of `hetero compile` for a plan over several hosts: per host, what to install,
which ports to open (a re-plan's included), what to copy there (the plan and that host's folder, its keys only),
and the command to run there (docs/running.md, "Each box, before the first run")."""

from __future__ import annotations

import shlex
from pathlib import Path

from hetero.plan import Plan
from hetero.runtime.pretrained import TINY  # built on each box from its recipe: no weights to fetch


def host_lines(plan: Plan, plan_path: Path) -> list[str]:
    """One block of lines per host that runs a stage, the coordinator's host first."""
    coordinator = plan.stages[0].host
    used = [h for h in plan.cluster.hosts if any(s.host == h.name for s in plan.stages)]
    used.sort(key=lambda h: h.name != coordinator)
    out_dir = plan_path.parent
    lines: list[str] = []
    for host in used:
        stages = [s for s in plan.stages if s.host == host.name]
        role = "coordinator; " if host.name == coordinator else ""
        devices = ", ".join(f"stage {s.index} on {s.device} ({s.backend})" for s in stages)
        lines.append(f"host {host.name} ({host.address}; {role}{devices})")
        lines.append(f"  install: {_install(plan, host.name)}")
        lines.append(f"  open ports: {_ports(plan, host.name, host.port, coordinator)}")
        folder = out_dir / "artifacts" / host.name
        what = f"{plan_path} and {folder}/ (this host's keys only)"
        if host.name == coordinator:
            lines.append(f"  needs: {what}; the data file (data.path) where this host reads it")
            lines.append(f"  run: hetero run {plan_path}")
        else:
            target = f"{host.ssh.target}:{host.ssh.plan_dir or '~/' + out_dir.name}" if host.ssh else f"{host.name}:DIR"
            lines.append(f"  copy: {what}, keeping the layout: rsync -aR {shlex.quote(str(plan_path))} "
                         f"{shlex.quote(str(folder))}/ {target}/ (from this directory)")
            there = f"hetero worker {plan_path} --host {host.name}"
            started = "started by `hetero run` over ssh" if host.ssh else f"run there, from DIR: {there}"
            lines.append(f"  {started}; check first: {there} --check")
    return lines


def _install(plan: Plan, host: str) -> str:
    stages = [s for s in plan.stages if s.host == host]
    cards = sorted({plan.cluster.device(s.device).display_name for s in stages if s.backend != "cpu"})
    backends = {s.backend for s in stages}
    torch = ("a CUDA build of torch whose kernels cover " + ", ".join(cards) if "cuda" in backends else
             "a ROCm build of torch for " + ", ".join(cards) if "rocm" in backends else
             "torch (the CPU build will do)")
    parts = [f"hetero {plan.hetero_version}", torch]
    if any(s.quantization != "none" for s in stages):
        parts.append("bitsandbytes")
    source = str(plan.model.pretrained or plan.model.name)
    if source != TINY:
        parts.append(f"the weights at {source} (a local directory on this box)" if source.startswith(("/", ".", "~"))
                     else f"the weights in its Hugging Face cache (hf download {source})")
    return "; ".join(parts)


def _ports(plan: Plan, host: str, base: int, coordinator: str) -> str:
    listens = sorted(int(s.endpoint.rsplit(":", 1)[1]) for s in plan.stages if s.host == host)
    text = ", ".join(map(str, listens)) + f" (TCP, in from the other hosts); a re-plan may use {base}-" \
        f"{base + len(plan.stages) - 1}"
    if host == coordinator:
        text += f"; the coordinator {base - 1}"
    return text
