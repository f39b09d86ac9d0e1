"""Learning-rate schedules: constant | linear | cosine, each with linear warmup (HF definitions).

``lr_multiplier(k, train)`` is the factor applied to ``train.lr`` for optimizer step ``k`` (0-based):
the same numbers as ``transformers.get_scheduler`` ("constant_with_warmup", "linear", "cosine"),
computed here so a stage can also report or resume its LR without building a scheduler.
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from hetero.errors import ConfigError
from hetero.specs import TrainSpec

SCHEDULERS = ("constant", "linear", "cosine")


def _check(train: TrainSpec) -> None:
    if train.scheduler not in SCHEDULERS:
        raise ConfigError(f"train.scheduler '{train.scheduler}': expected one of {list(SCHEDULERS)}")
    if train.warmup_steps < 0:
        raise ConfigError(f"train.warmup_steps must be >= 0, got {train.warmup_steps}")
    if train.steps < 1:
        raise ConfigError(f"train.steps must be >= 1, got {train.steps}")


def lr_multiplier(step: int, train: TrainSpec) -> float:
    """Factor on ``train.lr`` at optimizer step ``step`` (0-based): warmup, then constant/linear/cosine."""
    _check(train)
    warmup = train.warmup_steps
    if step < warmup:
        return step / max(1, warmup)
    if train.scheduler == "constant":
        return 1.0
    # Decay reaches 0 at step == train.steps and stays there (steps past the end are clamped).
    span = max(1, train.steps - warmup)
    if train.scheduler == "linear":
        return max(0.0, (train.steps - step) / span)
    progress = (step - warmup) / span
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def make_scheduler(optimizer: Optimizer, train: TrainSpec, last_step: int = -1) -> LambdaLR:
    """A LambdaLR over ``optimizer`` following ``lr_multiplier``; ``last_step`` >= 0 resumes after that step."""
    _check(train)
    if last_step >= 0:
        # LambdaLR needs 'initial_lr' in each group to resume; it is the configured base LR.
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
    return LambdaLR(optimizer, lambda k: lr_multiplier(k, train), last_epoch=last_step)
