"""Fuzzed fleets, configs, command-line overrides, plans and wire frames: bad input is one line, never a traceback.

Each property starts from real input (conf/hardware/*.yaml, hardware_specs/*.yaml, the config tree's keys, a
plan.json compiled once for the module, every message a run's processes exchange) and breaks it at random:
values of the wrong type, NaN, inf and huge numbers, dropped and added keys, deep nesting, truncated files,
malformed override syntax, flipped bytes. `hetero` must accept the result or refuse it with exactly one
``hetero: error: ...`` line and exit code 2 (a process of a run: drop the message with a one-line reason).
Every case runs under a time limit, so a hang fails the case instead of the CI run. Derandomized: CI sees
the same examples on every run, and a failure prints the input that broke it.

Per run: 500 config trees and 40 override lines composed in-process, plus the compiles; 500 plans; 10,000
frames through a Transport's decode-and-admit path in-process (no sockets).
"""

from __future__ import annotations

import copy
import functools
import io
import json
import math
import random
import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hetero import cli, config, hardware
from hetero.errors import HeteroError, PlanError
from hetero.plan import Plan, compute_input_hash

ROOT = Path(__file__).parents[2]
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


@functools.lru_cache(maxsize=16)
def _paths_of_json(text: str) -> list[tuple[Any, ...]]:
    """``_paths`` of a JSON document's value."""
    return _paths(json.loads(text))


def _nest(value: Any, depth: int, as_list: bool) -> Any:
    for _ in range(depth):
        value = [value] if as_list else {"a": value}
    return value


def mutate(data: st.DataObject, tree: Any) -> Any:
    """One to three random edits of a JSON-like tree: replace, drop, add, nest, retype.

    "deep" leaves a DEEPNEST<n> marker that ``deepen`` turns into ``n`` nested lists in the file's text
    (json and yaml cannot write what Python cannot recurse into).
    """
    text = json.dumps(tree)
    tree = json.loads(text)  # a deep copy that shares nothing
    for edit in range(data.draw(st.integers(1, 3), label="edits")):
        # The first edit's paths are the input's (a plan's are thousands: found once per input, not per case).
        path = data.draw(st.sampled_from(_paths_of_json(text) if edit == 0 else _paths(tree)), label="path")
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


# --- a time limit per case ----------------------------------------------------------------------------------


class CaseHung(BaseException):
    """A fuzz case ran past its time limit (a BaseException, so no ``except Exception`` of the code swallows it)."""


@contextmanager
def time_limit(seconds: float, what: Any) -> Iterator[None]:
    """Fail the case with CaseHung after ``seconds`` (SIGALRM, main thread); pytest-timeout's alarm is restored."""

    def hung(signum: int, frame: Any) -> None:
        raise CaseHung(f"over {seconds} s: {str(what)[:500]}")

    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, hung)
    outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_delay:
            left = max(outer_delay - (time.monotonic() - started), 0.001)
            signal.setitimer(signal.ITIMER_REAL, left, outer_interval)


def assert_one_line_error(exc: BaseException, what: Any) -> None:
    """A refusal the CLI prints as one ``hetero: error:`` line: a HeteroError with a short, non-empty message."""
    assert isinstance(exc, HeteroError), (type(exc).__name__, str(exc)[:300], what)
    message = " ".join(str(exc).split())
    assert message and len(message) < 400, (message[:500], what)


