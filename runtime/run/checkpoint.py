"""Stage checkpoints: LoRA weights + AdamW state + LR-schedule state, safetensors + JSON, whole-model keys.

A stage turns its training state into plain data (``stage_payload``: a dict of named CPU tensors and a
JSON-able dict) that travels to the coordinator as one ``checkpoint`` message and is written by it as
``checkpoints/step-NNNNNN/stage<k>.safetensors`` + ``stage<k>.json``. Keys are the whole model's PEFT
keys (``base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight``), so a checkpoint does not
depend on the split: a re-planned run can take any stage's tensors from the union of the files.

``write_checkpoint`` writes a step directory whole or not at all (rundir.staging_dir: COMPLETE last,
then one rename); loading checks every file, so a truncated or edited checkpoint is one line, not a
traceback.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from hetero.errors import CheckpointError
from hetero.runtime.base.rundir import (
    CHECKPOINTS,
    COMPLETE,
    checkpoint_dir,
    checkpoint_step,
    complete_checkpoints,
    staging_dir,
    write_bytes,
    write_failure,
)
from hetero.runtime.stage.state import CHECKPOINT_DTYPE, CHECKPOINT_FORMAT, EXP_AVG, EXP_AVG_SQ, LORA

_STAGE_JSON = re.compile(r"stage(\d+)\.json")
SNAPSHOTS_KEPT = 2  # the newest time-based checkpoints kept: one to fall back on if the newest fails its checks
SHA256 = "tensors_sha256"  # stage<k>.json: sha256 of stage<k>.safetensors (absent in checkpoints written before it)
# stage<k>.json and COMPLETE: sha256 of the file's own JSON without this key (absent in checkpoints written before
# it). A flipped bit in the AdamW step counts or the recorded lr is valid JSON and would resume silently otherwise.
SEAL = "json_sha256"


def seal(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with its own checksum under SEAL (over its canonical JSON without it)."""
    rest = {k: v for k, v in record.items() if k != SEAL}
    return {**rest, SEAL: _json_sha256(rest)}


