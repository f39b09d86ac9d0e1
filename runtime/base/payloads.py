"""After which steps the stages send their state: the rule the coordinator and every stage follow (torch-free)."""

from __future__ import annotations

from hetero.specs import TrainSpec


def checkpoint_due(train: TrainSpec, step: int) -> bool:
    """Whether a checkpoint is written after ``step`` whatever the clock says: the last step, or train.checkpoint_every's."""
    done = step + 1
    return done == train.steps or (train.checkpoint_every > 0 and done % train.checkpoint_every == 0)


def payload_due(train: TrainSpec, eval_every: int, step: int) -> bool:
    """After ``step``, do the stages send their state (a checkpoint, the adapter for evaluation, the last)?"""
    return checkpoint_due(train, step) or (eval_every > 0 and (step + 1) % eval_every == 0)


def stage_eval_due(every: int, steps: int, step: int) -> bool:
    """After ``step``, do the training stages evaluate (every ``every`` steps, and after the last)?"""
    return every > 0 and ((step + 1) % every == 0 or step + 1 == steps)
