"""STYLE.md's gates, kept by the test suite so they cannot drift: ruff everywhere, mypy on hetero/ and planner/."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff not installed (pip install -e '.[dev]')")
def test_ruff_is_clean() -> None:
    proc = _run(["ruff", "check", "."])
    assert proc.returncode == 0, proc.stdout[-4000:]


def test_mypy_is_clean_on_the_typed_packages() -> None:
    pytest.importorskip("mypy", reason="mypy not installed (pip install -e '.[dev]')")
    proc = _run([sys.executable, "-m", "mypy", "hetero", "planner"])  # warm .mypy_cache: ~2 s; cold: ~50 s
    assert proc.returncode == 0, proc.stdout[-4000:]
