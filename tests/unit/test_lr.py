"""LR schedules match transformers.get_scheduler step for step."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import get_scheduler

from hetero.errors import ConfigError
from hetero.runtime.stage.lr import lr_multiplier, make_scheduler
from hetero.specs import TrainSpec

HF_NAME = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def _optimizer(lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _lrs(scheduler: torch.optim.lr_scheduler.LRScheduler, optimizer: torch.optim.Optimizer, n: int) -> list[float]:
    """The LR each of n optimizer steps runs with (read before the step, as a training loop does)."""
    out = []
    for _ in range(n):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("name", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup,steps", [(0, 10), (3, 10), (5, 7), (1, 1)])
def test_matches_transformers(name: str, warmup: int, steps: int) -> None:
    train = TrainSpec(lr=3e-3, scheduler=name, warmup_steps=warmup, steps=steps)  # type: ignore[arg-type]
    n = steps + 3  # past the end too: decays stay at 0, constant stays at lr
    ref_opt = _optimizer(train.lr)
    ref = _lrs(get_scheduler(HF_NAME[name], ref_opt, num_warmup_steps=warmup, num_training_steps=steps), ref_opt, n)
    ours_opt = _optimizer(train.lr)
    ours = _lrs(make_scheduler(ours_opt, train), ours_opt, n)
    assert ours == pytest.approx(ref, rel=1e-12, abs=1e-15)
    assert [train.lr * lr_multiplier(k, train) for k in range(n)] == pytest.approx(ref, rel=1e-12, abs=1e-15)


def test_shapes_by_hand() -> None:
    cos = TrainSpec(scheduler="cosine", warmup_steps=2, steps=10)
    assert lr_multiplier(0, cos) == 0.0
    assert lr_multiplier(1, cos) == 0.5
    assert lr_multiplier(2, cos) == 1.0
    assert lr_multiplier(6, cos) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_multiplier(10, cos) == pytest.approx(0.0)
    lin = TrainSpec(scheduler="linear", warmup_steps=0, steps=4)
    assert [lr_multiplier(k, lin) for k in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]


def test_resume_continues_the_schedule() -> None:
    train = TrainSpec(lr=1e-3, scheduler="cosine", warmup_steps=2, steps=12)
    opt = _optimizer(train.lr)
    full = _lrs(make_scheduler(opt, train), opt, 12)
    resumed_opt = _optimizer(train.lr)
    resumed = _lrs(make_scheduler(resumed_opt, train, last_step=4), resumed_opt, 7)
    assert resumed == pytest.approx(full[5:12], rel=1e-12)


@pytest.mark.parametrize(
    "kwargs", [{"scheduler": "exponential"}, {"warmup_steps": -1}, {"steps": 0}]
)
def test_bad_config(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        lr_multiplier(0, TrainSpec(**kwargs))
