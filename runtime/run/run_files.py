"""report.json and environments.json: the run directory's two JSON files besides metrics.jsonl, versioned, with this
module their one writer and reader.

- ``report.json``: the end-of-run report (runtime/run/report.py builds it): measured against predicted step time,
  trained tokens/s, per-stage busy time, the moves. One JSON object carrying ``"format": REPORT_FORMAT``.
- ``environments.json``: each stage's environment from its hello, keyed ``stage0``, ``stage1``, ...: host, pid,
  python, torch, devices, package versions; beside them ``"format": ENVIRONMENTS_FORMAT``.

A file written before the format field (format 0) reads as it was: the fields are the same. A file of a later
format is refused in one line. Readers outside hetero (a user's script, the end-to-end tests) read the JSON as it is:
``envs["stage1"]["pid"]`` holds in every format.

Torch-free: only JSON and the run directory's atomic writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hetero.errors import ConfigError
from hetero.runtime.base.rundir import write_run_file

REPORT = "report.json"
ENVIRONMENTS = "environments.json"
REPORT_FORMAT = 1
ENVIRONMENTS_FORMAT = 1
_FORMATS = {REPORT: REPORT_FORMAT, ENVIRONMENTS: ENVIRONMENTS_FORMAT}


def write_report(run_dir: Path, report: dict[str, Any]) -> Path:
    """report.json, whole or not at all."""
    return _write(Path(run_dir) / REPORT, report)


def write_environments(run_dir: Path, environments: dict[str, Any]) -> Path:
    """environments.json, whole or not at all (values JSON cannot hold are written as their str)."""
    return _write(Path(run_dir) / ENVIRONMENTS, environments)


def read_report(run_dir: Path) -> dict[str, Any]:
    """report.json's fields (its format dropped); a ConfigError naming the file if it is not one this hetero reads."""
    return _read(Path(run_dir) / REPORT)


def read_environments(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Each stage's environment, ``{"stage0": {...}, ...}``; a ConfigError naming the file if it is not one."""
    path = Path(run_dir) / ENVIRONMENTS
    data = _read(path)
    bad = next((k for k, v in data.items() if not (k.startswith("stage") and isinstance(v, dict))), None)
    if bad is not None:
        raise ConfigError(f"{path}: {bad!r} is not a stage's environment: the file is damaged; a run rewrites it "
                          "when its stages greet")
    return data


def stage_pids(run_dir: Path) -> dict[int, int]:
    """The pid of each stage that reported one (``hetero run`` forks its stages; a worker host's stages are its own)."""
    pids = {}
    for name, env in read_environments(run_dir).items():
        if name[len("stage"):].isdigit() and isinstance(env.get("pid"), int):
            pids[int(name[len("stage"):])] = env["pid"]
    return dict(sorted(pids.items()))


def _write(path: Path, data: dict[str, Any]) -> Path:
    fmt = _FORMATS[path.name]
    write_run_file(path.parent, path.name, json.dumps({"format": fmt, **data}, indent=1, default=str))
    return path


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror or exc}): is this a run directory?") from None
    except ValueError as exc:
        raise ConfigError(f"{path}: not JSON ({exc}): the file is damaged; it is rewritten by the next run") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a JSON object: the file is damaged; it is rewritten by the next run")
    fmt, known = data.pop("format", 0), _FORMATS[path.name]
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt > known:
        raise ConfigError(f"{path}: format {str(fmt)[:20]}, this hetero reads {path.name} of format {known} and "
                          "earlier: read it with the hetero that wrote it")
    return data
