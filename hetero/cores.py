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


def usable_cores(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup"),
                 mountinfo: Path = Path("/proc/self/mountinfo")) -> int:
    """The cores this process may use (at least 1): the machine's, its affinity mask's, its cgroups' CPU quota."""
    cores = os.cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):
        try:
            cores = min(cores, len(os.sched_getaffinity(0)) or cores)
        except OSError:
            pass
    quota = cgroup_quota(root, proc_cgroup, mountinfo)
    return max(1, min(cores, math.ceil(quota - 1e-9)) if quota is not None else cores)


def cgroup_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup"),
                 mountinfo: Path = Path("/proc/self/mountinfo")) -> float | None:
    """The least CPU quota, in cores, of this process's cgroups and their parents (None: no quota, no cgroups, or
    files it may not read: never an error, since every fleet with CPU devices asks)."""
    try:
        return _least_quota(root, proc_cgroup.read_text().splitlines() if proc_cgroup.exists() else [],
                            _mount_roots(mountinfo))
    except OSError:
        return None


def _least_quota(root: Path, lines: list[str], roots: dict[str, str]) -> float | None:
    quotas: list[float] = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # cgroup v2: "0::/path", every controller in one hierarchy
            quotas += [q for d in _upward(root, _inside(root, path, roots)) if (q := _v2_quota(d)) is not None]
        elif "cpu" in controllers.split(","):
            mount = next((root / name for name in (controllers, "cpu,cpuacct", "cpu") if (root / name).is_dir()), None)
            if mount is not None:
                quotas += [q for d in _upward(mount, _inside(mount, path, roots)) if (q := _v1_quota(d)) is not None]
    if not lines:  # no /proc/self/cgroup: the root's files, where the mount shows them (a container's own view)
        quotas += [q for q in (_v2_quota(root), _v1_quota(root / "cpu")) if q is not None]
    return min(quotas) if quotas else None


def _mount_roots(mountinfo: Path) -> dict[str, str]:
    """Each cgroup mount point and the cgroup its root is (/proc/self/mountinfo's fourth field): in a container
    without its own cgroup namespace /proc/self/cgroup gives the host's path, which the mount shows from that root."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return {}
    roots = {}
    for line in lines:
        fields, _, after = line.partition(" - ")
        parts = fields.split()
        if len(parts) >= 5 and after.split()[:1] in (["cgroup"], ["cgroup2"]):
            roots[parts[4]] = parts[3]
    return roots


def _inside(mount: Path, path: str, roots: dict[str, str]) -> str:
    """``path`` (from /proc/self/cgroup) relative to what ``mount`` shows."""
    top = roots.get(str(mount)) or roots.get(os.path.realpath(mount), "/")
    if top not in ("", "/") and (path == top or path.startswith(top.rstrip("/") + "/")):
        return path[len(top.rstrip("/")):] or "/"
    return path


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
