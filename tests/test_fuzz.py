"""Fuzzed fleets, command-line overrides and plans: bad input is one `hetero: error:` line, never a traceback.

Each property starts from real input (conf/hardware/*.yaml, hardware_specs/*.yaml, the config tree's keys, a
plan.json compiled once for the module) and breaks it at random: values of the wrong type, NaN, inf and huge
numbers, dropped and added keys, deep nesting, truncated files. `hetero` must accept the result or refuse it
with exactly one ``hetero: error: ...`` line and exit code 2. Derandomized: CI sees the same examples on
every run, and a failure prints the input that broke it.
"""

from __future__ import annotations

import io
import json
import math
import re
import time
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetero import cli
from hetero.errors import HeteroError, PlanError
from hetero.plan import Plan, compute_input_hash

ROOT = Path(__file__).parents[1]
FLEETS = {p.stem: yaml.safe_load(p.read_text()) for p in sorted((ROOT / "conf" / "hardware").glob("*.yaml"))}
DATASHEET = yaml.safe_load((ROOT / "hardware_specs" / "rtx3090.yaml").read_text())
CHEAP = ["model=tiny", "planner.time_limit_s=1"]  # every compile here plans the tiny model, briefly

# Derandomized, so every CI run tries the same cases; 25 per property keeps the fuzz tests near a minute
# on CI's two cores (each fleet or override example compiles the tiny model).
FUZZ = settings(derandomize=True, deadline=None, database=None, max_examples=25,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --- values and mutations --------------------------------------------------------------------------------

BAD_INTS = [0, -1, 3, 2**31, 10**30, 10**400]
BAD_FLOATS = [0.0, -1.0, math.inf, -math.inf, math.nan, 1e-320, -0.0, 1e300]
SPECIAL_NUMBERS = [*BAD_INTS, *BAD_FLOATS, 1, 0.5]
scalars = st.one_of(
    st.none(), st.booleans(), st.sampled_from(SPECIAL_NUMBERS), st.integers(-5, 100),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["", "cpu", "rtx3090", "${hardware.num_devices}", "${oops}", "127.0.0.1", "[", "x" * 300]),
)  # fmt: skip
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)


