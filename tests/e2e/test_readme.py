"""The README gives a newcomer exactly two commands, and CI runs the README's test command verbatim."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()


def _commands(text: str) -> list[str]:
    """Every line inside a ```bash fence."""
    blocks = re.findall(r"```(?:bash|sh|console)\n(.*?)```", text, flags=re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def _between(marker: str) -> str:
    m = re.search(rf"<!-- {marker} -->\n```bash\n(.*?)\n```\n<!-- /{marker} -->", README, flags=re.S)
    assert m, f"README.md lacks the {marker} block"
    return m.group(1)


def test_readme_has_exactly_two_commands() -> None:
    commands = _commands(README)
    assert len(commands) == 2, commands
    main, tests = _between("main-command"), _between("test-command")
    assert commands == [main, tests]
    assert main.startswith(
        "pip install torch==2.13.0 && pip install -e . && hetero compile model=tiny hardware=local"
    )
    assert tests == "pip install torch==2.13.0 && pip install -e '.[dev]' && python -m pytest -q"
    for doc in ("docs/quickstart.md", "docs/fleet.md", "docs/reading-a-plan.md"):
        assert doc in README and (ROOT / doc).is_file()


def _fake_tools(bin_dir: Path, log: Path) -> None:
    bin_dir.mkdir()
    for tool in ("pip", "python"):
        script = bin_dir / tool
        script.write_text(f'#!/bin/sh\necho "{tool} $*" >> "{log}"\n')
        script.chmod(0o755)


def test_ci_runs_the_readme_test_command(tmp_path: Path) -> None:
    # Run a copy of .ci/run against the real README with pip/python replaced by loggers.
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    log = tmp_path / "calls.log"
    _fake_tools(tmp_path / "bin", log)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "HETERO_CI_NO_INSTALL": "1"}
    result = subprocess.run(
        ["bash", str(tmp_path / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert log.read_text().splitlines() == [
        "pip install torch==2.13.0",
        "pip install -e .[dev]",
        "python -m pytest -q",
    ]


def test_ci_follows_an_edited_readme(tmp_path: Path) -> None:
    # If the README's test command changes, CI runs the new one (and a failing one fails CI).
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    edited = README.replace(_between("test-command"), "echo ran > marker && false")
    (tmp_path / "README.md").write_text(edited)
    result = subprocess.run(
        ["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, timeout=60,
        env={**os.environ, "HETERO_CI_NO_INSTALL": "1"},
    )
    assert result.returncode != 0
    assert (tmp_path / "marker").read_text().strip() == "ran"


def test_every_relative_link_in_the_docs_resolves() -> None:
    """A link from README.md or docs/ to a file of this repository (not a web page) names one that exists."""
    dead = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            path = target.split("#", 1)[0]
            if not path or re.match(r"[a-z]+:", path):
                continue
            resolved = (doc.parent / path).resolve()
            if not resolved.exists() or ROOT.resolve() not in resolved.parents:
                dead.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not dead, dead