# --- running the CLI in-process ------------------------------------------------------------------------------


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def compile_without_writing(argv: list[str]) -> tuple[int, str]:
    """`hetero compile argv` up to the plan (emit stubbed: no artifacts or pictures to draw per example)."""
    with mock.patch("hetero.compiler.emit.emit", lambda plan, out, traced=None, **_: []), time_limit(120, argv):
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
CONFIG_TREE = _config_tree()
CONFIG_KEYS = {".".join(map(str, path)): _get(CONFIG_TREE, path) for path in _paths(CONFIG_TREE)
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


# Override lines Hydra's grammar reads but its composer chokes on, or that it cannot read at all (issue 23).
MALFORMED_OVERRIDES = [
    "~train=3", "~model", "train.=", "=3", "++x", "train.lr=[", "~model=[a]", "~train=[1]", "~=1", "@=1",
    "model@x=tiny", "x@y=1", "hydra=1", "hydra/launcher=3", "hydra/job_logging=3", "hydra.sweeper.params={a:1}",
    "hydra.searchpath=['pkg://x']", "~hydra", "train", "train=", "model=", "~train.lr=3", "+train.lr=3",
    "++model=tiny", "+model=tiny", "train.lr=]", "train.lr={", "train.lr='", "train.lr=${", "train..lr=1", ".lr=1",
    "train.lr==1", "train.lr=1,2", "model=tiny,llama8b", "train.lr=interval(0,1)", "model=glob(*)", "~profile",
    "train.lr=${oc.decode:1}", "train.lr=${hydra:runtime.cwd}", "output=${now:%Y}", "+a.b.c={d:[1,{e:2}]}",
]
# Pieces of the override grammar, glued at random into lines that are mostly not overrides at all.
OVERRIDE_PIECES = ["~", "+", "++", "=", ".", "@", "/", ",", "[", "]", "{", "}", "(", ")", "'", '"', "\\", "$",
                   ":", " ", "hydra", "train", "model", "lr", "3", "null", "nan", "glob(*)", "range(1,3)",
                   "choice(a,b)", "${", "oc.env:HOME", "\x00", "é", "tiny", "_self_", "defaults"]


@st.composite
def overrides(draw: st.DrawFn) -> list[str]:
    out = []
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(CONFIG_KEYS)))
        form = draw(st.sampled_from(["", "", "", "+", "++", "~", "~=", "malformed"]))
        if form == "malformed":
            out.append(draw(st.one_of(st.sampled_from(MALFORMED_OVERRIDES),
                                      st.lists(st.sampled_from(OVERRIDE_PIECES), min_size=1, max_size=8).map("".join))))
        elif form in ("~", "~="):  # a delete, and a delete with a value (Hydra's ~key=value)
            out.append(f"~{key}" if form == "~" else f"~{key}={draw(override_values(CONFIG_KEYS[key]))}")
        else:
            out.append(f"{form}{key}={draw(override_values(CONFIG_KEYS[key]))}")
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


@pytest.mark.parametrize("override", MALFORMED_OVERRIDES)
def test_malformed_overrides_fail_in_one_line(workdir: Path, override: str) -> None:
    code, err = compile_without_writing([*CHEAP, override, f"output={workdir / 'out'}"])
    assert_accepted_or_one_line(code, err, override)
    if override.startswith(("~train=", "=", "hydra", "~model=[")):
        assert code == 2, err


@pytest.fixture(scope="module")
def composed() -> tuple[dict[str, Any], dict[str, Any]]:
    """The composed config tree of `model=tiny hardware=local` and the datasheets, read once for the module."""
    return config.compose_raw(["model=tiny", "hardware=local"]), hardware.load_device_types()


@contextmanager
def datasheets_read_once(types: dict[str, Any]) -> Iterator[None]:
    """config.load without re-reading hardware_specs/ per case (the same files every time)."""
    with mock.patch.object(config, "load_device_types", lambda extra_dirs=(): dict(types)):
        yield


def load_or_refuse(overrides: list[str], what: Any) -> None:
    """config.load accepts ``overrides`` or refuses them with a one-line HeteroError, in under 10 s."""
    try:
        with time_limit(10, what):
            config.load(overrides)
    except Exception as exc:  # CaseHung is no Exception: a hang fails the test
        assert_one_line_error(exc, what)


@settings(FUZZ, max_examples=500)
@given(data=st.data())
def test_fuzzed_config_trees_load_or_fail_in_one_line(composed: tuple[dict[str, Any], dict[str, Any]],
                                                      data: st.DataObject) -> None:
    # What composition can hand load(): overrides set any key to any value, +key={...} adds whole trees.
    raw, types = composed
    tree = mutate(data, raw)
    assume(isinstance(tree, dict))  # Hydra composes a mapping, whatever the overrides
    with mock.patch.object(config, "compose_raw", lambda overrides, config_dir=None: copy.deepcopy(tree)), \
            datasheets_read_once(types):
        load_or_refuse([], tree)


