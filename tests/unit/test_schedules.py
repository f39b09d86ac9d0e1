"""Schedules (1F1B, GPipe) and the simulator that validates them."""

from __future__ import annotations

import random

import pytest

from hetero.errors import ConfigError
from hetero.planner.model.objective import pipeline_step_time
from hetero.planner.schedule.schedules import gpipe, one_f_one_b
from hetero.planner.schedule.simulator import ScheduleError, simulate
from hetero.planner.schedule.step_form import programs_for
from hetero.program import Action, format_program, parse_program


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_every_shape_simulates(schedule: str) -> None:
    for s in range(1, 6):
        for m in range(1, 10):
            progs = programs_for(schedule, s, m)
            tl = simulate(progs, [1.0] * s, [2.0] * s, [0.25] * s)
            for k in range(s):
                ops = [e for e in tl.stage_events(k)]
                assert sorted((e.op, e.mb) for e in ops) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
                assert progs[k][-1] == Action("STEP")
            assert not any(a.op in ("RA", "SG") for a in progs[0])
            assert not any(a.op in ("SA", "RG") for a in progs[-1])
            # Round trip through the text form the plan stores.
            assert [parse_program(format_program(p)) for p in progs] == progs


def test_single_stage_programs() -> None:
    assert format_program(one_f_one_b(1, 3)[0]) == ["F0", "B0", "F1", "B1", "F2", "B2", "STEP"]
    assert format_program(gpipe(1, 3)[0]) == ["F0", "F1", "F2", "B0", "B1", "B2", "STEP"]


def test_one_f_one_b_textbook_step_time_and_in_flight() -> None:
    f, b = 1.0, 2.0
    for s in range(1, 6):
        for m in range(1, 10):
            tl = simulate(one_f_one_b(s, m), [f] * s, [b] * s, [0.0] * s)
            assert tl.step_time_s == pytest.approx((m + s - 1) * (f + b))
            assert tl.peak_in_flight == [min(s - k, m) for k in range(s)]
            assert tl.bubble_fraction == pytest.approx(1 - m / (m + s - 1))
            g = simulate(gpipe(s, m), [f] * s, [b] * s, [0.0] * s)
            assert g.peak_in_flight == [m] * s


def test_gpipe_closed_form_matches_simulator_exactly() -> None:
    rng = random.Random(1)
    for _ in range(200):
        s, m = rng.randint(1, 5), rng.randint(1, 9)
        f = [rng.uniform(0.1, 2) for _ in range(s)]
        b = [x * rng.uniform(1, 3) for x in f]
        c = [rng.uniform(0, 1.5) for _ in range(s - 1)]
        tl = simulate(gpipe(s, m), f, b, c + [0.0])
        assert tl.step_time_s == pytest.approx(pipeline_step_time("gpipe", m, f, b, c), rel=1e-9)


