"""runtime/env.py: stage processes keep freed tensor memory instead of faulting it in every step."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

_PROBE = """
import resource, sys, torch
from hetero.runtime.env import keep_freed_memory
applied = keep_freed_memory()
x = torch.randn(4, 128, 688)  # 1.4 MB: a W1 MLP activation

def step():  # a forward keeps activations, its backward frees them all
    kept = [x * 2.0 for _ in range(30)]
    del kept

for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(int(applied), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(env_value: str) -> tuple[bool, int]:
    env = {"HETERO_MALLOC_TUNING": env_value, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, check=True)
    applied, faults = out.stdout.split()
    return applied == "1", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="glibc's mallopt only")
def test_freed_activations_are_reused_without_page_faults() -> None:
    applied, tuned = _faults("1")
    off, default = _faults("0")
    assert applied and not off
    # Default glibc hands the freed 42 MB back to the kernel at the end of every step and faults it in
    # again in the next (~10,000 pages per step); tuned, the next step reuses it.
    assert default > 5 * 5000
    assert tuned < default / 10