@settings(FUZZ, max_examples=40)
@given(fuzzed=overrides())
def test_fuzzed_override_lines_compose_or_fail_in_one_line(composed: tuple[dict[str, Any], dict[str, Any]],
                                                           fuzzed: list[str]) -> None:
    # Hydra composes each case for real (no compile): the grammar, deletes with values, hydra's own keys.
    with datasheets_read_once(composed[1]):
        load_or_refuse([*CHEAP, *fuzzed], fuzzed)


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


@settings(FUZZ, max_examples=500)
@given(data=st.data())
def test_fuzzed_plans_load_or_raise_plan_error(workdir: Path, compiled_plan: dict[str, Any], data: st.DataObject) -> None:
    from hetero.runtime.wire.rules import coordinator_rules, max_message_bytes, stage_rules

    path = _write_plan(workdir, data, compiled_plan)
    try:
        with time_limit(10, path):
            plan = Plan.load(path)
            # A plan that loads is one a run starts from: each process's wire rules build from it.
            coordinator_rules(plan), max_message_bytes(plan, None)
            for k in range(len(plan.stages)):
                stage_rules(plan, k), max_message_bytes(plan, k)
    except PlanError as exc:
        assert str(exc).strip() and "\n" not in str(exc).strip(), str(exc)


@settings(FUZZ, max_examples=60)
@given(data=st.data(), gantt=st.booleans())
def test_fuzzed_plans_show_or_fail_in_one_line(
    workdir: Path, compiled_plan: dict[str, Any], data: st.DataObject, gantt: bool
) -> None:
    path = _write_plan(workdir, data, compiled_plan)
    with time_limit(60, path):
        code, _, err = run_cli(["show", str(path), *([] if gantt else ["--no-gantt"])])
    assert_accepted_or_one_line(code, err, path.read_text()[:2000])


@settings(FUZZ, max_examples=25)
@given(data=st.data())
def test_fuzzed_plans_never_start_a_run_with_a_bad_override(
    workdir: Path, compiled_plan: dict[str, Any], data: st.DataObject
) -> None:
    # `hetero run` checks the plan, then its overrides, before it starts anything: a bad override stops it.
    path = _write_plan(workdir, data, compiled_plan)
    with time_limit(60, path):
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



# --- (d) wire frames: every message a run exchanges, broken, through a Transport's decode-and-admit path ------

FRAMES_PER_RUN = 10_000
STEP = 3  # the receivers' step in progress: messages of steps 3 and 4 are in their window


@pytest.fixture(scope="module")
def pipeline_plan(workdir: Path) -> Plan:
    """One pipeline of two stages (its processes take act, grad, clip, gradnorm, rebalance, ...), compiled once."""
    compiled: list[Plan] = []

    def keep(plan: Plan, out: Any, traced: Any = None, **_: Any) -> list[Path]:
        compiled.append(plan)
        return []

    with mock.patch("hetero.compiler.emit.emit", keep):
        code, _, err = run_cli(["compile", *CHEAP, "hardware=local", "planner.num_stages=2", "planner.replicas=1",
                                f"output={workdir / 'pipeline'}"])
    assert code == 0, err
    return compiled[0]


