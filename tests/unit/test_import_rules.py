"""The package boundaries of DESIGN.md, checked on the source: planner/ is torch-free, runtime/ is
free of the solver, Hydra and the compiler, and nothing in runtime/ unpickles what it receives."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parents[2]

# (folder, forbidden module prefixes)
FORBIDDEN = {
    "planner": ("torch",),
    "runtime": (
        "pulp",
        "hydra",
        "hetero.compiler",
        "hetero.planner.search.ilp",
        "pickle",
        "cPickle",
        "dill",
        "cloudpickle",
    ),
}


def _imports(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """Every module a file imports, relative imports made absolute under ``package``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from .x import y / from ..compiler import z
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call):  # importlib.import_module("torch") / __import__("torch")
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if (
                name in ("import_module", "__import__")
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                found.append((node.lineno, str(node.args[0].value)))
    return found


def _matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _violations(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(ROOT / folder).with_suffix("")
        package = ".".join(["hetero", folder, *rel.parts[:-1]])
        for line, module in _imports(tree, package if rel.name != "__init__" else package):
            module = (
                module.replace(f"{folder}.", f"hetero.{folder}.", 1)
                if module.startswith(f"{folder}.")
                else module
            )
            if any(_matches(module, p) for p in forbidden):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_folder_respects_its_import_rules(folder: str) -> None:
    assert _violations(folder, FORBIDDEN[folder]) == []


def test_runtime_never_loads_received_bytes_with_torch_load() -> None:
    # torch.load unpickles: a peer could run code on this host. Tensors travel as raw bytes + header.
    bad = []
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("load", "loads")
                and isinstance(node.value, ast.Name)
            ):
                if node.value.id in ("torch", "pickle", "dill", "marshal"):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {node.value.id}.{node.attr}")
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == "torch"
                and any(a.name == "load" for a in node.names)
            ):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports torch.load")
    assert bad == []


def test_checker_catches_violations(tmp_path: Path) -> None:
    # The rules above must be able to fail: feed the checker sources that break them.
    tree = ast.parse("import torch.nn\nfrom ..compiler import trace\nimportlib.import_module('pulp')\n")
    modules = [m for _, m in _imports(tree, "hetero.runtime")]
    assert any(_matches(m, "torch") for m in modules)
    assert any(_matches(m, "hetero.compiler") for m in modules)
    assert any(_matches(m, "pulp") for m in modules)


