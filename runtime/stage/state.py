"""A stage's training state as plain data: what it sends the coordinator to checkpoint, and how it loads it back.

``stage_payload`` turns LoRA weights, AdamW moments and the LR schedule's step into named CPU tensors under
the whole model's PEFT keys plus a JSON-able dict; ``restore_stage`` loads them into a freshly built executor.
The coordinator writes payloads as checkpoints (runtime/run/checkpoint.py, which also reads and checks them);
runtime/base/payloads.py says after which steps the stages send them.
"""

from __future__ import annotations

from typing import Any

import torch

from hetero.errors import CheckpointError
from hetero.runtime.stage.lora import peft_key

CHECKPOINT_FORMAT = 1
# LoRA weights and AdamW moments are float32 on every device (runtime/stage/lora.py), and so in every checkpoint.
CHECKPOINT_DTYPE = torch.float32
LORA, EXP_AVG, EXP_AVG_SQ = "lora/", "exp_avg/", "exp_avg_sq/"


def stage_payload(executor: Any, plan_hash: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Everything needed to resume this stage, as named CPU tensors + JSON-able metadata (an interleaved device's:
    the union of its chunks', whose keys are disjoint)."""
    chunks = getattr(executor, "executors", None)  # runtime/stage/chunks.py's ChunkedExecutor
    if chunks is not None:
        tensors, meta = {}, None
        for part in chunks:
            more, its = stage_payload(part, plan_hash)
            tensors.update(more)
            if meta is None:
                meta = its
            else:
                meta["keys"] += its["keys"]
                meta["adam_steps"].update(its["adam_steps"])
        assert meta is not None
        return tensors, {**meta, "stage": executor.device, "step": executor.steps_done}
    tensors = {}
    names = [peft_key(n) for n, _ in executor.stage.lora_named_parameters()]
    steps: dict[str, float] = {}
    for key, p in zip(names, executor.params, strict=True):
        tensors[LORA + key] = p.detach().to("cpu", torch.float32).contiguous()
        state = executor.optimizer.state.get(p, {}) if executor.optimizer is not None else {}
        if "exp_avg" in state:
            tensors[EXP_AVG + key] = state["exp_avg"].detach().to("cpu").contiguous()
            tensors[EXP_AVG_SQ + key] = state["exp_avg_sq"].detach().to("cpu").contiguous()
            steps[key] = float(state["step"])
    meta = {
        "format": CHECKPOINT_FORMAT,
        "plan_hash": plan_hash,
        "stage": executor.stage.index,
        "step": executor.steps_done,  # optimizer steps completed
        "keys": names,
        "adam_steps": steps,
        "scheduler": _jsonable(executor.scheduler.state_dict()) if executor.scheduler is not None else None,
    }
    return tensors, meta


def _jsonable(state: dict[str, Any]) -> dict[str, Any]:
    # LambdaLR's state holds its lambdas as None (functions are not saved); everything else is numbers.
    return {k: v for k, v in state.items() if isinstance(v, (int, float, str, bool, list, type(None)))}


def restore_stage(executor: Any, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Load a stage payload back into a freshly built executor (same stage keys; an interleaved device's chunks each
    take theirs)."""
    chunks = getattr(executor, "executors", None)
    if chunks is not None:
        for part in chunks:
            restore_stage(part, tensors, meta)
        executor.steps_done = int(meta["step"])
        return
    names = [peft_key(n) for n, _ in executor.stage.lora_named_parameters()]
    k = executor.stage.index
    missing = [key for key in names if LORA + key not in tensors]
    if missing:
        raise CheckpointError(f"checkpoint lacks LoRA tensor {missing[0]} of stage {k}")
    for key, p in zip(names, executor.params, strict=True):
        if tuple(tensors[LORA + key].shape) != tuple(p.shape):
            raise CheckpointError(
                f"checkpoint tensor {key} has shape {tuple(tensors[LORA + key].shape)}, stage {k}'s LoRA parameter "
                f"{tuple(p.shape)}: it was trained with another model or another lora.r"
            )
    with torch.no_grad():
        for key, p in zip(names, executor.params, strict=True):
            p.copy_(tensors[LORA + key].to(p.device, p.dtype))
            if executor.optimizer is not None and EXP_AVG + key in tensors:
                executor.optimizer.state[p] = {
                    "step": torch.tensor(float(meta["adam_steps"][key])),
                    "exp_avg": tensors[EXP_AVG + key].to(p.device).clone(),
                    "exp_avg_sq": tensors[EXP_AVG_SQ + key].to(p.device).clone(),
                }
    done = int(meta["step"])
    if executor.optimizer is not None and done > 0:
        from hetero.runtime.stage.lr import make_scheduler

        # The schedule is a pure function of the step: rebuilding it also sets each group's lr
        # (LambdaLR.load_state_dict would leave the optimizer at the initial lr).
        executor.scheduler = make_scheduler(executor.optimizer, executor.train, last_step=done - 1)
    executor.steps_done = done
