"""Each schedule's step form (planner/schedule/step_form.py) against its own programs, and the rule that only the
step forms and the generators name a schedule: the solvers, bounds and searches read the form."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from hetero.errors import ConfigError
from hetero.planner.schedule.simulator import simulate
from hetero.planner.schedule.step_form import FORMS, SCHEDULES, step_form
from hetero.planner.search.simbound import StageTimes, barrier_bound
from hetero.specs import TrainSpec

ROOT = Path(__file__).resolve().parents[2]
# Where a schedule's name may appear in code (docstrings and comments aside): its form and its generator. The
# config schema takes any name and checks it against the registered forms (hetero/specs.py check_ranges); its
# default is the one name it holds, as a value (no code branches on it).
NAMING = {"planner/schedule/step_form.py", "planner/schedule/schedules.py", "hetero/program.py"}  # program.py: the list of names
DEFAULTS = {("hetero/specs.py", "1f1b")}


def _random_pipeline(rng: random.Random, most_stages: int, most_micro_batches: int, least_bwd: float
                     ) -> tuple[int, int, list[float], list[float], list[float]]:
    """(stages, micro-batches, forward s, backward s, links): random, a link free half the time."""
    s, m = rng.randint(1, most_stages), rng.randint(1, most_micro_batches)
    fwd = [rng.uniform(0.1, 2.0) for _ in range(s)]
    bwd = [rng.uniform(least_bwd, 4.0) for _ in range(s)]
    link = [rng.choice([0.0, rng.uniform(0.0, 3.0)]) for _ in range(s - 1)]
    return s, m, fwd, bwd, link


@pytest.mark.parametrize("name", SCHEDULES)
def test_held_is_what_the_programs_hold_at_their_peak(name: str) -> None:
    """A form's ``held`` prices each stage's activation memory: it must be the peak the programs reach."""
    form = step_form(name)
    rng = random.Random(7)
    for s in range(1, 6):
        for m in range(1, 9):
            fwd = [rng.uniform(0.5, 2.0) for _ in range(s)]
            bwd = [rng.uniform(1.0, 4.0) for _ in range(s)]
            send = [rng.uniform(0.0, 0.5) for _ in range(s - 1)] + [0.0]
            timeline = simulate(form.programs(s, m), fwd, bwd, send)
            assert timeline.peak_in_flight == [form.held(s - 1 - k, m) for k in range(s)], (name, s, m)
            slots = form.helds(m, s)
            assert all(slots[form.slot(p, m, s)] == form.held(p, m) for p in range(s))


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_closed_form_and_the_bound_hold_the_simulated_step_between_them(name: str) -> None:
    """Free links and equal stages: the closed form is the textbook step, which the simulator runs exactly;
    on random stages the lower bound never passes the simulator."""
    form = step_form(name)
    for s, m in ((1, 1), (3, 5), (4, 8), (5, 2)):
        fwd, bwd = [1.0] * s, [2.0] * s
        simulated = simulate(form.programs(s, m), fwd, bwd, [0.0] * s).step_time_s
        assert form.closed_form(m, fwd, bwd, [0.0] * (s - 1)) == pytest.approx(simulated) == (m + s - 1) * 3.0
    rng = random.Random(11)
    for _ in range(200):
        s, m, fwd, bwd, link = _random_pipeline(rng, 5, 8, 0.2)
        simulated = simulate(form.programs(s, m), fwd, bwd, link + [0.0]).step_time_s
        assert barrier_bound(form, m, StageTimes(fwd, bwd, link, 0.0)) <= simulated * (1 + 1e-9)


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_schedules_lower_bound_never_passes_the_simulator(name: str) -> None:
    """StepForm.least_step (its bound weights and suffix round trips, what planner/search/step_bound.py minimizes over
    every placement) on random pipelines, slow links among them: never above the simulated step, and tight
    where the pipeline is balanced."""
    form = step_form(name)
    rng = random.Random(3)
    ratios = []
    for _ in range(1500):
        s, m, fwd, bwd, link = _random_pipeline(rng, 7, 12, 0.1)
        simulated = simulate(form.programs(s, m), fwd, bwd, link + [0.0]).step_time_s
        bound = form.least_step(m, fwd, bwd, link)
        assert bound <= simulated * (1 + 1e-9), (name, s, m, fwd, bwd, link, bound, simulated)
        ratios.append(bound / simulated)
    assert sorted(ratios)[len(ratios) // 2] > 0.99  # the median: tight, not merely below
    for s, m in ((2, 4), (4, 8)):
        assert form.least_step(m, [1.0] * s, [2.0] * s, [0.0] * (s - 1)) == pytest.approx((m + s - 1) * 3.0)


def test_gpipe_has_two_periods_and_one_f_one_b_one() -> None:
    """The forms' period groups are the closed forms the solvers encode (docs/architecture.md)."""
    fwd, bwd, link = [1.0, 3.0], [2.0, 1.0], [2.5]
    assert step_form("1f1b").closed_form(4, fwd, bwd, link) == 7.0 + 5.0 + 3 * max(3.0, 4.0, 5.0)
    assert step_form("gpipe").closed_form(4, fwd, bwd, link) == 7.0 + 5.0 + 3 * (max(3.0, 2.5) + max(2.0, 2.5))


