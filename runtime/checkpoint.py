"""Stage checkpoints: LoRA weights + AdamW state + LR-schedule state, safetensors + JSON, whole-model keys.

A stage turns its training state into plain data (``stage_payload``: a dict of named CPU tensors and a
JSON-able dict) that travels to the coordinator as one ``checkpoint`` message and is written by it as
``checkpoints/step-NNNNNN/stage<k>.safetensors`` + ``stage<k>.json``. Keys are the whole model's PEFT
keys (``base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight``), so a checkpoint does not
depend on the split: a re-planned run can take any stage's tensors from the union of the files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from hetero.errors import CheckpointError
from hetero.runtime.executor import Executor

CHECKPOINT_FORMAT = 1
LORA, EXP_AVG, EXP_AVG_SQ = "lora/", "exp_avg/", "exp_avg_sq/"


def peft_key(param_name: str, adapter: str = "default") -> str:
    """The PEFT state-dict key of a LoRA parameter name (peft drops the adapter name)."""
    return param_name.replace(f".{adapter}.", ".")


def stage_payload(executor: Executor, plan_hash: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Everything needed to resume this stage, as named CPU tensors + JSON-able metadata."""
    tensors: dict[str, torch.Tensor] = {}
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


def restore_stage(executor: Executor, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Load a stage payload back into a freshly built executor (same stage keys)."""
    names = [peft_key(n) for n, _ in executor.stage.lora_named_parameters()]
    missing = [k for k in names if LORA + k not in tensors]
    if missing:
        raise CheckpointError(f"checkpoint lacks LoRA tensor {missing[0]} of stage {executor.stage.index}")
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
        from hetero.runtime.lr import make_scheduler

        # The schedule is a pure function of the step: rebuilding it also sets each group's lr
        # (LambdaLR.load_state_dict would leave the optimizer at the initial lr).
        executor.scheduler = make_scheduler(executor.optimizer, executor.train, last_step=done - 1)
    executor.steps_done = done


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:06d}"


def save_stage_checkpoint(directory: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write one stage's payload as stage<k>.safetensors + stage<k>.json under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    k = int(meta["stage"])
    # safetensors refuses non-contiguous or shared storage; received tensors view one buffer each.
    save_file({n: t.contiguous().clone() for n, t in tensors.items()}, str(directory / f"stage{k}.safetensors"),
              metadata={"format": str(CHECKPOINT_FORMAT), "plan_hash": str(meta.get("plan_hash", ""))})
    (directory / f"stage{k}.json").write_text(json.dumps(meta, indent=1))
    return directory / f"stage{k}.json"


def load_stage_checkpoint(directory: Path, k: int, plan_hash: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Read stage k's payload back; checks format and (optionally) the plan hash."""
    meta_path, tensor_path = directory / f"stage{k}.json", directory / f"stage{k}.safetensors"
    if not meta_path.is_file() or not tensor_path.is_file():
        raise CheckpointError(f"{directory}: no checkpoint of stage {k} (stage{k}.json / .safetensors missing)")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{meta_path}: not valid JSON ({exc})") from None
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{meta_path}: checkpoint format {meta.get('format')}, this hetero reads {CHECKPOINT_FORMAT}")
    if plan_hash is not None and meta.get("plan_hash") != plan_hash:
        raise CheckpointError(
            f"{meta_path}: written by plan {meta.get('plan_hash')}, this run's plan is {plan_hash}"
        )
    return load_file(str(tensor_path)), meta


def lora_from_payload(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The LoRA weights (PEFT keys) inside a stage payload."""
    return {n[len(LORA):]: t for n, t in tensors.items() if n.startswith(LORA)}


def load_checkpoint_union(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every stage's payload in a checkpoint directory, merged (keys are whole-model, so any split can resume)."""
    directory = Path(directory)
    if not (directory / "COMPLETE").is_file():
        raise CheckpointError(f"{directory}: not a complete checkpoint (no COMPLETE marker: some stage never wrote)")
    metas = sorted(directory.glob("stage*.json"))
    tensors: dict[str, torch.Tensor] = {}
    merged: dict[str, Any] = {"format": CHECKPOINT_FORMAT, "adam_steps": {}, "keys": []}
    steps = set()
    for path in metas:
        part, meta = load_stage_checkpoint(directory, int(path.stem[len("stage"):]))
        tensors.update(part)
        merged["adam_steps"].update(meta.get("adam_steps", {}))
        merged["keys"] += meta.get("keys", [])
        steps.add(int(meta["step"]))
        merged["plan_hash"] = meta.get("plan_hash")
    if len(steps) != 1:
        raise CheckpointError(f"{directory}: stage files disagree on the step ({sorted(steps)}); it is corrupt")
    merged["step"] = steps.pop()
    return tensors, merged


def select_payload(tensors: dict[str, torch.Tensor], meta: dict[str, Any], keys: list[str],
                   stage: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The part of a merged payload that one stage (holding LoRA ``keys``) needs."""
    missing = [k for k in keys if LORA + k not in tensors]
    if missing:
        raise CheckpointError(f"the checkpoint has no LoRA tensor {missing[0]} for stage {stage}: "
                              "it was trained with another model or other lora.target_modules")
    part = {p + k: tensors[p + k] for k in keys for p in (LORA, EXP_AVG, EXP_AVG_SQ) if p + k in tensors}
    steps = {k: meta["adam_steps"][k] for k in keys if k in meta["adam_steps"]}
    return part, {**meta, "stage": stage, "keys": keys, "adam_steps": steps}
