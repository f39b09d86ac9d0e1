"""Nothing lost on disk: checkpoints and the adapter are written whole or not at all (a real full disk on a
small tmpfs, and injected write errors), corrupt checkpoints are one-line errors, and everything `hetero
run` can check before a stage starts fails in seconds, as one line, before any stage process exists."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from metrics_rows import read_metrics, step_lines
from plans import free_ports, make_plan
from procs import run_hetero, start
from safetensors.torch import save_file

from hetero.errors import CheckpointError
from hetero.plan import Plan, compute_input_hash
from hetero.runtime.base.rundir import RunDirError, append_run_line, checkpoint_dir
from hetero.runtime.run.checkpoint import (
    CHECKPOINT_FORMAT,
    EXP_AVG,
    EXP_AVG_SQ,
    LORA,
    SEAL,
    SHA256,
    load_checkpoint_union,
    resolve_resume,
    seal,
    state_settings,
    write_checkpoint,
)
from hetero.runtime.run.preflight import check_init_from, check_resume, lora_shapes
from hetero.serde import to_dict
from hetero.specs import DataSpec, LoraSpec, ModelSpec, TrainSpec

HETERO = [sys.executable, "-m", "hetero.cli"]
MODULE = "base_model.model.model.layers.{i}.self_attn.q_proj"


# -- helpers ----------------------------------------------------------------------------------------

@pytest.fixture
def tmpfs(tmp_path: Path):
    """mount(size, *options) -> a fresh tmpfs directory under tmp_path (root only; unmounted afterwards)."""
    mounted: list[Path] = []

    def mount(size: str, *options: str) -> Path:
        target = tmp_path / f"tmpfs{len(mounted)}"
        target.mkdir()
        opts = ",".join([f"size={size}", *options])
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(target)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
        mounted.append(target)
        return target

    yield mount
    for target in reversed(mounted):
        subprocess.run(["umount", "-l", str(target)], check=False)


def _fill(directory: Path, leave_bytes: int) -> Path:
    """Grow ``directory/filler`` until its file system has only ``leave_bytes`` (rounded to pages) free."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    os.truncate(filler, max(0, filler.stat().st_size - leave_bytes))
    return filler


def _payload(stage: int, step: int, modules: list[int], r: int = 8, dim: int = 512) -> tuple[dict, dict]:
    """A stage's checkpoint message: LoRA A/B of q_proj in ``modules`` layers, with AdamW moments."""
    gen = torch.Generator().manual_seed(stage * 100 + step)
    tensors, keys, adam = {}, [], {}
    for i in modules:
        for part, shape in (("lora_A", (r, dim)), ("lora_B", (dim, r))):
            key = f"{MODULE.format(i=i)}.{part}.weight"
            keys.append(key)
            adam[key] = float(step)
            for prefix in (LORA, EXP_AVG, EXP_AVG_SQ):
                tensors[prefix + key] = torch.randn(shape, generator=gen).abs()
    meta = {"format": CHECKPOINT_FORMAT, "plan_hash": "p" * 16, "stage": stage, "step": step, "keys": keys,
            "adam_steps": adam, "scheduler": None}
    return tensors, meta


def _write(run_dir: Path, step: int) -> Path:
    return write_checkpoint(run_dir, step, [_payload(0, step, [0, 1]), _payload(1, step, [2, 3])], 2,
                            train={"lr": 1e-3, "steps": 10}, depends_on=state_settings({"r": 8, "alpha": 16.0},
                                                                                      {"model_type": "llama"}))


def _digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _one_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith("hetero: error:")]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


# -- 1. writes are whole or absent ------------------------------------------------------------------