def _json_sha256(record: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_seal(record: Any, path: Path) -> None:
    """``record`` (read from ``path``) matches the checksum it was written with (older files have none)."""
    if not isinstance(record, dict):
        return
    # An unsealed record is one from before seals, unless a key is the seal's name with one character changed:
    # a bit flipped in the name itself.
    if SEAL not in record and not any(len(k) == len(SEAL) and sum(a != b for a, b in zip(k, SEAL, strict=True)) == 1
                                      for k in record):
        return
    if record.get(SEAL) != _json_sha256({k: v for k, v in record.items() if k != SEAL}):
        raise CheckpointError(f"{path}: its contents do not match the checksum hetero wrote with them (the file "
                              "changed after it was written: a failing disk, a bad copy, an edit); resume from "
                              "another checkpoint")


def state_settings(lora: dict[str, Any], architecture: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint's LoRA and AdamW state depends on beyond the tensors' shapes: the LoRA settings and the
    model's config (its hash). A plan of another lora.alpha or rope_theta takes the same shapes and would train
    on from state that means something else."""
    return {"lora": {k: lora[k] for k in ("r", "alpha", "dropout", "target_modules") if k in lora},
            "model_config_sha256": hashlib.sha256(json.dumps(architecture, sort_keys=True,
                                                             default=str).encode()).hexdigest()[:16]}




def save_stage_checkpoint(directory: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write one stage's payload as stage<k>.safetensors + stage<k>.json under ``directory`` (flushed to disk).

    Not atomic by itself: ``write_checkpoint`` calls it inside a staging directory.
    """
    from safetensors.torch import save

    directory.mkdir(parents=True, exist_ok=True)
    k = int(meta["stage"])
    # safetensors refuses non-contiguous or shared storage; received tensors view one buffer each.
    data = save({n: t.contiguous().clone() for n, t in tensors.items()},
                metadata={"format": str(CHECKPOINT_FORMAT), "plan_hash": str(meta.get("plan_hash", ""))})
    write_bytes(directory / f"stage{k}.safetensors", data)
    # The tensor file's checksum, checked before anything resumes from it: a flipped bit in a float is no less
    # a float, and would train on silently (JSON, header and NaN checks cannot see it).
    meta = seal({**meta, SHA256: hashlib.sha256(data).hexdigest()})
    del data
    write_bytes(directory / f"stage{k}.json", json.dumps(meta, indent=1).encode())
    return directory / f"stage{k}.json"


def write_checkpoint(run_dir: Path, step: int, payloads: Iterable[tuple[dict[str, torch.Tensor], dict[str, Any]]],
                     num_stages: int, train: dict[str, Any] | None = None, snapshot: bool = False,
                     depends_on: dict[str, Any] | None = None) -> Path:
    """Write ``RUN_DIR/checkpoints/step-N/`` whole or not at all; returns it.

    Every stage file, then COMPLETE, go into a hidden sibling that is flushed and renamed into place:
    a full or read-only disk leaves neither a partial step directory nor a changed older checkpoint,
    and raises RunDirError with the ``--resume`` command for the last complete checkpoint.
    """
    final = checkpoint_dir(run_dir, step)
    try:
        with staging_dir(final) as tmp:
            for tensors, meta in payloads:
                save_stage_checkpoint(tmp, tensors, meta)
            # COMPLETE also keeps the run's training settings (lr, scheduler, steps, ...): --resume uses them.
            # and what the state depends on (state_settings): a resume under other settings is refused.
            marker = seal({"stages": num_stages, "step": step, **({"train": train} if train is not None else {}),
                           **({"snapshot": True} if snapshot else {}),
                           **({"depends_on": depends_on} if depends_on is not None else {})})
            write_bytes(tmp / COMPLETE, json.dumps(marker).encode())
    except OSError as exc:
        raise write_failure(exc, f"checkpoint {final.name}", final.parent, Path(run_dir)) from None
    return final


def prune_snapshots(run_dir: Path, keep: int = SNAPSHOTS_KEPT) -> list[Path]:
    """Remove all but the newest ``keep`` snapshots (time-based checkpoints) of a run; checkpoints that
    train.checkpoint_every or the end of training wrote always stay. Returns what it removed."""
    snapshots = [d for d in complete_checkpoints(Path(run_dir) / CHECKPOINTS) if _marker(d).get("snapshot") is True]
    removed = snapshots[:-keep] if keep > 0 else snapshots
    for directory in removed:
        shutil.rmtree(directory, ignore_errors=True)
    return removed


def _marker(directory: Path) -> dict[str, Any]:
    """A checkpoint's COMPLETE marker ({} where it is unreadable)."""
    try:
        marker = json.loads((Path(directory) / COMPLETE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return marker if isinstance(marker, dict) else {}


def checked_marker(directory: Path) -> dict[str, Any]:
    """A complete checkpoint's COMPLETE marker, read and checked against its checksum (one line where it fails)."""
    path = Path(directory) / COMPLETE
    try:
        marker = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable ({_first_line(exc)}); resume from another checkpoint") from None
    if not isinstance(marker, dict):
        raise CheckpointError(f"{path}: not a checkpoint marker (a JSON object is expected); resume from another "
                              "checkpoint")
    check_seal(marker, path)
    return marker


def checkpoint_settings(directory: Path) -> dict[str, Any] | None:
    """The training settings a complete checkpoint was written with (None: an older checkpoint without them)."""
    train = checked_marker(directory).get("train")
    return dict(train) if isinstance(train, dict) else None


def check_state_settings(directory: Path, lora: dict[str, Any], architecture: dict[str, Any]) -> None:
    """The checkpoint's state was trained under this plan's LoRA settings and model config (older checkpoints
    without the record pass); a mismatch is one line naming the setting."""
    recorded = checked_marker(directory).get("depends_on")
    if not isinstance(recorded, dict):
        return
    wanted = state_settings(lora, architecture)
    for key, value in wanted["lora"].items():
        was = recorded.get("lora", {}).get(key) if isinstance(recorded.get("lora"), dict) else None
        if was is not None and was != value:
            raise CheckpointError(f"{directory} was trained with lora.{key}={was}, this plan has lora.{key}={value}: "
                                  "resume with the plan that wrote it, or start without --resume")
    if recorded.get("model_config_sha256") not in (None, wanted["model_config_sha256"]):
        raise CheckpointError(f"{directory} was trained on a model of another config (config hash "
                              f"{recorded.get('model_config_sha256')}, this plan's {wanted['model_config_sha256']}): "
                              "resume with the plan that wrote it, or start without --resume")


def resolve_resume(path: Path) -> Path:
    """The checkpoint ``--resume PATH`` means: a complete step-N directory, or the newest one of a run directory."""
    path = Path(path)
    if not path.is_dir():
        what = "not a directory" if path.exists() else "no such directory"
        raise CheckpointError(f"--resume {path}: {what}; pass a run directory or its checkpoints/step-N")
    if (path / COMPLETE).is_file():
        return path
    if checkpoint_step(path) is not None or any(path.glob("stage*.json")):
        done = complete_checkpoints(path.parent)
        hint = (f"resume from the newest complete one, {done[-1]}" if done
                else "that run has no complete checkpoint: start without --resume")
        raise CheckpointError(f"--resume {path}: not a complete checkpoint (no {COMPLETE} marker: the run stopped "
                              f"while writing it); {hint}")
    checkpoints = path if path.name == CHECKPOINTS else path / CHECKPOINTS
    if checkpoints.is_dir():
        done = complete_checkpoints(checkpoints)
        if done:
            return _newest_sound(done)
        raise CheckpointError(f"--resume {path}: no complete checkpoint in {checkpoints} (the run stopped before "
                              "its first; train.checkpoint_every sets how often): start without --resume")
    raise CheckpointError(f"--resume {path}: neither a run directory (with {CHECKPOINTS}/) nor a checkpoint "
                          f"(with {COMPLETE}); pass RUN_DIR or RUN_DIR/{CHECKPOINTS}/step-N")


def _newest_sound(done: list[Path]) -> Path:
    """The newest of a run's complete checkpoints whose every file reads back and checks (checksums included);
    each one passed over is a line that names its fault. None sound: the newest one's error."""
    first_error = None
    for directory in reversed(done):
        try:
            read_checkpoint(directory)
        except CheckpointError as exc:
            first_error = first_error or exc
            print(f"hetero: {exc}", flush=True)
            continue
        if first_error is not None:
            print(f"hetero: resuming from {directory}, the newest checkpoint that checks", flush=True)
        return directory
    assert first_error is not None
    raise first_error


def load_stage_checkpoint(directory: Path, k: int, plan_hash: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Read stage k's payload back; checks format, contents and (optionally) the plan hash. Errors are one line."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    meta_path, tensor_path = directory / f"stage{k}.json", directory / f"stage{k}.safetensors"
    if not meta_path.is_file() or not tensor_path.is_file():
        raise CheckpointError(f"{directory}: no checkpoint of stage {k} (stage{k}.json / .safetensors missing)")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{meta_path}: unreadable ({_first_line(exc)})") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{meta_path}: not valid JSON ({exc})") from None
    check_seal(meta, meta_path)
    _check_meta(meta, meta_path, k)
    if plan_hash is not None and meta.get("plan_hash") != plan_hash:
        raise CheckpointError(
            f"{meta_path}: written by plan {meta.get('plan_hash')}, this run's plan is {plan_hash}"
        )
    try:
        data = tensor_path.read_bytes()
        loaded = load(data)
        tensors = {name: loaded[name] for name in sorted(loaded)}  # an order of its own: errors name the same one
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{tensor_path}: unreadable safetensors file, truncated or corrupt "
                              f"({_first_line(exc)}); resume from another checkpoint") from None
    _check_tensors(tensors, meta, tensor_path)  # what a changed file is wrong in, where it says (a cast, NaN)
    check_sum(data, meta, tensor_path)  # and the change nothing else sees (a flipped bit)
    meta.pop(SHA256, None)  # this file's alone: merged with other stages' payloads it would name none of them
    meta.pop(SEAL, None)
    return tensors, meta


def check_sum(data: bytes, meta: dict[str, Any], path: Path) -> None:
    """``data`` (the bytes of ``path``) hash to the checksum its stage JSON recorded (checkpoints from before
    checksums have none: nothing to check)."""
    expected = meta.get(SHA256)
    if expected is None:
        return
    if not isinstance(expected, str) or hashlib.sha256(data).hexdigest() != expected:
        raise CheckpointError(f"{path}: its tensor data does not match the checksum in {path.stem}.json (the file "
                              "changed after hetero wrote it: a failing disk, a bad copy); resume from another "
                              "checkpoint")


def _dtype_name(t: torch.Tensor | torch.dtype) -> str:
    """``float16``, not ``torch.float16``: the name plan.json and the wire use."""
    return str(t.dtype if isinstance(t, torch.Tensor) else t).removeprefix("torch.")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


def _check_meta(meta: Any, path: Path, k: int) -> None:
    """The stage JSON has the fields ``restore_stage`` reads, with the right types."""
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: not a stage checkpoint (a JSON object is expected)")
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')}, this hetero reads {CHECKPOINT_FORMAT}")
    problems = []
    if meta.get("stage") != k:
        problems.append(f"'stage' is {meta.get('stage')!r}, the file name says {k}")
    step = meta.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        problems.append(f"'step' is {step!r}, not a step count")
    keys = meta.get("keys")
    if not isinstance(keys, list) or not all(isinstance(x, str) for x in keys):
        problems.append("'keys' is not a list of tensor names")
    steps = meta.get("adam_steps")
    if not isinstance(steps, dict) or not all(isinstance(v, (int, float)) for v in steps.values()):
        problems.append("'adam_steps' is not an object of numbers")
    if problems:
        raise CheckpointError(f"{path}: corrupt stage checkpoint ({problems[0]}); resume from another checkpoint")


def _check_tensors(tensors: dict[str, torch.Tensor], meta: dict[str, Any], path: Path) -> None:
    """Every LoRA tensor the JSON names is there; AdamW moments pair with it in shape; all are finite."""
    for name, t in tensors.items():
        if not name.startswith((LORA, EXP_AVG, EXP_AVG_SQ)):
            raise CheckpointError(f"{path}: unexpected tensor '{name}' (not lora/, exp_avg/ or exp_avg_sq/)")
        if t.dtype != CHECKPOINT_DTYPE:
            # A stage takes its state only in float32 (the wire's rules drop anything else), so another dtype
            # here would leave the stages waiting for a state that never comes.
            raise CheckpointError(f"{path}: tensor {name} is {_dtype_name(t)}, expected {_dtype_name(CHECKPOINT_DTYPE)} "
                                  "(LoRA weights and AdamW moments are float32 on every device): it was converted "
                                  "after hetero wrote it; resume from an unconverted checkpoint, or cast its tensors "
                                  "back to float32")
    for key in meta["keys"]:
        lora = tensors.get(LORA + key)
        if lora is None:
            raise CheckpointError(f"{path}: lacks LoRA tensor {key} that its JSON names; the checkpoint is corrupt")
        moments = {p + key: tensors.get(p + key) for p in (EXP_AVG, EXP_AVG_SQ)}
        if any(m is not None for m in moments.values()):
            shapes = {n: None if m is None else tuple(m.shape) for n, m in moments.items()}
            bad = next((n for n, shape in shapes.items() if shape != tuple(lora.shape)), None)
            if bad is not None or key not in meta["adam_steps"]:
                found = "missing" if bad is None or shapes[bad] is None else f"{shapes[bad]}"
                raise CheckpointError(f"{path}: AdamW state of {key} does not match its LoRA tensor "
                                      f"{tuple(lora.shape)} ({bad or 'its step count'}: {found}); the checkpoint "
                                      "is corrupt: resume from another one")
        for t in (lora, *(m for m in moments.values() if m is not None)):
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise CheckpointError(f"{path}: {key} holds NaN or inf (training had diverged); "
                                      "resume from an earlier checkpoint")


def lora_from_payload(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The LoRA weights (PEFT keys) inside a stage payload."""
    return {n[len(LORA):]: t for n, t in tensors.items() if n.startswith(LORA)}


def load_checkpoint_union(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every stage's payload in a checkpoint (or a run directory's newest one), merged.

    Keys are whole-model, so any split can resume from the union.
    """
    tensors, meta, _ = read_checkpoint(directory)
    return tensors, meta


def read_checkpoint(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Path]]:
    """``load_checkpoint_union``, and the stage file each tensor came from (for errors that name the file)."""
    directory = resolve_resume(Path(directory))
    checked_marker(directory)
    stages = sorted(int(m.group(1)) for p in directory.iterdir() if (m := _STAGE_JSON.fullmatch(p.name)))
    if not stages:
        raise CheckpointError(f"{directory}: has {COMPLETE} but no stage<k>.json; the checkpoint is corrupt")
    payloads = [load_stage_checkpoint(directory, k) for k in stages]
    files = {name: directory / f"stage{k}.safetensors" for k, (part, _) in zip(stages, payloads, strict=True)
             for name in part}
    tensors, meta = merge_payloads(payloads, f"{directory}: stage files disagree on the step")
    return tensors, meta, files


def merge_payloads(payloads: list[tuple[dict[str, torch.Tensor], dict[str, Any]]], disagree: str,
                   ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Stage payloads (tensors, meta) of one step as one: the union any split takes its stages' state from."""
    tensors: dict[str, torch.Tensor] = {}
    merged: dict[str, Any] = {"format": CHECKPOINT_FORMAT, "adam_steps": {}, "keys": []}
    steps = set()
    for part, meta in payloads:
        tensors.update(part)
        merged["adam_steps"].update(meta["adam_steps"])
        merged["keys"] += meta["keys"]
        steps.add(int(meta["step"]))
        merged["plan_hash"] = meta.get("plan_hash")
    if len(steps) != 1:
        raise CheckpointError(f"{disagree} ({sorted(steps)}); it is corrupt")
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
