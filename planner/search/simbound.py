"""What the simulator's step time can never beat: a lower bound on any placement's simulated step.

The plan reports the simulator's step time (planner/schedule/simulator.py), so the placement search ranks by it
(planner/search/simsearch.py) and prunes with this bound, which holds for every placement because each term is
one chain of events the simulator must run one after another. Per stage k (``e_k``: its compute and
message overheads per micro-batch, ``phi_k``/``beta_k`` the forward/backward halves, ``c_k`` the link
to stage k+1, ``A_k = sum_{j<k} (phi_j + c_j)`` the first activation's arrival, ``T_k = sum_{j<k}
(c_j + beta_j)`` the last gradient's trip from stage k down to stage 0):

- work: ``A_k + m e_k + idle_k + T_k`` (the stage is serial; nothing of it starts before the first
  activation, and the last micro-batch's gradient must still reach stage 0). ``idle_k``: micro-batch
  0's gradient comes back ``D_k = 2 sum_{j>=k} c_j + sum_{j>k} e_j`` after its forward, and the stage
  has only q - 1 forwards to fill that wait (q = min(S - k, m) under 1F1B, m under GPipe); likewise the
  last micro-batch's, with q - 1 backwards. Under 1F1B with m > q the two waits are apart and add up;
  otherwise they overlap and the larger counts;
- links: ``base + (m - 1) c_k`` (a link carries one tensor at a time; ``base`` is the first
  micro-batch's whole trip down and back); full duplex: c, not 2c;
- 1F1B round trips: stage k holds at most ``q = min(S - k, m)`` micro-batches, so its forward of
  micro-batch i + q waits for the backward of i, which waits for i's round trip downstream
  (``Gamma_k = e_k + 2 sum_{j>=k} c_j + sum_{j>k} e_j``): ``A_k + r phi_k + (floor((m-1)/q) + 1)
  Gamma_k + T_k`` with r = (m - 1) mod q;

and then the optimizer step: the simulator's STEP is a barrier, so the step is exactly the barrier
plus ``max_k (sync_k + STEP_k)``. tests/unit/test_planner_simulated.py checks the bound against the
simulator on random placements.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero.planner.model.cost import CostTable
from hetero.planner.model.objective import Evaluation
from hetero.planner.schedule.step_form import StepForm, linear_step


@dataclass(frozen=True)
class StageTimes:
    """One placement's per-stage numbers as the simulator sees them (per micro-batch)."""

    phi: list[float]  # receive-activation overhead + forward + send-activation overhead
    beta: list[float]  # receive-gradient overhead + backward + send-gradient overhead
    link: list[float]  # link k -> k+1 (len S - 1)
    finish: float  # max_k (sync_k + STEP_k): what every step pays after the barrier


def stage_times(ev: Evaluation) -> StageTimes:
    """The bound's inputs from an evaluation (the same numbers baselines.predict simulates)."""
    s = len(ev.fwd_s)
    over = ev.overhead_s or [{} for _ in range(s)]
    sync = ev.sync_s or [0.0] * s
    phi = [ov.get("RA", 0.0) + f + ov.get("SA", 0.0) for ov, f in zip(over, ev.fwd_s, strict=True)]
    beta = [ov.get("RG", 0.0) + b + ov.get("SG", 0.0) for ov, b in zip(over, ev.bwd_s, strict=True)]
    finish = max(y + ov.get("STEP", 0.0) for y, ov in zip(sync, over, strict=True))
    return StageTimes(phi, beta, list(ev.send_s[:-1]), finish)


def barrier_bound(form: StepForm, m: int, times: StageTimes) -> float:
    """A lower bound on when the last stage reaches its optimizer step (the module docstring's terms)."""
    phi, beta, link = times.phi, times.beta, times.link
    s = len(phi)
    e = [p + b for p, b in zip(phi, beta, strict=True)]
    base = sum(e) + 2.0 * sum(link)
    best = max([base] + [linear_step(base, m, c) for c in link])
    arrive = tail = 0.0  # A_k and T_k
    downstream = [0.0] * (s + 1)  # sum_{j >= k} (e_j + 2 c_j), c_{S-1} = 0
    for k in range(s - 1, -1, -1):
        downstream[k] = downstream[k + 1] + e[k] + (2.0 * link[k] if k < s - 1 else 0.0)
    for k in range(s):
        idle = 0.0
        if k < s - 1:
            q = form.held(s - 1 - k, m)
            trip = downstream[k + 1] + 2.0 * link[k]  # D_k: F_i's block end to its gradient's arrival
            first, last = max(0.0, trip - (q - 1) * phi[k]), max(0.0, trip - (q - 1) * beta[k])
            idle = first + last if q < m else max(first, last)
            if form.alternates:
                cycle = downstream[k]  # Gamma_k = e_k + D_k
                best = max(best, arrive + ((m - 1) % q) * phi[k] + ((m - 1) // q + 1) * cycle + tail)
        best = max(best, arrive + m * e[k] + idle + tail)
        if k < s - 1:
            arrive += phi[k] + link[k]
            tail += link[k] + beta[k]
    return best


def lower_bound_s(table: CostTable, ev: Evaluation) -> float:
    """A step time the simulator can only meet or exceed for this placement."""
    times = stage_times(ev)
    return barrier_bound(table.form, table.num_micro_batches, times) + times.finish