def test_the_config_takes_every_schedule_with_a_form_and_refuses_others(tmp_path: Path) -> None:
    """train.schedule is any registered step form (nothing else lists the names), and an unknown one is a
    one-line error naming the choices, in a config and in a plan file alike."""
    from dataclasses import replace

    from hetero import config as config_mod
    from hetero.errors import PlanError
    from hetero.specs import ModelSpec, PlannerOptions, check_ranges

    assert set(FORMS) == set(SCHEDULES)
    for name in SCHEDULES:
        assert config_mod.load(["model=llama8b", f"train.schedule={name}"]).train.schedule == name
    with pytest.raises(ConfigError, match=r"train.schedule must be one of \['1f1b', 'gpipe'\], got 'zb'"):
        config_mod.load(["model=llama8b", "train.schedule=zb"])
    with pytest.raises(PlanError, match="train.schedule must be one of"):
        check_ranges(ModelSpec(name="m", architecture={"model_type": "llama"}), replace(TrainSpec(), schedule="zb"), PlannerOptions(), PlanError)
    with pytest.raises(ConfigError, match="unknown schedule 'zb': choose one of 1f1b, gpipe"):
        step_form("zb")


def _names_in_code(path: Path) -> list[tuple[int, str]]:
    """String constants in a file that are a schedule's name, docstrings and ``__all__`` left out."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    docstrings |= {id(c) for node in ast.walk(tree) if isinstance(node, ast.Assign)  # __all__ names functions
                   and any(getattr(t, "id", "") == "__all__" for t in node.targets) for c in ast.walk(node.value)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            and node.value.lower() in SCHEDULES]


def test_only_the_step_forms_and_generators_name_a_schedule() -> None:
    """A solver that branches on ``schedule == "gpipe"`` is where a new schedule silently goes wrong."""
    found = [f"{path.relative_to(ROOT)}:{line} names '{value}'"
             for folder in ("planner", "runtime", "compiler", "hetero")
             for path in sorted((ROOT / folder).rglob("*.py"))
             if str(path.relative_to(ROOT)) not in NAMING
             for line, value in _names_in_code(path)
             if (str(path.relative_to(ROOT)), value) not in DEFAULTS]
    assert found == []
    assert len(_names_in_code(ROOT / "hetero/specs.py")) == 1, "hetero/specs.py: only TrainSpec.schedule's default"


def test_only_the_step_forms_call_a_schedules_generator() -> None:
    """The generators are reached through a step form (``programs``, ``chunked.programs``): a module that imports
    one, as planner/search/interleave.py and planner/replan/whatif.py imported interleaved 1F1B's, names a schedule in code,
    whether it imports it from planner/schedule/schedules.py, from a module that re-exports it, or the module itself."""
    from hetero.planner.schedule import schedules

    generators = {name for name, value in vars(schedules).items()
                  if callable(value) and getattr(value, "__module__", "") == schedules.__name__ and name[0] != "_"}
    assert {"one_f_one_b", "gpipe", "interleaved_one_f_one_b"} <= generators
    found = []
    for folder in ("planner", "runtime", "compiler", "hetero", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel in NAMING:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom | ast.Import) else []
                if any(n in generators or n == "schedules" or n.endswith("schedule.schedules") for n in names) or (
                        isinstance(node, ast.ImportFrom) and (node.module or "").endswith("schedule.schedules")):
                    found.append(f"{rel}:{node.lineno} imports {', '.join(names)}")
    assert found == []


def _m_minus_one(node: ast.AST) -> bool:
    """``m - 1`` (or ``self.m - 1``, ``train.num_micro_batches - 1``): the closed form's multiplier."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub)
            and isinstance(node.right, ast.Constant) and node.right.value == 1):
        return False
    left = node.left
    name = left.id if isinstance(left, ast.Name) else left.attr if isinstance(left, ast.Attribute) else ""
    return name in ("m", "num_micro_batches")


def test_only_the_step_form_assembles_a_base_plus_m_minus_one_periods() -> None:
    """``base + (m - 1) x period`` is written once (step_form.linear_step): a solver or bound that assembles its
    own is where a change to the closed form (a per-step overhead, a new group) silently misses one of them."""
    found = []
    for path in sorted((ROOT / "planner").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)):
                continue
            for side in (node.left, node.right):
                if (isinstance(side, ast.BinOp) and isinstance(side.op, ast.Mult)
                        and (_m_minus_one(side.left) or _m_minus_one(side.right))):
                    found.append(f"{rel}:{node.lineno}")
    assert [f.split(":")[0] for f in found] == ["planner/schedule/step_form.py"], found  # linear_step alone
