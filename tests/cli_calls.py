"""Support for the tests (helpers, not tests): hetero's command line called in this process, as a user types it,
and its one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetero import cli
from hetero.plan import Plan


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code: int, err: str, starts: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"hetero: error: {starts}"), lines[0]


def compile_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str], *overrides: str,
                 config_dir: Path | None = None) -> tuple[int, str, str, Plan | None]:
    out = tmp_path / "out"
    argv = ["compile", *(["-cd", str(config_dir)] if config_dir else []), f"output={out}", *overrides]
    code, stdout, err = run_main(argv, capsys)
    plan = Plan.load(out / "plan.json") if code == 0 else None
    return code, stdout, err, plan


def fleet_of(tmp_path: Path, card: str, count: int) -> Path:
    """A config dir with hardware/<card>x<count>.yaml: ``count`` cards in one box."""
    root = tmp_path / "conf"
    (root / "hardware").mkdir(parents=True)
    (root / "hardware" / f"{card}x{count}.yaml").write_text(
        f"name: {card}x{count}\nhosts:\n  - name: box\n    address: 127.0.0.1\n    devices:\n"
        f"      - type: {card}\n        count: {count}\nintra_host_bandwidth_gbps: 128\n")
    return root
