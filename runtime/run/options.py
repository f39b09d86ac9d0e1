"""How one `hetero run` is run (RunOptions: run directory, host, timeouts, rebalancing), and where its
coordinator listens. Torch-free: the CLI builds these before anything heavy is imported."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetero.errors import PlanError
from hetero.plan import Plan
from hetero.protocol import FAILURE_TIMEOUT_S, LOAD_TIMEOUT_S
from hetero.runtime.base.rundir import rerun_options
from hetero.runtime.run.metrics_file import RebalanceEvent, RecoveryEvent


def coordinator_endpoint(plan: Plan, host: str | None = None, port: int | None = None) -> str:
    """Where the coordinator listens: stage 0's host (or ``host``), on its base port - 1 unless given."""
    name = host or plan.stages[0].host
    try:
        spec = plan.cluster.host(name)
    except KeyError:
        raise PlanError(f"host '{name}' is not in the plan; hosts: {', '.join(h.name for h in plan.cluster.hosts)}") from None
    return f"tcp://{spec.address}:{port if port is not None else spec.port - 1}"


# The longest one optimizer step may take before the run stops with an error (`hetero run runtime.step_timeout_s=`):
# this many times the plan's predicted step, and never less than the floor (a first step warms caches, a
# prediction may be rough; the heartbeats already catch a stage that is hung or gone, within failure_timeout_s).
STEP_TIMEOUT_FACTOR, STEP_TIMEOUT_MIN_S = 20.0, 60.0


def step_timeout_s(plan: Plan, given: float | None = None) -> float:
    """``given`` (runtime.step_timeout_s), else STEP_TIMEOUT_FACTOR x the plan's predicted step, at least STEP_TIMEOUT_MIN_S."""
    if given is not None:
        return float(given)
    predicted = plan.prediction.step_time_s
    return max(STEP_TIMEOUT_MIN_S, STEP_TIMEOUT_FACTOR * predicted if math.isfinite(predicted) else 0.0)


def step_timeout_hint(plan: Plan, timeout_s: float, see: str) -> str:
    """What to do when a step took longer than ``timeout_s``: ``see`` (the logs), or a longer bound if it is only slow."""
    return (f"the step took longer than runtime.step_timeout_s ({timeout_s:g} s; the plan predicts "
            f"{plan.prediction.step_time_s:.3g} s a step): a stage is stuck (waiting for a message that never came) "
            f"or far slower than planned; {see}, and if it is only slow, run with "
            f"runtime.step_timeout_s={max(2 * timeout_s, STEP_TIMEOUT_MIN_S):g} or more")


# A run writes a checkpoint after this many seconds of training since the last one (`hetero run
# runtime.snapshot_every_s=`; 0: only train.checkpoint_every's and the last), so a run that loses a host, or its
# coordinator, loses at most this much work. The newest two such snapshots are kept (records.py).
SNAPSHOT_EVERY_S = 900.0
# A run recovers from this many lost devices (`hetero run runtime.max_recoveries=`), then stops with the resume command.
MAX_RECOVERIES = 3


@dataclass(frozen=True)
class RunOptions:
    run_dir: Path
    host: str | None = None  # the host this coordinator runs on (default: stage 0's)
    port: int | None = None  # coordinator port (default: that host's base port - 1)
    handshake_timeout_s: float = 600.0  # remote hosts may still be loading or quantizing weights
    step_timeout_s: float | None = None  # runtime.step_timeout_s; None: step_timeout_s(plan) decides
    failure_timeout_s: float = FAILURE_TIMEOUT_S  # a working peer without heartbeat for this long is dead
    load_timeout_s: float = LOAD_TIMEOUT_S  # the same while a stage builds (loading may hold the GIL)
    progress: bool = True
    resume: Path | None = None  # a checkpoints/step-N directory (of this or another split of the model)
    checkpoint: tuple[dict[str, Any], dict[str, Any]] | None = None  # its (tensors, meta), if already read
    batches: Any = None  # the run's StepBatches, if already built (`hetero run` checks the data first)
    key_dirs: list[Path] = field(default_factory=list)  # where this host's key files are (hetero/security.py)
    ssh_hosts: list[Any] = field(default_factory=list)  # runtime/run/ssh.py SshHost: hosts this run starts over ssh
    earlier_plans: tuple[str, ...] = ()  # input hashes of the plans this run went through before (runtime.elastic)
    ssh_workers: Any = None  # runtime/run/ssh.py SshWorkers already running: a re-planned run keeps them (elastic.py)
    launcher: Any = None  # runtime/run/launcher.py StageLauncher: forks this host's stages (None: fresh interpreters)
    rebalance: str = "auto"  # runtime.rebalance: move layers when a device's speed changes (runtime/run/moves.py)
    snapshot_every_s: float = SNAPSHOT_EVERY_S  # runtime.snapshot_every_s: a checkpoint after this much training
    moves: dict[int, list[int]] = field(default_factory=dict)  # step -> split to move to after it, whatever the times
    replans: dict[int, dict[str, float]] = field(default_factory=dict)  # step -> device speeds to re-plan at after it
    replans_made: int = 0  # rebalancing re-plans earlier in this run (runtime/run/replan_moves.py)
    elastic: str = "auto"  # runtime.elastic: auto: go on without a lost device (runtime/run/elastic.py); off: stop
    max_recoveries: int = MAX_RECOVERIES  # runtime.max_recoveries: losses a run recovers from before it stops
    recovery: RecoveryEvent | RebalanceEvent | None = None  # the recovery (or re-plan move) this run continues: its
    # metrics.jsonl event, to complete
    wandb: str | None = None  # runtime.wandb: a Weights & Biases project to log the steps to (runtime/run/wandb_log.py)

    @property
    def rerun(self) -> tuple[str, ...]:
        """This run's own --host/--port: every command it suggests repeats them (rundir.run_command)."""
        return rerun_options(self.host, self.port)