def test_a_full_disk_loses_no_checkpoint(tmpfs, tmp_path: Path) -> None:
    """A real ENOSPC mid-checkpoint: one line with the resume command, no partial step, step 2 intact."""
    run = tmpfs("4m") / "run"
    first = _write(run, 2)
    before = _digest(first)
    _fill(run, 64 * 1024)  # a checkpoint is ~200 KB: it cannot fit, a metrics line can

    with pytest.raises(RunDirError) as info:
        _write(run, 4)
    assert str(info.value) == (
        f"cannot write checkpoint step-000004 to {run / 'checkpoints'} (No space left on device): free space and "
        f"resume with `hetero run {run / 'plan.json'} --resume {first}`")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]  # no partial left
    assert _digest(first) == before
    assert resolve_resume(run) == first and load_checkpoint_union(run)[1]["step"] == 2

    append_run_line(run, "metrics.jsonl", json.dumps({"step": 0}))
    _fill(run, 0)
    with pytest.raises(RunDirError, match="cannot write metrics.jsonl .*No space left on device.*--resume"):
        append_run_line(run, "metrics.jsonl", json.dumps({"step": 1, "pad": "x" * 8192}))
    assert [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] == [{"step": 0}]

    _fill(run, 64 * 1024)  # room for the adapter's config, not its weights
    from hetero.runtime.stage.adapter import save_adapter

    state = {k[len(LORA):]: v for k, v in _payload(0, 4, list(range(8)))[0].items() if k.startswith(LORA)}
    with pytest.raises(RunDirError, match=f"cannot write the adapter to {run / 'adapter'} \\(No space left on device\\)"
                                          f": free space; the same LoRA weights are in the final checkpoint {first}"):
        save_adapter(state, LoraSpec(r=8, target_modules=["q_proj"]), "tiny", run / "adapter")
    assert not [p for p in run.iterdir() if "adapter" in p.name]