def test_one_f_one_b_closed_form_is_close_to_simulator() -> None:
    # The ILP's 1F1B objective is a proxy (see objective.py); it must stay close on typical inputs.
    rng = random.Random(2)
    errors = []
    for _ in range(300):
        s, m = rng.randint(2, 5), rng.randint(2, 9)
        f = [rng.uniform(0.5, 1.5) for _ in range(s)]
        b = [2 * x for x in f]
        c = [rng.uniform(0, 0.3) for _ in range(s - 1)]
        sim = simulate(one_f_one_b(s, m), f, b, c + [0.0]).step_time_s
        errors.append(abs(sim / pipeline_step_time("1f1b", m, f, b, c) - 1))
    errors.sort()
    assert errors[len(errors) // 2] < 0.05
    assert errors[-1] < 0.25


def test_comm_delays_dependent_stage() -> None:
    tl = simulate(one_f_one_b(2, 1), [1.0, 1.0], [1.0, 1.0], [0.5, 0.0])
    f1 = tl.stage_events(1)[0]
    assert f1.op == "F" and f1.start_s == pytest.approx(1.5)
    assert tl.step_time_s == pytest.approx(1 + 0.5 + 1 + 1 + 0.5 + 1)


def test_deadlock_is_reported_with_stuck_stages() -> None:
    # Both stages wait for a gradient/activation the other sends only later.
    progs = [parse_program(["RG0", "F0", "SA0", "B0", "STEP"]), parse_program(["RA0", "F0", "B0", "STEP"])]
    progs[1].insert(3, Action("SG", 0))
    with pytest.raises(ScheduleError, match="deadlock.*stage 0 waits at RG0.*stage 1 waits at RA0"):
        simulate(progs, [1, 1], [1, 1], [0, 0])


def test_missing_backward_is_rejected() -> None:
    progs = one_f_one_b(2, 3)
    progs[1] = [a for a in progs[1] if a != Action("B", 2)]
    with pytest.raises(ScheduleError, match=r"stage 1: every micro-batch needs exactly one B; missing \[2\]"):
        simulate(progs, [1, 1], [1, 1], [0, 0])


def test_unmatched_send_and_order_errors() -> None:
    progs = one_f_one_b(2, 2)
    progs[0] = [a for a in progs[0] if a != Action("SA", 1)]
    with pytest.raises(ScheduleError, match="activations sent"):
        simulate(progs, [1, 1], [1, 1], [0, 0])
    bad = [parse_program(["F0", "B0", "SA0", "STEP"]), parse_program(["RA0", "F0", "B0", "STEP"])]
    with pytest.raises(ScheduleError, match="gradient"):
        simulate(bad, [1, 1], [1, 1], [0, 0])
    with pytest.raises(ScheduleError, match="end with exactly one STEP"):
        simulate([parse_program(["F0", "STEP", "B0"])], [1], [1], [0])


def test_unknown_schedule_and_bad_sizes() -> None:
    with pytest.raises(ConfigError, match="unknown schedule 'zb'"):
        programs_for("zb", 2, 2)
    with pytest.raises(ConfigError):
        one_f_one_b(2, 0)


def test_overheads_delay_their_stage_and_the_message() -> None:
    """Encode before the link, decode after the arrival, both on the stage's own clock."""
    base = simulate(one_f_one_b(2, 1), [1.0, 1.0], [1.0, 1.0], [0.5, 0.0])
    over = [{"SA": 0.1, "RG": 0.2}, {"RA": 0.3, "SG": 0.4}]
    tl = simulate(one_f_one_b(2, 1), [1.0, 1.0], [1.0, 1.0], [0.5, 0.0], overhead_s=over)
    f1 = tl.stage_events(1)[0]
    assert f1.start_s == pytest.approx(1.0 + 0.1 + 0.5 + 0.3)  # F0, encode, link, decode
    # Then F1 + B1, encode the gradient, link back, decode, B0.
    assert tl.step_time_s == pytest.approx(base.step_time_s + 0.1 + 0.3 + 0.4 + 0.2)
    assert tl.busy_fraction[0] == pytest.approx(2.0 / tl.step_time_s)  # busy stays compute only


def test_step_is_a_barrier_with_the_gradient_norm_round_trip() -> None:
    """No stage steps before every stage finished its backward; then round trip + its optimizer."""
    progs = one_f_one_b(3, 4)
    f, b, c = [1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [0.0, 0.0, 0.0]
    plain = simulate(progs, f, b, c)
    opt = [0.5, 0.1, 0.2]
    tl = simulate(progs, f, b, c, overhead_s=[{"STEP": o} for o in opt], sync_s=[0.05] * 3)
    last_backward = max(e.end_s for e in tl.events if e.op == "B")
    assert last_backward == pytest.approx(plain.step_time_s)
    steps = sorted((e for e in tl.events if e.op == "STEP"), key=lambda e: e.stage)
    assert all(e.end_s == pytest.approx(last_backward + 0.05 + o) for e, o in zip(steps, opt, strict=True))
    assert tl.step_time_s == pytest.approx(plain.step_time_s + 0.05 + 0.5)
    with pytest.raises(ScheduleError, match="overhead and sync"):
        simulate(progs, f, b, c, sync_s=[0.0])
