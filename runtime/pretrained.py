"""Where a model's weights and tokenizer live on this host, and which safetensors file holds each tensor.

``resolve_dir(model)`` never touches the network:

- ``pretrained: "hetero:tiny"`` builds a random-init model from ``model.architecture`` (seed 0, fp32)
  plus a byte-level BPE tokenizer trained on the bundled demo data, into a cache directory keyed by
  a hash of everything that decides the files. Every host and process gets byte-identical files.
- a local directory is used as is (it must hold ``config.json``);
- a hub id is looked up in the local Hugging Face cache only.

``weight_index`` is how every part of the runtime finds the file of a tensor. torch, transformers and
tokenizers are imported inside the functions that use them: the coordinator resolves a model's
directory without loading them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

from hetero.errors import CheckpointError, ConfigError
from hetero.specs import ModelSpec

TINY = "hetero:tiny"
# Bump when the recipe below changes (tokenizer training, init, file layout): old caches are ignored.
TINY_RECIPE_VERSION = 1
SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Names for the special tokens of the tiny tokenizer (Llama convention).
_SPECIAL_NAMES = {"pad_token_id": "<pad>", "bos_token_id": "<s>", "eos_token_id": "</s>", "unk_token_id": "<unk>"}
# The tiny tokenizer's chat template (data.format=chat): a user turn and the assistant's reply render as the
# alpaca prompt and response (runtime/base/prompts.py), so the demo model reads both formats the same way; a system
# message is plain text before them. Each reply ends with EOS.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}### Instruction:\n{{ message['content'] }}\n\n"
    "{% else %}### Response:\n{{ message['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}### Response:\n{% endif %}"
)


def cache_root() -> Path:
    """The hetero cache: ``$XDG_CACHE_HOME/hetero`` or ``~/.cache/hetero``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hetero"


def demo_data_text() -> str:
    """The bundled demo instruction set (JSONL text), read as package data."""
    return resources.files("hetero").joinpath("data/demo_alpaca.jsonl").read_text(encoding="utf-8")


def resolve_dir(model: ModelSpec) -> Path:
    """The local directory holding ``model``'s config.json, weights and tokenizer."""
    source = model.pretrained
    if not source:
        raise ConfigError(f"model '{model.name}': model.pretrained is empty; set a hub id, a local dir or '{TINY}'")
    if source == TINY:
        return _tiny_dir(model.architecture)
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.pretrained '{source}': directory has no config.json; point it at a HF model dir")
        return path.resolve()
    # A hub id is "name" or "owner/name"; anything else that is not a directory is a bad path.
    if source.startswith(("/", ".", "~")) or source.count("/") > 1:
        raise ConfigError(f"model.pretrained '{source}': no such directory")
    return _hub_cache_dir(source)


def adapter_base(model: ModelSpec) -> str:
    """An adapter's ``base_model_name_or_path``: a hub id as given, else the real local directory (the
    bundled tiny model's cache directory included), so that ``AutoPeftModelForCausalLM.from_pretrained``
    on the adapter finds its base model."""
    source = model.pretrained or model.name
    if source != TINY and not Path(source).expanduser().is_dir():
        return source  # a hub id: every Hugging Face tool resolves it
    return str(resolve_dir(model))