@pytest.mark.parametrize("fail_on", ["stage1.safetensors", "COMPLETE", "rename"])
def test_a_failed_write_at_any_point_leaves_the_old_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                          fail_on: str) -> None:
    """Injected ENOSPC / EROFS at each file (COMPLETE is last) and at the final rename: nothing changes,
    not even a step directory being written a second time by a resumed run."""
    import hetero.runtime.base.rundir as rundir
    import hetero.runtime.run.checkpoint as checkpoint

    run = tmp_path / "run"
    first, again = _write(run, 2), _write(run, 4)
    before = {d.name: _digest(d) for d in (first, again)}
    real_write, real_rename = rundir.write_bytes, os.rename

    def write_bytes(path: Path, data: bytes) -> None:
        if path.name == fail_on:
            real_write(path, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(path, data)

    def rename(src, dst) -> None:
        if fail_on == "rename" and Path(src).name == ".step-000004.partial":  # after the old step 4 moved aside
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        real_rename(src, dst)

    monkeypatch.setattr(checkpoint, "write_bytes", write_bytes)
    monkeypatch.setattr(rundir.os, "rename", rename)
    with pytest.raises(RunDirError) as info:
        _write(run, 4)  # a resumed run writing step 4 again
    monkeypatch.undo()
    fix = "make " + str(run / "checkpoints") + " writable" if fail_on == "rename" else "free space"
    assert f"cannot write checkpoint step-000004 to {run / 'checkpoints'}" in str(info.value)
    assert f"{fix} and resume with `hetero run {run / 'plan.json'} --resume {again}`" in str(info.value)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    assert {d.name: _digest(d) for d in (first, again)} == before


# -- 3. corrupt checkpoints are one line ------------------------------------------------------------

def _resaved(d: Path, k: int, tensors: dict) -> None:
    """Save stage k's tensors over its file, and its checksum in its JSON: a checkpoint consistent with itself whose
    contents are wrong (what the checks after the checksum are for)."""
    path = d / f"stage{k}.safetensors"
    save_file(tensors, str(path))
    meta = json.loads((d / f"stage{k}.json").read_text())
    meta[SHA256] = hashlib.sha256(path.read_bytes()).hexdigest()
    (d / f"stage{k}.json").write_text(json.dumps(seal(meta)))


def _corrupt_bits(d: Path) -> None:
    """64 bit flips in the tensor data (after the header): every value still a finite float, every shape right."""
    path = d / "stage1.safetensors"
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    gen = torch.Generator().manual_seed(0)
    for at in torch.randint(start, len(data), (64,), generator=gen).tolist():
        data[at] ^= 1 << int(torch.randint(0, 5, (1,), generator=gen))  # low mantissa bits: no NaN, no inf
    path.write_bytes(bytes(data))


def _corrupt_truncated(d: Path) -> None:
    path = d / "stage1.safetensors"
    path.write_bytes(path.read_bytes()[:5000])


def _corrupt_json(d: Path) -> None:
    (d / "stage0.json").write_text('{"format": 1, "stage": 0, "step": ')


def _corrupt_shape(d: Path) -> None:
    tensors, meta = _payload(0, 2, [0, 1])
    tensors[EXP_AVG + meta["keys"][0]] = torch.zeros(3, 3)
    _resaved(d, 0, tensors)


def _corrupt_step(d: Path) -> None:
    meta = json.loads((d / "stage0.json").read_text())
    (d / "stage0.json").write_text(json.dumps(seal({**meta, "step": "two"})))  # sealed: the check after the seal


def _corrupt_nan(d: Path) -> None:
    tensors, meta = _payload(1, 2, [2, 3])
    tensors[LORA + meta["keys"][1]][0, 0] = float("nan")
    _resaved(d, 1, tensors)


def _corrupt_missing_tensor(d: Path) -> None:
    tensors, meta = _payload(1, 2, [2, 3])
    del tensors[LORA + meta["keys"][0]]
    _resaved(d, 1, tensors)


def _corrupt_garbage(d: Path) -> None:
    (d / "stage0.safetensors").write_bytes(os.urandom(64))


def _corrupt_garbage_unsummed(d: Path) -> None:
    """Garbage in a checkpoint from before checksums (no checksum in the JSON): the reader says so as before."""
    _corrupt_garbage(d)
    meta = json.loads((d / "stage0.json").read_text())
    del meta[SHA256], meta[SEAL]
    (d / "stage0.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(("corrupt", "match"), [
    (_corrupt_bits, "stage1.safetensors: its tensor data does not match the checksum in stage1.json"),
    (_corrupt_truncated, "stage1.safetensors: unreadable safetensors file, truncated or corrupt"),
    (_corrupt_garbage, "stage0.safetensors: unreadable safetensors file"),
    (_corrupt_garbage_unsummed, "stage0.safetensors: unreadable safetensors file"),
    (_corrupt_json, "stage0.json: not valid JSON"),
    (_corrupt_shape, "AdamW state of .* does not match its LoRA tensor"),
    (_corrupt_step, "corrupt stage checkpoint \\('step' is 'two'"),
    (_corrupt_nan, "holds NaN or inf"),
    (_corrupt_missing_tensor, "lacks LoRA tensor .* that its JSON names"),
])
def test_a_corrupt_checkpoint_is_one_line(tmp_path: Path, corrupt, match: str) -> None:
    ckpt = _write(tmp_path / "run", 2)
    assert load_checkpoint_union(ckpt)[1]["step"] == 2  # whole, it loads
    corrupt(ckpt)
    with pytest.raises(CheckpointError, match=match) as info:
        load_checkpoint_union(ckpt)
    assert "\n" not in str(info.value)


def test_resume_passes_over_a_checkpoint_that_fails_its_checksum(tmp_path: Path, capsys) -> None:
    """Given a run directory, --resume takes the newest checkpoint that checks and says which it passed over and
    why; named outright, a bad checkpoint is refused in one line; none sound, the newest one's fault."""
    run = tmp_path / "run"
    two, four = _write(run, 2), _write(run, 4)
    _corrupt_bits(four)
    assert resolve_resume(run) == two
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "step-000004/stage1.safetensors: its tensor data does not match the checksum" in lines[0]
    assert lines[1] == f"hetero: resuming from {two}, the newest checkpoint that checks"
    with pytest.raises(CheckpointError, match="step-000004/stage1.safetensors: its tensor data does not match"):
        load_checkpoint_union(four)
    _corrupt_bits(two)
    with pytest.raises(CheckpointError, match="step-000004/stage1.safetensors: its tensor data does not match"):
        resolve_resume(run)