def valid_meta(kind: str, plan: Plan) -> dict[str, Any]:
    """A meta of ``kind`` as a run's processes send it (every optional field set: sent, op_cpu_s, link_s, ...)."""
    from hetero import protocol as p

    now = time.time()
    records: dict[str, p.Record] = {
        "hello": p.Hello(stage=1, input_hash=plan.input_hash, pid=4242, env={"torch": "2.13.0", "devices": ["cpu"]}),
        "welcome": p.Welcome(train={"steps": 5, "lr": 1e-3}, start_step=0, resume=False, failure_timeout_s=10.0,
                             eval_every=0, stage_eval_every=2, stage_eval_rounds=3),
        "start": p.Start(stage=0, keys=["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"],
                         build_s=1.5, lora_params=1024),
        "state": p.State(extra={"step": STEP}), "checkpoint": p.Checkpoint(extra={"step": STEP}),
        "stop": p.Stop(reason="done", checkpoint=STEP), "error": p.Error(message="stage 1: out of memory", stage=1),
        "heartbeat": p.Heartbeat(), "batch": p.Batch(), "labels": p.Labels(num_label_tokens=17),
        "act": p.Act(sent=now), "grad": p.Grad(sent=now), "gradnorm": p.GradNorm(sumsq=2.5),
        "clip": p.Clip(coef=0.5, grad_norm=2.0), "grads": p.Grads(), "reduced": p.Reduced(coef=1.0, grad_norm=0.5),
        "stepdone": p.StepDone(step=STEP, loss_sum=12.5, num_label_tokens=17, grad_sumsq=2.5, lr=1e-3, busy_s=0.2,
                               wall_s=0.3, op_time_s={"F": 0.1, "B": 0.12}, op_cpu_s={"F": 0.09, "B": 0.11},
                               link_s={"act": 0.001, "grad": 0.002}, telemetry={"sm_clock_mhz": 1800},
                               streamed_bytes=1 << 20, frozen_resident_peak_bytes=3 << 20),
        "rebalance": p.Rebalance(spans=[[s.first_node, s.last_node] for s in plan.stages],
                                 recompute=[[] for _ in plan.stages], reason="stage 1 slowed down for good"),
        "snapshot": p.Snapshot(),
        "evaldone": p.EvalDone(loss_sum=41.5, num_label_tokens=12, round=1),
    }
    return records[kind].to_wire()


def valid_tensors(rules: Any, kind: str) -> dict[str, Any]:
    """The tensors the plan says ``kind`` carries to this process (ids in the vocabulary), or LoRA-like float32 ones."""
    import torch

    from hetero.runtime.wire import compress
    from hetero.runtime.wire.frames import DTYPES

    if kind in rules.open_tensors:
        return {"lora_A": torch.randn(4, 8), "lora_B": torch.zeros(8, 4)}
    tensors = {}
    if kind in rules.compressed:  # a compressed hand-off: the parts its sender's codec makes of a real tensor
        name, scheme, shape = rules.compressed[kind]
        tensors = compress.pack(torch.randn(shape), name, scheme)
    for name, rule in rules.tensors.get(kind, {}).items():
        if name in tensors:
            continue
        if rule.positions:  # packed rows' positions: records of 5 tokens (each row's last one shorter)
            tensors[name] = (torch.arange(rule.shape[-1]) % 5).expand(rule.shape).contiguous()
        elif rule.low is not None:
            tensors[name] = torch.randint(rule.low, rule.high or 100, rule.shape, dtype=torch.int64)
        else:
            tensors[name] = torch.randn(rule.shape).to(DTYPES[rule.dtype])
    return tensors


def wire_cases(plans: list[Plan]) -> list[tuple[str, Any, dict[str, Any], list[bytes]]]:
    """(plan hash, receiver's rules, header, frames) of every kind every process of ``plans`` accepts, from a sender it takes
    it from: the messages a fuzzed frame starts from."""
    import msgpack

    from hetero.runtime.wire.frames import Message, encode
    from hetero.runtime.wire.rules import coordinator_rules, stage_rules

    cases = []
    for plan in plans:
        for rules in [coordinator_rules(plan), *(stage_rules(plan, k) for k in range(len(plan.stages)))]:
            rules.step = STEP
            for kind, senders in sorted(rules.senders.items()):
                msg = Message(kind, sorted(senders)[0], step=STEP, mb=0, meta=valid_meta(kind, plan),
                              tensors=valid_tensors(rules, kind))
                frames = [bytes(f) for f in encode(msg, plan.input_hash)]
                cases.append((plan.input_hash, rules, msgpack.unpackb(frames[0], raw=False), frames))
    return cases