def test_importing_the_planner_does_not_load_torch() -> None:
    code = "import sys, hetero.planner, hetero.planner.schedule.simulator; assert 'torch' not in sys.modules, 'torch loaded'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_coordinator_does_not_load_pulp() -> None:
    # The coordinator re-plans a rebalancing run with the planner's cost table, search and simulator, and
    # writes the run's profile with its cost model: none of that may pull in PuLP (DESIGN.md: runtime never
    # imports pulp). The ILP module is imported only when the ILP runs.
    # A run that lost a device re-plans in the coordinator too (runtime.elastic: planner/replan/recovery.py).
    code = ("import sys, hetero.runtime.run.coordinator, hetero.runtime.run.moves, hetero.runtime.run.run_profile, "
            "hetero.runtime.run.elastic, hetero.planner.replan.rebalance, hetero.planner.replan.recovery; "
            "assert 'pulp' not in sys.modules, 'pulp loaded'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def _contract_modules() -> list[str]:
    """Every module of the hetero/ folder, found by walking it, but the CLI package (hetero.cli)."""
    names = []
    for path in sorted((ROOT / "hetero").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[:2] == ["hetero", "cli"]:
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_contract_module_imports_without_torch() -> None:
    # hetero/ holds the torch-free contracts the planner (never torch) and the CLI read; the runtime's and
    # the compiler's torch code lives in their own folders.
    modules = _contract_modules()
    assert {"hetero", "hetero.plan", "hetero.specs", "hetero.config"} <= set(modules)  # the walk found them
    assert not any(m.startswith("hetero.cli") for m in modules)
    code = (
        "import importlib, sys\n"
        "sys.modules['torch'] = None  # any import of torch now raises ImportError\n"
        "try:\n    import torch\nexcept ImportError:\n    pass\nelse:\n    sys.exit('torch is still importable')\n"
        "failed = []\n"
        f"for name in {modules!r}:\n"
        "    try:\n        importlib.import_module(name)\n"
        "    except Exception as exc:\n        failed.append(f'{name}: {type(exc).__name__}: {exc}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"cannot import without torch:\n{result.stdout}{result.stderr[-2000:]}"


def test_the_contracts_reach_no_layer_above_them() -> None:
    """Issue 54: hetero/'s contracts (plan, specs, config, ...) are what every layer reads, so they import none of
    the layers (the planner, the runtime, the CLI); and the runtime imports neither the CLI nor the config reader
    (its run checks are in hetero/specs.py, the warnings log in runtime/base)."""
    bad = []
    for name in _contract_modules():
        path = ROOT / Path(*name.split(".")).with_suffix(".py")
        path = path if path.is_file() else ROOT / Path(*name.split(".")) / "__init__.py"
        for line, module in _imports(ast.parse(path.read_text(), str(path)), name.rpartition(".")[0] or name):
            if any(_matches(module, layer) for layer in ("hetero.planner", "hetero.runtime", "hetero.cli")):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        for line, module in _imports(ast.parse(path.read_text(), str(path)), "hetero.runtime"):
            if _matches(module, "hetero.cli") or _matches(module, "hetero.config"):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert bad == []


def test_reading_a_plan_loads_neither_the_planner_nor_numpy(tiny_model_dir: Path, tiny_spec: Any,
                                                            tmp_path: Path) -> None:
    """A stage process reads its plan first: Plan.load checks every value, but not with the planner's 29 modules and
    numpy (the schedule names it checks against are hetero/program.py's)."""
    from plans import make_plan

    make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3]).save(tmp_path / "plan.json")
    code = (f"import sys\nfrom hetero.plan import Plan\nPlan.load({str(tmp_path / 'plan.json')!r})\n"
            "loaded = sorted(m for m in sys.modules if m.startswith(('hetero.planner', 'hetero.runtime', 'hetero.cli',"
            " 'numpy', 'torch')))\nprint(loaded)\nsys.exit(1 if loaded else 0)\n")
    result = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"Plan.load imported {result.stdout.strip()} {result.stderr[-2000:]}"


# runtime/'s floors, bottom up: a module imports its own floor and the ones below, never one above. Modules at
# runtime/'s root sit on a floor of their own: pretrained.py on the ground floor, cli.py (`hetero run`, `hetero
# worker`, `hetero generate`: the entry points that pick an engine) on the top.
FLOORS = {"base": 0, "pretrained": 0, "wire": 1, "stage": 2, "run": 3, "tools": 4, "torch_engine": 5, "cli": 6}


def _floor_of(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["hetero", "runtime"] or len(parts) < 3:
        return None
    return FLOORS[parts[2]]


def upward_imports(root: Path = ROOT) -> list[str]:
    """Every import in runtime/ of a floor above the importing module's."""
    return _upward(root, "runtime", FLOORS, _floor_of)


def _upward(root: Path, folder: str, floors: dict[str, int], floor_of: Any) -> list[str]:
    """Every import in ``folder`` (hetero.<folder>) of a floor above the importing module's: a module's floor is
    its first path part's in ``floors``; ``floor_of`` gives an imported module's (None: outside the floors). The
    folder's own __init__.py is left out."""
    bad = []
    for path in sorted((root / folder).rglob("*.py")):
        rel = path.relative_to(root / folder)
        if rel.parts == ("__init__.py",):
            continue
        own = floors[rel.parts[0].removesuffix(".py")]
        package = ".".join(["hetero", folder, *rel.with_suffix("").parts[:-1]])
        for line, module in _imports(ast.parse(path.read_text(), str(path)), package):
            above = floor_of(module)
            if above is not None and above > own:
                bad.append(f"{folder}/{rel}:{line} imports {module}")
    return sorted(set(bad))


def test_runtime_floors_import_nothing_above_them() -> None:
    assert upward_imports() == []


def test_an_upward_import_is_caught(tmp_path: Path) -> None:
    """The check itself: a stage module that reaches up into the run is named."""
    for folder in ("stage", "run"):
        (tmp_path / "runtime" / folder).mkdir(parents=True)
    (tmp_path / "runtime" / "stage" / "x.py").write_text("def f():\n    from hetero.runtime.run.data import IGNORE_INDEX\n")
    (tmp_path / "runtime" / "run" / "y.py").write_text("from hetero.runtime.stage.lora import peft_key\n")
    assert upward_imports(tmp_path) == ["runtime/stage/x.py:2 imports hetero.runtime.run.data",
                                        "runtime/stage/x.py:2 imports hetero.runtime.run.data.IGNORE_INDEX"]


# planner/'s wings, bottom up (issue 54): a module imports its own wing and the ones below, never one above;
# compose.py (``plan()``) sits above every wing but replan/, which plans again from a run and calls ``plan()``.
WINGS = {"schedule": 0, "model": 1, "search": 2, "replica": 3, "explain": 4, "compose": 5, "replan": 6}


def _wing_of(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["hetero", "planner"] or len(parts) < 3:
        return None
    return WINGS["compose"] if parts[2] == "plan" else WINGS.get(parts[2])  # `from hetero.planner import plan`


def planner_upward_imports(root: Path = ROOT) -> list[str]:
    """Every import in planner/ of a wing above the importing module's (lazy imports in functions count); the
    package's __init__ (its lazy ``plan``) is left out."""
    return _upward(root, "planner", WINGS, _wing_of)


def test_planner_wings_import_nothing_above_them() -> None:
    assert {p.name for p in (ROOT / "planner").iterdir() if p.is_dir() and p.name != "__pycache__"} | {"compose"} \
        == set(WINGS)  # every wing has its floor
    assert planner_upward_imports() == []


def test_an_upward_planner_import_is_caught(tmp_path: Path) -> None:
    """The check itself: a cost module that reaches up into the search, or the search into ``plan()``, is named."""
    for wing in ("model", "search"):
        (tmp_path / "planner" / wing).mkdir(parents=True)
    (tmp_path / "planner" / "model" / "x.py").write_text("from hetero.planner.search.exact import solve_exact\n")
    (tmp_path / "planner" / "search" / "y.py").write_text("def f():\n    from hetero.planner import plan\n")
    assert planner_upward_imports(tmp_path) == [
        "planner/model/x.py:1 imports hetero.planner.search.exact",
        "planner/model/x.py:1 imports hetero.planner.search.exact.solve_exact",
        "planner/search/y.py:2 imports hetero.planner.plan"]


def test_importing_one_wing_loads_only_the_wings_below_it() -> None:
    """planner/__init__.py no longer imports the whole planner: the simulator loads schedule/ alone."""
    code = ("import sys, hetero.planner.schedule.simulator\n"
            "print(sorted(m for m in sys.modules if m.startswith('hetero.planner.') "
            "and not m.startswith('hetero.planner.schedule')))")
    result = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr[-2000:]
