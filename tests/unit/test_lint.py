"""STYLE.md's gates, kept by the test suite so they cannot drift: ruff everywhere, mypy on hetero/, planner/,
runtime/wire/ and runtime/run/."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff not installed (pip install -e '.[dev]')")
def test_ruff_is_clean() -> None:
    proc = _run(["ruff", "check", "."])
    assert proc.returncode == 0, proc.stdout[-4000:]


def test_mypy_is_clean_on_the_typed_packages() -> None:
    pytest.importorskip("mypy", reason="mypy not installed (pip install -e '.[dev]')")
    # The contracts, the planner, and the runtime's wire and run (the coordinator, its collaborators, the run's
    # records). Cold: ~11 s (pyproject.toml skips following torch and transformers).
    proc = _run([sys.executable, "-m", "mypy", "hetero", "planner", "runtime/wire", "runtime/run"])
    assert proc.returncode == 0, proc.stdout[-4000:]


# docs/architecture.md "Size": a reader sees a function on one screen, a class as one room, a file as one subject.
MOST_FUNCTION_LINES, MOST_CLASS_LINES, MOST_FILE_LINES = 60, 250, 500
SIZED = ("hetero", "compiler", "runtime", "planner")


def oversized(root: Path = ROOT) -> list[str]:
    """Every function, class and file past its size in the packages (files in bench/ too)."""
    import ast

    found = []
    for folder in (*SIZED, "bench"):
        for path in sorted((root / folder).rglob("*.py")):
            text, rel = path.read_text(), path.relative_to(root)
            if text.count("\n") > MOST_FILE_LINES:
                found.append(f"{rel}: {text.count(chr(10))} lines (file, most {MOST_FILE_LINES})")
            if folder == "bench":
                continue
            for node in ast.walk(ast.parse(text, str(path))):
                if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if isinstance(node, ast.ClassDef) and size > MOST_CLASS_LINES:
                    found.append(f"{rel}:{node.lineno} class {node.name}: {size} lines (most {MOST_CLASS_LINES})")
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > MOST_FUNCTION_LINES:
                    found.append(f"{rel}:{node.lineno} {node.name}(): {size} lines (most {MOST_FUNCTION_LINES})")
    return found


def test_no_function_class_or_file_is_past_its_size(tmp_path: Path) -> None:
    assert oversized() == []
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "big.py").write_text("class Big:\n" + "    x = 1\n" * 260)
    assert oversized(tmp_path) == ["runtime/big.py:1 class Big: 261 lines (most 250)"]


def test_no_test_file_imports_another() -> None:
    """Helpers live in tests/' support modules (docs/architecture.md "Tests"): a test file that imports another
    one runs that file's module fixtures and imports beside its own, and ties the two files' edits together."""
    import ast

    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert found == []