def wild_value(rng: random.Random, depth: int = 0) -> Any:
    """A value a broken or hostile peer may put anywhere in a header: wrong types, extremes, NaN, deep nesting."""
    pool: list[Any] = [None, True, False, 0, -1, 1, 7, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 0.5, -0.0, 1e308,
                       math.nan, math.inf, -math.inf, "", "x", "F", "act", "é\n\x00", "a" * 5000, b"\x00\xff", [], {}]
    pick = rng.randrange(len(pool) + 4)
    if pick < len(pool):
        return pool[pick]
    if depth > 2 or pick == len(pool):
        return _nest(1, rng.choice([40, 200, 3000]), rng.random() < 0.5)
    if pick == len(pool) + 1:
        return [wild_value(rng, depth + 1) for _ in range(rng.randint(1, 3))]
    return {rng.choice(["a", "F", "act", "", "0"]): wild_value(rng, depth + 1) for _ in range(rng.randint(1, 3))}


def _near_paths(tree: Any, prefix: tuple[Any, ...] = (), depth: int = 6) -> list[tuple[Any, ...]]:
    """Every path into ``tree`` up to ``depth`` levels down (an earlier edit may have nested it thousands deep)."""
    found = [prefix]
    if depth and isinstance(tree, (dict, list)):
        for key, value in (tree.items() if isinstance(tree, dict) else enumerate(tree)):
            found += _near_paths(value, (*prefix, key), depth - 1)
    return found