def _paths(tree: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into a tree of dicts and lists, the root included."""
    found = [prefix]
    if isinstance(tree, dict):
        for key, value in tree.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            found += _paths(value, (*prefix, i))
    return found


def _nest(value: Any, depth: int, as_list: bool) -> Any:
    for _ in range(depth):
        value = [value] if as_list else {"a": value}
    return value


def mutate(data: st.DataObject, tree: Any) -> Any:
    """One to three random edits of a JSON-like tree: replace, drop, add, nest, retype.

    "deep" leaves a DEEPNEST<n> marker that ``deepen`` turns into ``n`` nested lists in the file's text
    (json and yaml cannot write what Python cannot recurse into).
    """
    tree = json.loads(json.dumps(tree))  # a deep copy that shares nothing
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        path = data.draw(st.sampled_from(_paths(tree)), label="path")
        op = data.draw(st.sampled_from(["replace", "drop", "add", "nest", "deep", "stringify", "number", "number"]),
                       label="op")
        parent, key = (None, None) if not path else (_get(tree, path[:-1]), path[-1])
        old = _get(tree, path)
        if op == "number" and type(old) in (int, float):  # same type, bad value: passes the type checks
            new = data.draw(st.sampled_from(BAD_INTS if type(old) is int else BAD_FLOATS), label="number")
        elif op == "replace":
            new = data.draw(json_values, label="value")
        elif op == "nest":
            new = _nest(old, data.draw(st.integers(2, 50), label="depth"), data.draw(st.booleans()))
        elif op == "deep":
            new = f"DEEPNEST{data.draw(st.sampled_from([100, 900, 5000, 100_000]), label='depth')}"
        elif op == "stringify":
            new = str(old)
        elif op == "add" and isinstance(old, dict):
            old[data.draw(st.text(max_size=10), label="new key")] = data.draw(json_values, label="value")
            continue
        elif op == "add" and isinstance(old, list):
            old.append(data.draw(json_values, label="value"))
            continue
        elif op == "drop" and parent is not None:
            del parent[key]
            continue
        else:
            continue
        if parent is None:
            tree = new
        else:
            parent[key] = new
    return tree


def deepen(text: str) -> str:
    """Replace each DEEPNEST<n> marker (quoted or not) with ``n`` nested lists around a 1."""
    return re.sub(r'"?DEEPNEST(\d+)"?', lambda m: "[" * int(m.group(1)) + "1" + "]" * int(m.group(1)), text)


def _get(tree: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


# --- running the CLI in-process ------------------------------------------------------------------------------


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def compile_without_writing(argv: list[str]) -> tuple[int, str]:
    """`hetero compile argv` up to the plan (emit stubbed: no artifacts or pictures to draw per example)."""
    with mock.patch("hetero.compiler.emit.emit", lambda plan, out, traced=None, **_: []):
        code, _, err = run_cli(["compile", *argv])
    return code, err


def assert_accepted_or_one_line(code: int, err: str, what: Any) -> None:
    assert code in (0, 2), (code, err, what)
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("hetero: error: "), (err, what)
        assert len(lines[0]) < 400, lines[0]  # it quotes the bad value, not all of it


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A scratch cwd: whatever a fuzzed config makes `hetero` write stays in it."""
    root = tmp_path_factory.mktemp("fuzz")
    mp = pytest.MonkeyPatch()
    mp.chdir(root)
    try:
        yield root
    finally:
        mp.undo()


# --- (a) fleet files ------------------------------------------------------------------------------------------


def _write_fleet_dir(root: Path, fleet: Any, datasheet: Any | None) -> None:
    (root / "hardware").mkdir(parents=True, exist_ok=True)
    (root / "hardware" / "fuzz.yaml").write_text(deepen(yaml.safe_dump(fleet, sort_keys=False)))
    if datasheet is not None:
        (root / "hardware_specs").mkdir(exist_ok=True)
        (root / "hardware_specs" / "fuzzcard.yaml").write_text(deepen(yaml.safe_dump(datasheet, sort_keys=False)))


@FUZZ
@given(data=st.data(), name=st.sampled_from(sorted(FLEETS)))
def test_fuzzed_fleet_files_compile_or_fail_in_one_line(workdir: Path, data: st.DataObject, name: str) -> None:
    fleet = mutate(data, FLEETS[name])
    datasheet = None
    if data.draw(st.booleans(), label="also fuzz a datasheet"):
        datasheet = mutate(data, {**DATASHEET, "name": "fuzzcard"})
        fleet = {"name": "fuzzcard", "hosts": [{"name": "box", "devices": [{"type": "fuzzcard", "count": 2}]}]}
    root = workdir / f"fleet{time.monotonic_ns()}"
    _write_fleet_dir(root, fleet, datasheet)
    code, err = compile_without_writing(["-cd", str(root), "hardware=fuzz", *CHEAP, f"output={root / 'out'}"])
    assert_accepted_or_one_line(code, err, (fleet, datasheet))


@FUZZ
@given(data=st.data(), name=st.sampled_from(sorted(FLEETS)))
def test_fuzzed_fleet_text_fails_in_one_line(workdir: Path, data: st.DataObject, name: str) -> None:
    """Text-level damage: truncation, stray characters, anchors and aliases spliced in."""
    text = (ROOT / "conf" / "hardware" / f"{name}.yaml").read_text()
    cut = data.draw(st.integers(0, len(text)), label="at")
    splice = data.draw(st.sampled_from(["", "&a ", "*a", "*nope", "<<: *a\n", "\t", "{", "]", ": :", "\x00",
                                        "!!python/object:os.system ", "- " * 50, "[" * 400, "%TAG ! x\n"]))
    text = text[:cut] + splice + (text[cut:] if data.draw(st.booleans(), label="keep the rest") else "")
    root = workdir / f"text{time.monotonic_ns()}"
    (root / "hardware").mkdir(parents=True)
    (root / "hardware" / "fuzz.yaml").write_text(text)
    code, err = compile_without_writing(["-cd", str(root), "hardware=fuzz", *CHEAP, f"output={root / 'out'}"])
    assert_accepted_or_one_line(code, err, text)


@pytest.mark.parametrize(("device", "says"), [
    ("{type: {}}", "type must be a device type's name"),
    ("{type: cpu, count: .nan}", "count must be an integer"),
    ("{type: cpu, memory_gb: .inf}", "memory_gb must be a finite number"),
    ("{type: cpu, memory_gb: 1" + "0" * 400 + "}", "memory_gb is out of range"),
    ("{type: cpu, count: 100000000}", "larger than hetero plans for"),
    ("{type: cpu, index: -1}", "index must be at least 0"),
    ("[cpu]", "expected a mapping"),
])  # fmt: skip
def test_reported_fleet_files_fail_in_one_line(workdir: Path, device: str, says: str) -> None:
    root = workdir / f"reported{time.monotonic_ns()}"
    (root / "hardware").mkdir(parents=True)
    (root / "hardware" / "bad.yaml").write_text(f"hosts:\n  - name: box\n    devices: [{device}]\n")
    code, err = compile_without_writing(["-cd", str(root), "hardware=bad", *CHEAP, f"output={root / 'out'}"])
    assert code == 2 and says in err, err
    assert_accepted_or_one_line(code, err, device)


# --- (b) command-line overrides ---------------------------------------------------------------------------


def _config_tree() -> dict[str, Any]:
    """The real config tree of `model=tiny hardware=local`, read with plain YAML (no Hydra)."""
    conf = ROOT / "conf"
    return {
        "train": yaml.safe_load((conf / "train" / "default.yaml").read_text()),
        "planner": yaml.safe_load((conf / "planner" / "default.yaml").read_text()),
        "hardware": FLEETS["local"],
        **yaml.safe_load((conf / "model" / "tiny.yaml").read_text()),
        "data": yaml.safe_load((conf / "config.yaml").read_text())["data"],
        "profile": None,
    }


# Dotted key -> its value in the tree: every leaf, section and group (list items are reached by their list).
CONFIG_KEYS = {".".join(map(str, path)): _get(_config_tree(), path) for path in _paths(_config_tree())
               if path and not any(isinstance(k, int) for k in path)}
GROUP_OPTIONS = ["tiny", "llama8b", "local", "homelab", "default", "hf", "nope"]


def hydra_value(value: Any) -> str:
    """``value`` in Hydra's override grammar (which has nan, inf and 1e309 spelled as such)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else "inf" if value == math.inf else "-inf" if value == -math.inf else repr(value)
    if isinstance(value, (int, str)):
        return str(value)
    if isinstance(value, list):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"


def override_values(default: Any) -> st.SearchStrategy[str]:
    """Values for a key whose real value is ``default``: near it (valid or just out of range), or anything."""
    near: list[Any] = [default]
    if type(default) in (int, float):
        near += [default * 2, default + 1, -default, default * 10**6, 0]
    return st.one_of(
        st.sampled_from(near).map(hydra_value),
        st.sampled_from(["1e309", "-1e309", "nan", "inf", "-1", "0", "1e-400", "99999999999999999999999", "null",
                         "[]", "{}", "[1,2]", "{a:1}", "''", "'x'", "true", "${model.seq_len}", "${nope}"]),
        st.sampled_from(GROUP_OPTIONS),
        json_values.map(hydra_value),
        st.text(st.characters(codec="ascii"), max_size=10),
    )  # fmt: skip


@st.composite
def overrides(draw: st.DrawFn) -> list[str]:
    out = []
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(CONFIG_KEYS)))
        form = draw(st.sampled_from(["", "", "", "+", "++", "~"]))
        out.append(f"~{key}" if form == "~" else f"{form}{key}={draw(override_values(CONFIG_KEYS[key]))}")
    return out


@FUZZ
@given(fuzzed=overrides())
def test_fuzzed_overrides_compile_or_fail_in_one_line(workdir: Path, fuzzed: list[str]) -> None:
    # output last, so no override can point the key files compile writes outside the scratch dir.
    code, err = compile_without_writing([*CHEAP, *fuzzed, f"output={workdir / 'out'}"])
    assert_accepted_or_one_line(code, err, fuzzed)


@pytest.mark.parametrize("override", ["model=5", "hardware=3", "train=1.5", "planner=[1]", "model=null",
                                      "model.architecture.hidden_size=1e309", "model.architecture=5",
                                      "hardware.num_devices=100000000", "planner.time_limit_s=nan",
                                      "train.lr=inf", "hardware.hosts.0.port=70000"])  # fmt: skip
def test_reported_overrides_fail_in_one_line(workdir: Path, override: str) -> None:
    code, err = compile_without_writing([*CHEAP, override, f"output={workdir / 'out'}"])
    assert code == 2, err
    assert_accepted_or_one_line(code, err, override)


# --- (c) plan.json ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled_plan(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """plan.json of `hetero compile model=tiny hardware=local`, as a dict, compiled once for the module."""
    out = tmp_path_factory.mktemp("plan")
    code, _, err = run_cli(["compile", *CHEAP, "hardware=local", f"output={out}"])
    assert code == 0, err
    return json.loads((out / "plan.json").read_text())  # type: ignore[no-any-return]


def _write_plan(root: Path, data: st.DataObject, plan: dict[str, Any]) -> Path:
    mutated = mutate(data, plan)
    if data.draw(st.booleans(), label="rehash"):
        # As if edited by someone who also fixes the input hash: reaches the checks behind the hash.
        try:
            mutated["input_hash"] = compute_input_hash(Plan.from_dict(mutated))
        except (HeteroError, TypeError, KeyError):
            pass
    text = deepen(json.dumps(mutated))
    if data.draw(st.sampled_from([False, False, False, True]), label="truncate"):
        text = text[: data.draw(st.integers(0, len(text)), label="at")]
    path = root / f"plan{time.monotonic_ns()}.json"
    path.write_text(text)
    return path


@FUZZ
@given(data=st.data())
def test_fuzzed_plans_load_or_raise_plan_error(workdir: Path, compiled_plan: dict[str, Any], data: st.DataObject) -> None:
    path = _write_plan(workdir, data, compiled_plan)
    try:
        Plan.load(path)
    except PlanError as exc:
        assert str(exc).strip() and "\n" not in str(exc).strip(), str(exc)


@settings(FUZZ, max_examples=60)
@given(data=st.data(), gantt=st.booleans())
def test_fuzzed_plans_show_or_fail_in_one_line(
    workdir: Path, compiled_plan: dict[str, Any], data: st.DataObject, gantt: bool
) -> None:
    path = _write_plan(workdir, data, compiled_plan)
    code, _, err = run_cli(["show", str(path), *([] if gantt else ["--no-gantt"])])
    assert_accepted_or_one_line(code, err, path.read_text()[:2000])


@settings(FUZZ, max_examples=25)
@given(data=st.data())
def test_fuzzed_plans_never_start_a_run_with_a_bad_override(
    workdir: Path, compiled_plan: dict[str, Any], data: st.DataObject
) -> None:
    # `hetero run` checks the plan, then its overrides, before it starts anything: a bad override stops it.
    path = _write_plan(workdir, data, compiled_plan)
    code, _, err = run_cli(["run", str(path), "no_such_key=1", "--run-dir", str(workdir / "run")])
    assert code == 2
    assert_accepted_or_one_line(code, err, path.read_text()[:2000])


@pytest.mark.parametrize(("override", "says"), [("lr=nan", "train.lr"), ("max_grad_norm=-1", "max_grad_norm"),
                                               ("steps=0", "train.steps")])
def test_run_overrides_out_of_range_fail_before_anything_starts(workdir: Path, compiled_plan: dict[str, Any],
                                                                override: str, says: str) -> None:
    path = workdir / "run-overrides" / "plan.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(compiled_plan))
    code, _, err = run_cli(["run", str(path), override, "--run-dir", str(workdir / "run-overrides" / "run")])
    assert code == 2 and says in err and err.count("\n") <= 1, err
    assert not (workdir / "run-overrides" / "run" / "logs").exists()


def test_a_deeply_nested_plan_is_one_line(workdir: Path) -> None:
    path = workdir / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    code, _, err = run_cli(["show", str(path)])
    assert code == 2 and "nested" in err, err
    assert_accepted_or_one_line(code, err, "deep")
    path.write_text('{"schema_version": 1, "model": ' + '{"a": ' * 5000 + "1" + "}" * 5001)
    with pytest.raises(PlanError, match="nested"):
        Plan.load(path)


# --- YAML and interpolation bombs -----------------------------------------------------------------------------------------


def alias_bomb(levels: int = 9, width: int = 10) -> str:
    """A "billion laughs" file: each level repeats the previous one ``width`` times (width**levels leaves)."""
    lines = ["l0: &l0 [" + ", ".join(["lol"] * width) + "]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


FLEET_TAIL = "name: bomb\nhosts:\n  - name: box\n    devices: [{type: cpu}]\n"


def interpolation_bomb(levels: int = 9, width: int = 10) -> str:
    """The same with OmegaConf's ${...}: each string holds ``width`` references to the previous one."""
    lines = ["l0: lol"] + [f"l{i}: '" + f"${{hardware.l{i - 1}}}" * width + "'" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(("where", "says"), [("fleet", "alias"), ("datasheet", "alias"), ("interpolation", "interpolation"),
                                             ("cycle", "refers to its own anchor")])  # fmt: skip
def test_yaml_bombs_fail_fast_in_one_line(workdir: Path, where: str, says: str) -> None:
    compile_without_writing(["model=5"])  # a first start (imports, Hydra's plugin scan) is not what is timed
    root = workdir / f"bomb-{where}"
    (root / "hardware").mkdir(parents=True)
    if where == "datasheet":  # a fleet that uses the card, whose datasheet holds the bomb
        (root / "hardware_specs").mkdir()
        sheet = yaml.safe_dump({**DATASHEET, "name": "bombcard", "source": "BOMB"}).replace("BOMB", "*l8")
        (root / "hardware_specs" / "bombcard.yaml").write_text(alias_bomb() + sheet)
        fleet = FLEET_TAIL.replace("cpu", "bombcard")
    else:
        fleet = {"fleet": alias_bomb(), "interpolation": interpolation_bomb(), "cycle": "loop: &a [*a]\n"}[where]
        fleet += FLEET_TAIL
    (root / "hardware" / "bomb.yaml").write_text(fleet)
    start = time.monotonic()
    code, err = compile_without_writing(["-cd", str(root), "hardware=bomb", *CHEAP, f"output={root / 'out'}"])
    assert time.monotonic() - start < 2.0
    assert code == 2 and says in err, err
    assert_accepted_or_one_line(code, err, where)


def test_yaml_aliases_within_bounds_still_work(workdir: Path) -> None:
    root = workdir / "anchors"
    (root / "hardware").mkdir(parents=True)
    (root / "hardware" / "anchored.yaml").write_text(
        "name: anchored\nhosts:\n  - name: a\n    address: 127.0.0.1\n    devices: &cards [{type: cpu}]\n"
        "  - name: b\n    address: 127.0.0.1\n    port: 29600\n    devices: *cards\n"
        "default_link: {bandwidth_gbps: 1}\n")
    code, err = compile_without_writing(["-cd", str(root), "hardware=anchored", *CHEAP, f"output={root / 'out'}"])
    assert code == 0, err

