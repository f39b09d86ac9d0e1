"""The CPU cores this process may compute on: what CPU stages' default threads split, and what a profile records.

``os.cpu_count()`` is the machine's count. A container or a systemd slice often grants fewer: a CPU affinity
mask (``taskset``, ``docker --cpuset-cpus``) or a CFS quota (``docker --cpus=2``, Kubernetes CPU limits), under
which every thread past the quota waits for a core. Splitting the machine's 64 cores among a 2-CPU container's
stages would start 32 threads each, most of them waiting. ``usable_cores`` takes the least of the machine's
count, the affinity mask and the quota of every cgroup from this process's up to the root, cgroup v2
(``cpu.max``) or v1 (``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``), a fractional quota rounded up.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cores(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """The cores this process may use (at least 1): the machine's, its affinity mask's, its cgroups' CPU quota."""
    cores = os.cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):
        try:
            cores = min(cores, len(os.sched_getaffinity(0)) or cores)
        except OSError:
            pass
    quota = cgroup_quota(root, proc_cgroup)
    return max(1, min(cores, math.ceil(quota - 1e-9)) if quota is not None else cores)


def cgroup_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The least CPU quota, in cores, of this process's cgroups and their parents (None: no quota, or no cgroups)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    quotas: list[float] = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # cgroup v2: "0::/path", every controller in one hierarchy
            quotas += [q for d in _upward(root, path) if (q := _v2_quota(d)) is not None]
        elif "cpu" in controllers.split(","):
            mount = next((root / name for name in (controllers, "cpu,cpuacct", "cpu") if (root / name).is_dir()), None)
            if mount is not None:
                quotas += [q for d in _upward(mount, path) if (q := _v1_quota(d)) is not None]
    if not lines:  # no /proc/self/cgroup: the root's files, where the mount shows them (a container's own view)
        quotas += [q for q in (_v2_quota(root), _v1_quota(root / "cpu")) if q is not None]
    return min(quotas) if quotas else None


def _upward(mount: Path, path: str) -> list[Path]:
    """The cgroup directory of ``path`` under ``mount`` and each parent up to the mount (those that exist)."""
    parts = [p for p in path.strip("/").split("/") if p and p != ".."]
    dirs = [mount.joinpath(*parts[:k]) for k in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def _v2_quota(d: Path) -> float | None:
    """cpu.max "QUOTA PERIOD" in cores ("max": none)."""
    try:
        quota, period = (d / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else _cores(quota, period)


def _v1_quota(d: Path) -> float | None:
    """cpu.cfs_quota_us over cpu.cfs_period_us in cores (-1: none)."""
    try:
        quota, period = ((d / f"cpu.cfs_{name}_us").read_text().strip() for name in ("quota", "period"))
    except OSError:
        return None
    return _cores(quota, period)


def _cores(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None