def mutate_frames(rng: random.Random, header: dict[str, Any], frames: list[bytes], kinds: list[str],
                  names: list[str]) -> list[bytes]:
    """One to three edits of a valid message: header fields, meta (nested elements too), tensor specs, payload
    bytes, frame counts, header bytes."""
    import msgpack

    header, frames = copy.deepcopy(header), list(frames)
    late: list[str] = []  # edits of the packed header bytes, after the header edits
    for _ in range(rng.randint(1, 3)):
        op = rng.choice(["field", "drop", "meta", "meta", "meta", "kind", "sender", "step", "spec", "payload",
                         "frames", "bytes", "ext"])
        if op == "field":
            header[rng.choice(sorted(header))] = wild_value(rng)
        elif op == "drop":
            header.pop(rng.choice(sorted(header)))
        elif op in ("meta", "spec"):
            tree = header.get("meta" if op == "meta" else "tensors")
            paths = _near_paths(tree)[1:]
            if not paths:
                header["meta" if op == "meta" else "tensors"] = wild_value(rng)
                continue
            path = rng.choice(paths)
            parent = _get(tree, path[:-1])
            if rng.random() < 0.2:
                del parent[path[-1]]
            else:
                parent[path[-1]] = wild_value(rng)
            if op == "meta" and isinstance(header["meta"], dict) and rng.random() < 0.2:
                header["meta"][rng.choice(["extra", "sent", "spans", "op_cpu_s", "link_s"])] = wild_value(rng)
        elif op == "kind":
            header["kind"] = rng.choice(kinds)
        elif op == "sender":
            header["sender"] = rng.choice(names)
        elif op == "step":
            header[rng.choice(["step", "mb"])] = rng.choice([STEP - 1, STEP + 1, STEP + 2, -1, 2**63 - 1, 99])
        elif op == "payload" and len(frames) > 1:
            i = rng.randrange(1, len(frames))
            raw = bytearray(frames[i])
            if raw and rng.random() < 0.6:  # NaN/inf bit patterns, ids past the vocabulary, or noise
                fill = rng.choice([b"\xff", b"\x7f", b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", bytes([rng.randrange(256)])])
                for _ in range(rng.randint(1, 8)):
                    at = rng.randrange(len(raw))
                    raw[at:at + len(fill)] = fill[: len(raw) - at]
            else:
                raw = raw[: rng.randrange(len(raw) + 1)] if rng.random() < 0.5 else raw + b"\x00" * rng.randint(1, 9)
            frames[i] = bytes(raw)
        elif op == "frames":
            # ZeroMQ hands over at least one frame (perhaps empty): the header may go missing, not every frame.
            frames = rng.choice([frames[:1], frames[:-1] or [b""], [*frames, frames[-1]], [*frames, b"x"],
                                 frames[1:] or [b""]])
        else:
            late.append(op)

    def pack(fallback: bytes) -> bytes:
        try:
            return msgpack.packb(header, use_bin_type=True)  # type: ignore[no-any-return]
        except (ValueError, OverflowError, TypeError):
            return fallback  # not packable (nested too deep for msgpack): the header before

    frames[0] = pack(frames[0])
    for op in late:
        if op == "ext" and rng.random() < 0.5:  # an extension type and a non-string key in meta
            header["meta"] = {"k": msgpack.ExtType(rng.randrange(128), b"payload"), 1: 2}
            frames[0] = pack(frames[0])
        elif frames[0]:
            raw = bytearray(frames[0])
            for _ in range(rng.randint(1, 4)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            frames[0] = bytes(raw[: rng.randrange(1, len(raw) + 1)] if rng.random() < 0.3 else raw)
    return frames


def conforms(value: Any, hint: Any) -> bool:
    """Whether ``value`` is what the annotation ``hint`` says, elements of lists and dicts included."""
    import types
    import typing

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint in (int, float):
        return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, list) and all(conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(conforms(k, args[0]) and conforms(v, args[1]) for k, v in value.items())
    return isinstance(value, hint)


@functools.cache
def record_hints(record: type) -> dict[str, Any]:
    """A record's field annotations (worked out once per kind)."""
    import typing

    return typing.get_type_hints(record)


def _with_link(plan: Plan, scheme: str) -> Plan:
    """``plan`` with its first stage's hand-offs compressed by ``scheme`` (its input hash made again)."""
    squeezed = replace(plan, stages=[replace(s, compress_out=scheme if s.index == 0 else "none") for s in plan.stages])
    return replace(squeezed, input_hash=compute_input_hash(squeezed))


def test_fuzzed_frames_are_admitted_or_dropped_in_one_line(workdir: Path, compiled_plan: dict[str, Any],
                                                            pipeline_plan: Plan) -> None:
    from dataclasses import fields

    from hetero.protocol import KINDS, RECORDS
    from hetero.runtime.wire.transport import Transport

    # The pipeline with its link compressed (int8, int4: act and grad frames of parts), and two one-stage replicas.
    plans = [pipeline_plan, *(_with_link(pipeline_plan, scheme) for scheme in ("int8", "int4")),
             Plan.from_dict(compiled_plan)]
    cases = wire_cases(plans)
    assert {h["kind"] for _, _, h, _ in cases} >= {"act", "grad", "rebalance", "stepdone", "grads", "reduced", "clip"}
    names = ["coordinator", "stage0", "stage1", "stage2", "", "stage0\n", "x" * 300]
    # One receiving Transport per process (no socket: bind=None), checking what it admits with that process's rules.
    transports = {id(rules): Transport(rules.me, None, plan_hash, rules=rules) for plan_hash, rules, _, _ in cases}
    outcomes = {"accepted": 0, "dropped": 0, "codec": 0}
    rng = random.Random(23)
    try:
        for _, rules, header, frames in cases:  # unbroken, every one is admitted: the fuzzer starts from real traffic
            assert transports[id(rules)].inbox._admit(list(frames)) is not None, (rules.me, header["kind"],
                                                                            transports[id(rules)].last_rejection())
        for case in range(FRAMES_PER_RUN):
            _, rules, header, frames = cases[rng.randrange(len(cases))]
            broken = mutate_frames(rng, header, frames, sorted(KINDS), names)
            with time_limit(2, (case, rules.me, header["kind"])):
                msg = transports[id(rules)].inbox._admit(broken)  # anything but a WireError would escape: a traceback
            if msg is None:
                outcomes["dropped"] += 1
                why = transports[id(rules)].last_rejection() or ""
                assert "\n" not in why, why
                outcomes["codec"] += "compressed (" in why  # refused by the codec's check (runtime/wire/compress.py)
                continue
            outcomes["accepted"] += 1
            record = RECORDS[msg.kind].from_wire(msg.meta)
            hints = record_hints(type(record))
            for f in fields(record):
                if f.name != "extra":
                    assert conforms(getattr(record, f.name), hints[f.name]), (case, msg.kind, f.name, msg.meta)
    finally:
        for transport in transports.values():
            transport.close()
    assert outcomes["dropped"] > FRAMES_PER_RUN // 2, outcomes  # most breakages are caught, not let through
    assert outcomes["codec"] > 0, outcomes  # broken compressed parts among them


@pytest.mark.parametrize(("kind", "field", "value"), [
    ("stepdone", "op_time_s", {"F": "slow"}), ("stepdone", "op_cpu_s", {"F": None}), ("stepdone", "link_s", {"act": [1]}),
    ("rebalance", "spans", [[0.5, 3]]), ("rebalance", "recompute", [[1]]), ("start", "keys", [0.5]),
    ("act", "sent", "yesterday"), ("grad", "sent", math.nan), ("stepdone", "op_time_s", {"F": True}),
    ("stepdone", "streamed_bytes", -1), ("stepdone", "frozen_resident_peak_bytes", 0.5),
])  # fmt: skip
def test_reported_frames_are_dropped_in_one_line(pipeline_plan: Plan, kind: str, field: str, value: Any) -> None:
    # Each would pass a check of the field's outer type and fail later in the process that takes it.
    import msgpack

    from hetero.runtime.wire.transport import Transport

    plan_hash, rules, header, frames = next(c for c in wire_cases([pipeline_plan]) if c[2]["kind"] == kind)
    header = {**header, "meta": {**header["meta"], field: value}}
    with Transport(rules.me, None, plan_hash, rules=rules) as transport:
        assert transport.inbox._admit([msgpack.packb(header, use_bin_type=True), *frames[1:]]) is None
        why = transport.last_rejection()
    assert why is not None and f"meta {field!r}" in why and "\n" not in why, why


@pytest.mark.parametrize("key", ["profile", "output", "security"])
def test_a_deeply_nested_value_is_quoted_short(composed: tuple[dict[str, Any], dict[str, Any]], key: str) -> None:
    """What the fuzzer found (CI, 2026-11-28): profile={'a': {'a': ...}} 38 levels deep made a 401-character line."""
    raw, types = composed
    nested: Any = None
    for _ in range(40):
        nested = {"a": nested}
    tree = {**copy.deepcopy(raw), key: nested}
    with mock.patch.object(config, "compose_raw", lambda overrides, config_dir=None: copy.deepcopy(tree)), \
            datasheets_read_once(types):
        load_or_refuse([], tree)


def test_a_rehashed_hand_edit_is_range_checked_on_load(pipeline_plan: Plan, workdir: Path) -> None:
    """A hand edit that is re-hashed passes the hash check, not the range checks (issue 53): a string hidden_size
    is one line instead of every stage's traceback, and a micro-batch count the programs were not written for is
    refused instead of training on part of each step."""
    edits = {
        "string-hidden": (replace(pipeline_plan, model=replace(pipeline_plan.model, architecture={
            **pipeline_plan.model.architecture, "hidden_size": "64"})),
            "model.architecture.hidden_size is '64': expected a whole number"),
        "more-micro-batches": (replace(pipeline_plan, train=replace(pipeline_plan.train, num_micro_batches=2 * (
            pipeline_plan.train.num_micro_batches))), "stages[0].program runs F on "),
        "null-vocab": (replace(pipeline_plan, model=replace(pipeline_plan.model, architecture={  # the fuzzer's find
            **pipeline_plan.model.architecture, "vocab_size": None})), "model.architecture.vocab_size is null"),
    }
    for name, (edited, says) in edits.items():
        path = workdir / f"{name}.json"
        replace(edited, input_hash=compute_input_hash(edited)).save(path)
        with pytest.raises(PlanError, match=re.escape(says)):
            Plan.load(path)
        code, _, err = run_cli(["show", str(path), "--no-gantt"])
        assert code == 2 and says in err and err.count("\n") <= 1, err
