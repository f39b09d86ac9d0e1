"""hetero/cores.py: the cores a CPU stage's default threads split are those this process may use (a container's
CPU quota, its affinity mask), not the machine's count: on a 64-core machine a `docker --cpus=2` container
would otherwise start 32 threads per stage, most of them waiting for a core."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from hetero.cores import cgroup_quota, usable_cores


def _v2(tmp_path: Path, limits: dict[str, str]) -> tuple[Path, Path]:
    """A cgroup v2 tree: ``limits`` maps a cgroup path to its cpu.max; this process sits in the deepest one."""
    root = tmp_path / "cgroup"
    for path, cpu_max in limits.items():
        d = root / path.strip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.max").write_text(cpu_max + "\n")
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(f"0::{max(limits, key=len)}\n")
    return root, proc


def test_a_v2_quota_rounds_up_and_the_least_of_the_parents_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    root, proc = _v2(tmp_path, {"/": "max 100000", "/docker": "250000 100000", "/docker/app": "max 100000"})
    assert cgroup_quota(root, proc) == pytest.approx(2.5)
    assert usable_cores(root, proc) == 3  # 2.5 cores: three threads each get most of one
    root, proc = _v2(tmp_path / "b", {"/": "max 100000", "/slice": "400000 100000", "/slice/job": "150000 100000"})
    assert usable_cores(root, proc) == 2
    root, proc = _v2(tmp_path / "c", {"/": "max 100000", "/free": "max 100000"})
    assert cgroup_quota(root, proc) is None and usable_cores(root, proc) == 64


def test_a_v1_quota_and_the_affinity_mask_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    root = tmp_path / "cgroup"
    job = root / "cpu,cpuacct" / "kubepods" / "pod1"
    job.mkdir(parents=True)
    (job / "cpu.cfs_quota_us").write_text("200000\n")
    (job / "cpu.cfs_period_us").write_text("100000\n")
    (job.parent / "cpu.cfs_quota_us").write_text("-1\n")  # the parent sets none
    (job.parent / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text("4:memory:/kubepods/pod1\n3:cpu,cpuacct:/kubepods/pod1\n0::/\n")
    assert usable_cores(root, proc) == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)  # taskset -c 0
    assert usable_cores(root, proc) == 1
    proc.write_text("3:cpu,cpuacct:/\n")  # no quota where this process is
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert usable_cores(root, proc) == 8


def test_a_container_without_its_own_cgroup_namespace_finds_its_nested_quota(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """/proc/self/cgroup gives the host's path (/docker/abc/job), the mount shows the container's subtree from
    /docker/abc (mountinfo's root field): the job's own quota of 1 core counts, not only the container's 4."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    mount = tmp_path / "cgroup" / "cpu,cpuacct"
    (mount / "job").mkdir(parents=True)
    for d, quota in ((mount, 400000), (mount / "job", 100000)):
        (d / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        (d / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text("3:cpu,cpuacct:/docker/abc/job\n")
    info = tmp_path / "mountinfo"
    info.write_text(f"36 35 0:31 /docker/abc {mount} rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n")
    assert usable_cores(tmp_path / "cgroup", proc, info) == 1
    info.write_text("")  # without mountinfo the host path is not under the mount: the container root's quota
    assert usable_cores(tmp_path / "cgroup", proc, info) == 4


def test_unreadable_or_odd_cgroup_files_leave_the_machine_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    assert usable_cores(tmp_path / "none", tmp_path / "missing") == 4
    root, proc = _v2(tmp_path, {"/": "garbage", "/x": "0 0"})
    assert cgroup_quota(root, proc) is None and usable_cores(root, proc) == 4

    def denied(self: Path) -> bool:  # a locked-down sandbox: EACCES on /sys/fs/cgroup (Path.is_dir re-raises it)
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "is_dir", denied)
    root, proc = _v2(tmp_path / "d", {"/": "200000 100000"})
    assert cgroup_quota(root, proc) is None and usable_cores(root, proc) == 4


def test_the_local_fleet_splits_a_containers_quota_not_the_machines_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    import hetero.hardware as hardware
    from hetero.config import load

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(hardware, "usable_cores", lambda: 4)
    cluster = load(["hardware=local", "hardware.num_devices=2"]).cluster
    assert [d.threads for d in cluster.devices] == [2, 2] and cluster.hosts[0].cores == 4


V1_CPU = Path("/sys/fs/cgroup/cpu")


@pytest.mark.skipif(os.geteuid() != 0 or not (V1_CPU / "cpu.cfs_quota_us").is_file(),
                    reason="needs root and the cgroup v1 cpu controller")
def test_a_real_cgroup_quota_is_seen_by_a_process_inside_it() -> None:
    """A cgroup of this machine with a quota of 1.5 cores: a Python process moved into it counts 2 usable cores
    (where the machine has 2 or more), and 1 at 0.5 cores."""
    group = V1_CPU / f"hetero-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a cgroup here: {exc}")
    try:
        seen = {}
        for quota in (150000, 50000):
            try:
                (group / "cpu.cfs_period_us").write_text("100000")
                (group / "cpu.cfs_quota_us").write_text(str(quota))
            except OSError as exc:
                pytest.skip(f"cannot set a cgroup's quota here: {exc}")
            # The child joins the group first (its own pid into cgroup.procs), then counts.
            script = (f"import os; open({str(group / 'cgroup.procs')!r}, 'w').write(str(os.getpid())); "
                      "from hetero.cores import usable_cores; print(usable_cores())")
            out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
            seen[quota] = int(out.stdout.strip())
        machine = min(os.cpu_count() or 1, len(os.sched_getaffinity(0)))
        assert seen == {150000: min(2, machine), 50000: 1}
    finally:
        try:
            group.rmdir()
        except OSError:
            pass