def test_a_flipped_bit_in_any_checkpoint_file_is_refused_or_passed_over(tmp_path: Path, capsys) -> None:
    """Every file of a checkpoint is covered by a checksum (issue 53): a bit flipped anywhere in COMPLETE (the
    recorded lr, the stage count) or a stage JSON (AdamW step counts, the step) is refused in one line when the
    checkpoint is named, and passed over for the previous good one when the run directory is."""
    run = tmp_path / "run"
    two, four = _write(run, 2), _write(run, 4)
    gen = torch.Generator().manual_seed(53)
    for name in ("COMPLETE", "stage0.json", "stage1.json", "stage1.safetensors"):
        path = four / name
        clean = path.read_bytes()
        for at in torch.randint(0, len(clean), (60,), generator=gen).tolist():
            flipped = bytearray(clean)
            flipped[at] ^= 1 << int(torch.randint(0, 8, (1,), generator=gen))
            path.write_bytes(bytes(flipped))
            with pytest.raises(CheckpointError) as info:
                load_checkpoint_union(four)
            assert "\n" not in str(info.value) and str(four) in str(info.value), (name, at, info.value)
            assert resolve_resume(run) == two, (name, at)
        path.write_bytes(clean)
        assert load_checkpoint_union(four)[1]["step"] == 4
    # The recorded lr read back 0.009 for 0.001, the JSON still valid: the seal sees it.
    marker = json.loads((four / "COMPLETE").read_text())
    (four / "COMPLETE").write_text(json.dumps({**marker, "train": {**marker["train"], "lr": 0.009}}))
    with pytest.raises(CheckpointError, match="COMPLETE: its contents do not match the checksum"):
        load_checkpoint_union(four)
    capsys.readouterr()


def test_resume_accepts_a_run_dir_and_names_what_to_pass(tmp_path: Path) -> None:
    run = tmp_path / "run"
    two, four = _write(run, 2), _write(run, 4)
    partial = checkpoint_dir(run, 6)
    partial.mkdir()  # a run killed mid-write (before staging existed) left a step dir without COMPLETE
    (run / "checkpoints" / ".step-000008.partial").mkdir()
    assert resolve_resume(run) == four == resolve_resume(run / "checkpoints") == resolve_resume(four)
    assert resolve_resume(two) == two
    with pytest.raises(CheckpointError, match=f"not a complete checkpoint .*resume from the newest complete one, {four}"):
        resolve_resume(partial)
    with pytest.raises(CheckpointError, match="no such directory; pass a run directory or its checkpoints/step-N"):
        resolve_resume(tmp_path / "nope")
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="no complete checkpoint in .*start without --resume"):
        resolve_resume(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="neither a run directory"):
        resolve_resume(tmp_path)


# -- 2. everything checkable is checked before a stage starts ---------------------------------------

def _model_checkpoint(plan: Plan, model_dir: Path, run: Path, step: int, r: int | None = None,
                      recorded: bool = True) -> Path:
    """A one-stage checkpoint with a LoRA tensor for every module of ``plan`` (rank ``r``, default the plan's);
    ``recorded``: with the settings its state depends on (checkpoints from before them have none)."""
    tensors, keys = {}, []
    for key, shape in lora_shapes(plan, model_dir).items():
        assert shape is not None
        if r is not None:
            shape = (r, shape[1]) if ".lora_A." in key else (shape[0], r)
        tensors[LORA + key] = torch.zeros(shape)
        keys.append(key)
    meta = {"format": CHECKPOINT_FORMAT, "plan_hash": plan.input_hash, "stage": 0, "step": step, "keys": keys,
            "adam_steps": {}, "scheduler": None}
    depends_on = state_settings(to_dict(plan.model.lora), plan.model.architecture) if recorded else None
    return write_checkpoint(run, step, [(tensors, meta)], 1, depends_on=depends_on)


