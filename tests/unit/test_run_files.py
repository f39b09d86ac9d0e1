"""report.json and environments.json (runtime/run/run_files.py): written with their format, read back as written,
older files still read, a later format or a damaged file is one line naming it, and no other module writes them."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from hetero.errors import ConfigError
from hetero.runtime.run.run_files import (
    ENVIRONMENTS,
    REPORT,
    read_environments,
    read_report,
    stage_pids,
    write_environments,
    write_report,
)

ROOT = Path(__file__).resolve().parents[2]
ENVS = {"stage0": {"host": "box", "pid": 4242, "packages": {"torch": "2.13.0"}},
        "stage1": {"host": "nas", "pid": 77, "devices": [Path("/dev/null")]}}


def test_both_files_read_back_as_written_with_their_format(tmp_path: Path) -> None:
    write_report(tmp_path, {"steps": 20, "measured_step_s": 0.35, "moves": []})
    write_environments(tmp_path, ENVS)
    raw_report = json.loads((tmp_path / REPORT).read_text())
    raw_envs = json.loads((tmp_path / ENVIRONMENTS).read_text())
    assert raw_report["format"] == 1 and raw_envs["format"] == 1
    assert raw_envs["stage0"]["pid"] == 4242 and raw_envs["stage1"]["devices"] == ["/dev/null"]  # a user's script
    assert read_report(tmp_path) == {"steps": 20, "measured_step_s": 0.35, "moves": []}
    assert read_environments(tmp_path)["stage1"] == {"host": "nas", "pid": 77, "devices": ["/dev/null"]}
    assert stage_pids(tmp_path) == {0: 4242, 1: 77}
    assert not list(tmp_path.glob(".*"))  # nothing half-written beside them


def test_a_file_from_before_the_format_reads_as_it_was(tmp_path: Path) -> None:
    (tmp_path / ENVIRONMENTS).write_text(json.dumps({"stage0": {"host": "box", "pid": 5}, "stage1": {"host": "box"}}))
    assert stage_pids(tmp_path) == {0: 5}  # a stage that reported no pid is left out
    (tmp_path / REPORT).write_text(json.dumps({"steps": 3}))
    assert read_report(tmp_path) == {"steps": 3}


@pytest.mark.parametrize("text, says", [
    ('{"format": 2, "steps": 1}', "format 2, this hetero reads report.json of format 1"),
    ('{"format": true}', "format True"),
    ('{"steps": ', "not JSON"),
    ("[1, 2]", "not a JSON object"),
])
def test_a_later_format_or_a_damaged_report_is_one_line_naming_the_file(tmp_path: Path, text: str, says: str) -> None:
    (tmp_path / REPORT).write_text(text)
    with pytest.raises(ConfigError, match=says) as err:
        read_report(tmp_path)
    assert str(tmp_path / REPORT) in str(err.value) and "\n" not in str(err.value)


def test_a_missing_or_damaged_environments_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is this a run directory"):
        stage_pids(tmp_path)
    (tmp_path / ENVIRONMENTS).write_text(json.dumps({"format": 1, "stage0": 17}))
    with pytest.raises(ConfigError, match="'stage0' is not a stage's environment"):
        read_environments(tmp_path)


def test_no_other_module_writes_or_reads_them() -> None:
    """run_files.py is their one writer and reader: elsewhere, a path built from either name is someone doing it on
    their own (tests read the JSON as a user's script would, so they are not scanned)."""
    found = []
    for folder in ("hetero", "runtime", "planner", "compiler", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel == "runtime/run/run_files.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant)
                        and node.right.value in (REPORT, ENVIRONMENTS)):
                    found.append(f"{rel}:{node.lineno}")
                if (isinstance(node, ast.Call) and any(isinstance(a, ast.Constant) and a.value in (REPORT, ENVIRONMENTS)
                                                       for a in node.args)):
                    found.append(f"{rel}:{node.lineno}")
    assert not found, f"use runtime/run/run_files.py (read_report, read_environments, stage_pids) instead: {found}"