def _hub_cache_dir(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        snapshot = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as exc:  # LocalEntryNotFoundError, bad repo id, offline-mode errors: all mean "not here"
        raise ConfigError(
            f"model.pretrained '{repo_id}' is not in the local Hugging Face cache: download it first "
            f"(`hf download {repo_id}`) or pass a local directory ({type(exc).__name__})"
        ) from None
    if not (snapshot / "config.json").is_file():
        raise ConfigError(f"model.pretrained '{repo_id}': cached snapshot {snapshot} has no config.json")
    return snapshot


def tiny_key(architecture: dict[str, Any]) -> str:
    """Cache key of a tiny model: hash of the architecture, recipe version, demo data and prompt templates."""
    from hetero.runtime.base.prompts import PROMPT_NO_INPUT, PROMPT_WITH_INPUT

    # The tokenizer is trained on rendered prompts: the template is part of the recipe.
    recipe = {
        "architecture": architecture,
        "recipe": TINY_RECIPE_VERSION,
        "data": hashlib.sha256(demo_data_text().encode()).hexdigest(),
        "template": [PROMPT_WITH_INPUT, PROMPT_NO_INPUT],
        "chat_template": TINY_CHAT_TEMPLATE,
    }
    blob = json.dumps(recipe, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _tiny_dir(architecture: dict[str, Any]) -> Path:
    root = cache_root()
    final = root / f"tiny-{tiny_key(architecture)}"
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    # Build in a private temp dir on the same filesystem, then rename: several stage processes may
    # race here, and a reader must never see a half-written directory.
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        build_tiny(architecture, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _special_tokens(architecture: dict[str, Any]) -> list[str]:
    """Special tokens in id order; their ids must be 0..k-1 so the BPE trainer places them there."""
    by_id: dict[int, str] = {}
    for key, name in _SPECIAL_NAMES.items():
        token_id = architecture.get(key)
        if token_id is None:
            continue
        if not isinstance(token_id, int) or token_id < 0:
            raise ConfigError(f"model.architecture.{key}: expected a non-negative integer, got {token_id!r}")
        by_id.setdefault(token_id, name)
    if "eos_token_id" not in architecture or architecture["eos_token_id"] is None:
        raise ConfigError("model.architecture.eos_token_id is required to build the tiny tokenizer")
    if sorted(by_id) != list(range(len(by_id))):
        raise ConfigError(
            f"model.architecture: special token ids {sorted(by_id)} must be 0..{len(by_id) - 1} for the tiny tokenizer"
        )
    return [by_id[i] for i in range(len(by_id))]


def build_tokenizer(architecture: dict[str, Any], out_dir: Path) -> None:
    """Train a byte-level BPE on the demo data with the architecture's vocab size and special ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    vocab_size = int(architecture.get("vocab_size", 0))
    specials = _special_tokens(architecture)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(specials) + len(alphabet):
        raise ConfigError(
            f"model.architecture.vocab_size {vocab_size} is too small for a byte-level tokenizer "
            f"(needs >= {len(specials) + len(alphabet)})"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet, min_frequency=1, show_progress=False
    )
    tokenizer.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        # A tiny corpus can run out of merges; the embedding has vocab_size rows either way, but
        # the contract is an exact match, so say so rather than ship a mismatched pair.
        raise ConfigError(
            f"model.architecture.vocab_size {vocab_size}: the demo data only supports "
            f"{tokenizer.get_vocab_size()} tokens; lower vocab_size"
        )
    bos = _SPECIAL_NAMES["bos_token_id"] if architecture.get("bos_token_id") is not None else None
    if bos is not None:
        # Llama convention: encode(text) starts with BOS. hetero's data pipeline adds its own.
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, architecture["bos_token_id"])]
        )
    names = {k: _SPECIAL_NAMES[k] for k in _SPECIAL_NAMES if architecture.get(k) is not None}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=names.get("bos_token_id"),
        eos_token=names["eos_token_id"],
        pad_token=names.get("pad_token_id", names["eos_token_id"]),
        unk_token=names.get("unk_token_id"),
        model_max_length=int(architecture.get("max_position_embeddings", 2048)),
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def _tokenizer_corpus() -> list[str]:
    """Demo records as the data pipeline renders them, so template words become single tokens."""
    from hetero.runtime.base.prompts import render_alpaca

    lines = []
    for raw in demo_data_text().splitlines():
        if raw.strip():
            record = json.loads(raw)
            prompt = render_alpaca(record)
            lines.append(prompt + record["output"])
    return lines


def build_tiny(architecture: dict[str, Any], out_dir: Path) -> None:
    """Write a random-init (seed 0, fp32) model and its tokenizer into ``out_dir``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = dict(architecture)
    model_type = arch.pop("model_type", None)
    if not model_type:
        raise ConfigError("model.architecture.model_type is required to build the tiny model")
    try:
        config = AutoConfig.for_model(model_type, **arch)
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"model.architecture: transformers cannot build model_type '{model_type}': {exc}") from None
    # Isolate the init from the caller's RNG so every process produces the same weights.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    build_tokenizer(architecture, out_dir)


def weight_index(model_dir: Path) -> dict[str, str]:
    """Map each tensor name to the absolute path of the safetensors file holding it."""
    model_dir = Path(model_dir)
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index}: not a safetensors index (needs a 'weight_map' object)") from None
        return {name: str(model_dir / file) for name, file in weight_map.items()}
    single = model_dir / SAFETENSORS_SINGLE
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {name: str(single) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    raise CheckpointError(
        f"{model_dir}: no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}; hetero reads safetensors weights only"
    )