def _adapter(plan: Plan, model_dir: Path, out: Path, r: int, hidden: int | None = None) -> Path:
    """A PEFT adapter directory for ``plan``'s modules, written by hand (rank r; other in-dims with ``hidden``)."""
    tensors = {}
    for key, shape in lora_shapes(plan, model_dir).items():
        assert shape is not None
        a = ".lora_A." in key
        tensors[key] = torch.zeros((r, hidden or shape[1]) if a else (shape[0], r))
    out.mkdir(parents=True)
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": plan.model.lora.alpha,
        "target_modules": list(plan.model.lora.target_modules)}))
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def test_the_lora_tensors_expected_are_what_peft_builds(tiny_model_dir: Path, tiny_spec: ModelSpec) -> None:
    """The pre-start key/shape check reads only the plan and weight headers; it must agree with peft."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3])
    lora = plan.model.lora
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)),
                           LoraConfig(r=lora.r, target_modules=list(lora.target_modules)))
    want = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model).items()}
    assert len(want) == 6 * 7 * 2 and lora_shapes(plan, tiny_model_dir) == want


def test_checkpoints_and_adapters_must_fit_the_model(tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path) -> None:
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3], train=TrainSpec(steps=6))
    good = _model_checkpoint(plan, tiny_model_dir, tmp_path / "run", 2)
    assert check_resume(tmp_path / "run", plan, tiny_model_dir) == (good, 2)
    other = _model_checkpoint(plan, tiny_model_dir, tmp_path / "r4", 2, r=4)
    with pytest.raises(CheckpointError, match="down_proj.lora_A.weight has shape \\(4, 172\\), this model's is \\(8, 172\\)"):
        check_resume(other, plan, tiny_model_dir)
    with pytest.raises(CheckpointError, match="after step 2, train.steps is 2: raise it"):
        check_resume(good, replace(plan, train=TrainSpec(steps=2)), tiny_model_dir)
    shallow = replace(plan, model=replace(plan.model, lora=replace(plan.model.lora, target_modules=["q_proj"])))
    deeper = _model_checkpoint(plan, tiny_model_dir, tmp_path / "deep", 2)
    with pytest.raises(CheckpointError, match="trained with lora.target_modules="):
        check_resume(deeper, shallow, tiny_model_dir)  # LoRA on modules the plan does not train
    older = _model_checkpoint(plan, tiny_model_dir, tmp_path / "old", 2, recorded=False)
    with pytest.raises(CheckpointError, match="a LoRA module this plan does not train"):
        check_resume(older, shallow, tiny_model_dir)  # a checkpoint without the record: the tensors tell
    # Same shapes, other meaning: a checkpoint of another lora.alpha or model config is refused in one line.
    louder = replace(plan, model=replace(plan.model, lora=replace(plan.model.lora, alpha=64.0)))
    with pytest.raises(CheckpointError, match=r"trained with lora.alpha=16.0, this plan has lora.alpha=64.0: resume "
                                              "with the plan that wrote it, or start without --resume$"):
        check_resume(good, louder, tiny_model_dir)
    rope = replace(plan, model=replace(plan.model, architecture={**plan.model.architecture, "rope_theta": 1e6}))
    with pytest.raises(CheckpointError, match="was trained on a model of another config"):
        check_resume(good, rope, tiny_model_dir)

    def with_init(adapter: Path) -> Plan:
        return replace(plan, model=replace(plan.model, lora=replace(plan.model.lora, init_from=str(adapter))))

    check_init_from(with_init(_adapter(plan, tiny_model_dir, tmp_path / "a8", 8)), tiny_model_dir)
    with pytest.raises(CheckpointError, match="has shape \\(8, 96\\), this model's is \\(8, 172\\)"):
        check_init_from(with_init(_adapter(plan, tiny_model_dir, tmp_path / "wide", 8, hidden=96)), tiny_model_dir)


def _saved(plan: Plan, path: Path) -> Path:
    replace(plan, input_hash=compute_input_hash(plan)).save(path)
    return path


@pytest.fixture
def refused(tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """run(args) -> the one error line of an in-process `hetero run` that must fail before any stage starts."""
    from hetero.cli import main

    monkeypatch.chdir(tmp_path)

    def run(args: list[str], run_dir: Path | None = None) -> str:
        run_dir = run_dir or tmp_path / "run"
        t0 = time.monotonic()
        code = main(["run", *args, "--run-dir", str(run_dir), "--handshake-timeout", "5", "--no-progress"])
        elapsed = time.monotonic() - t0
        err = capsys.readouterr().err
        assert code == 2, err
        assert elapsed < 10, f"took {elapsed:.1f} s"
        assert not (run_dir / "logs" / "stage0.log").exists(), "a stage was started"
        return _one_line(err)

    return run


def test_bad_inputs_are_refused_before_any_stage_starts(tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path,
                                                        refused) -> None:
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3], train=TrainSpec(steps=6, micro_batch_size=2,
                                                                                   num_micro_batches=2))
    _saved(plan, tmp_path / "plan.json")
    line = refused(["plan.json", "--resume", str(tmp_path / "nope")])
    assert "--resume " + str(tmp_path / "nope") + ": no such directory" in line
    (tmp_path / "old" / "checkpoints").mkdir(parents=True)
    assert "no complete checkpoint in" in refused(["plan.json", "--resume", str(tmp_path / "old")])
    _model_checkpoint(plan, tiny_model_dir, tmp_path / "r4", 2, r=4)
    assert "has shape (4, 172), this model's is (8, 172)" in refused(["plan.json", "--resume", str(tmp_path / "r4")])

    def variant(name: str, **changes) -> str:
        return str(_saved(replace(plan, **changes), tmp_path / name).name)

    adapter = _adapter(plan, tiny_model_dir, tmp_path / "adapter-r4", 4)
    lora = replace(plan.model.lora, init_from=str(adapter))
    line = refused([variant("init.json", model=replace(plan.model, lora=lora))])
    assert "adapter has r=4 but the plan has lora.r=8" in line

    for name, content, fmt, expected in [
        ("missing.jsonl", None, "alpaca", "missing.jsonl': no such file"),
        ("fields.jsonl", '{"instruction": "a", "output": "b"}\n{"instruction": "c"}\n', "alpaca",
         "line 2: alpaca format needs string fields 'instruction' and 'output' (missing 'output')"),
        ("vocab.jsonl", '{"input_ids": [1, 2, 3, 900]}\n', "tokens", "line 1: token id 900 is outside the model's "
         "vocabulary (vocab_size 512)"),
        ("short.jsonl", '{"instruction": "' + "word " * 60 + '", "output": "b"}\n', "alpaca",
         "step 1 has no label tokens after truncation to seq_len=32"),
    ]:
        if content is not None:
            (tmp_path / name).write_text(content)
        data = DataSpec(path=str(tmp_path / name), format=fmt)  # type: ignore[arg-type]
        assert expected in refused([variant(f"plan-{name}.json", data=data)])

    # A step deep into the run whose records all lose their labels to truncation (demo data, seq_len 32, padded rows:
    # packed rows fill a step from many records, so one that truncates away every label is rarer than this).
    padded = variant("padded.json", data=replace(plan.data, packing=False))
    assert "step 7 has no label tokens after truncation to seq_len=32" in refused([padded, "steps=8"])

    port = free_ports(1)[0]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        line = refused(["plan.json", "--port", str(port)])
    assert f"the coordinator cannot listen on tcp://127.0.0.1:{port} (Address already in use)" in line
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", int(plan.stages[1].endpoint.rsplit(":", 1)[1])))
        holder.listen()
        assert f"stage 1 cannot listen on {plan.stages[1].endpoint}" in refused(["plan.json"])

    (tmp_path / "a-file").write_text("")
    line = refused(["plan.json"], run_dir=tmp_path / "a-file" / "run")
    assert "cannot create run directory" in line and "is a file" in line
    assert not (tmp_path / "run").exists()  # every refusal came before the run directory was made


def test_a_refusal_takes_seconds_including_imports(tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path) -> None:
    """The whole `hetero run` process, imports included, against the 15-45 s a stage takes to fail."""
    make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3]).save(tmp_path / "plan.json")
    t0 = time.monotonic()
    done = subprocess.run([*HETERO, "run", "plan.json", "--resume", "runs/typo"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert done.returncode == 2 and "--resume runs/typo: no such directory" in _one_line(done.stderr)
    assert elapsed < 15, f"took {elapsed:.1f} s"  # ~2 s on an idle machine; generous for a loaded one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no run directory, no logs


def test_read_only_and_small_run_dirs_are_refused(tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path,
                                                  tmpfs, refused) -> None:
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3])
    _saved(plan, tmp_path / "plan.json")
    read_only = tmpfs("1m", "ro")
    line = refused(["plan.json"], run_dir=read_only / "run")
    assert line == (f"hetero: error: cannot create {read_only / 'run'} in {read_only} (read-only file system): "
                    "pass --run-dir on a writable disk")
    # A compiled plan knows its LoRA size: 2 MiB cannot hold a checkpoint of 10M LoRA parameters.
    nodes = plan.graph.nodes
    plan = replace(plan, graph=replace(plan.graph, nodes=[nodes[0], replace(nodes[1], lora_params=10_000_000),
                                                          *nodes[2:]]))
    _saved(plan, tmp_path / "big.json")
    small = tmpfs("2m")
    line = refused(["big.json"], run_dir=small / "run")
    assert f"run directory {small / 'run'} has 2.0 MiB free, one checkpoint and the adapter needs 153.6 MiB" in line


# -- 1, end to end: the disk fills up during a real run ---------------------------------------------

@pytest.mark.slow
def test_a_run_whose_disk_fills_up_stops_cleanly_and_resumes(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                             tmp_path: Path, tmpfs) -> None:
    train = TrainSpec(micro_batch_size=2, num_micro_batches=2, steps=8, checkpoint_every=4, lr=1e-3)
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3], train=train, seq_len=64)
    plan.save(tmp_path / "plan.json")
    disk = tmpfs("64m")
    run_dir = disk / "run"
    port = str(free_ports(1)[0])
    proc = start(["run", "plan.json", "--run-dir", str(run_dir), "--port", port, "--no-progress"], tmp_path)
    try:
        first = checkpoint_dir(run_dir, 4)
        deadline = time.monotonic() + 240
        while not (first / "COMPLETE").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGSTOP)  # the disk fills up (another program) before step 8's checkpoint
        try:
            before = _digest(first)
            filler = _fill(disk, 128 * 1024)  # room for log and metrics lines, not a ~650 KB checkpoint
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 2, err
    assert _one_line(err) == (
        f"hetero: error: cannot write checkpoint step-000008 to {run_dir / 'checkpoints'} (No space left on device): "
        f"free space and resume with `hetero run {run_dir / 'plan.json'} --port {port} --resume {first}`")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000004"]
    assert _digest(first) == before and not (run_dir / "adapter").exists()
    steps = [x["step"] for x in step_lines(read_metrics(run_dir / "metrics.jsonl"))]
    assert steps == list(range(1, 9))

    filler.unlink()  # space freed: the command from the message, run as printed, continues the run
    printed = shlex.split(_one_line(err).rsplit("`", 2)[1])
    assert printed[:2] == ["hetero", "run"]
    done = run_hetero([*printed[1:], "--no-progress"], tmp_path, 240)
    assert done.returncode == 0, done.stderr[-3000:]
    # --resume CHECKPOINT starts a new run directory (--resume RUN_DIR would go on in RUN_DIR).
    adapter = Path(done.stdout.split("adapter: ", 1)[1].split()[0])
    if not adapter.is_absolute():
        adapter = tmp_path / adapter
    assert (adapter / "adapter_model.safetensors").is_file()
    assert [x["step"] for x in step_lines(read_metrics(adapter.parent / "metrics.jsonl"))] == [5, 6, 7, 8]
