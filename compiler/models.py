"""Resolve a model's architecture (HF config.json as a dict) from a local dir or the local HF cache.

Never touches the network: ``model=hf model.pretrained=ID_OR_DIR`` works only for a directory or for
a hub id whose config.json is already in the local Hugging Face cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hetero.errors import ConfigError

# Keys where a declared architecture and the checkpoint's config.json must agree: a mismatch means the
# plan would be sized for one model and the runtime would load another.
KEYS_THAT_MATTER: tuple[str, ...] = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)
GENERATED_PREFIX = "hetero:"  # e.g. "hetero:tiny": built locally from the declared architecture


def resolve_architecture(
    architecture: dict[str, Any] | None, pretrained: str | None, *, required: bool = True
) -> dict[str, Any]:
    """The architecture dict to trace: from ``pretrained``'s config.json, checked against ``architecture``.

    ``required=False``: a declared architecture is taken as is when the model is not on this machine
    (compiling never needs the weights), but checked whenever its config.json is at hand.
    """
    if architecture is not None and not isinstance(architecture, dict):
        raise ConfigError("model.architecture must be a mapping (an HF config.json as a dict) or null")
    if not pretrained or str(pretrained).startswith(GENERATED_PREFIX):
        if architecture is None:
            raise ConfigError(
                "model.architecture is null and model.pretrained is not set: pass model.pretrained=<hub id or dir>"
            )
        return dict(architecture)
    if not required and architecture is not None and not available_locally(str(pretrained)):
        return dict(architecture)
    found = read_config_json(str(pretrained))
    if architecture is not None:
        check_agrees(architecture, found, str(pretrained))
        # The declared dict may fill gaps (e.g. a seq-len override) but never contradicts what matters.
        return {**found, **architecture}
    return found


def read_config_json(pretrained: str) -> dict[str, Any]:
    """config.json of a local model directory or of a hub id in the local HF cache (no download)."""
    path = Path(pretrained).expanduser()
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ConfigError(
                f"model.pretrained '{pretrained}': directory has no config.json; point it at a HF model dir"
            )
        return _load(config_path)
    if pretrained.startswith(("/", ".", "~")) or pretrained.count("/") > 1:
        raise ConfigError(f"model.pretrained '{pretrained}': no such directory")
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(repo_id=pretrained, filename="config.json")
    except ValueError:  # huggingface_hub rejects malformed repo ids
        raise ConfigError(f"model.pretrained '{pretrained}': not a directory nor a valid hub id") from None
    if not isinstance(cached, str):
        raise ConfigError(
            f"model.pretrained '{pretrained}' is not in the local Hugging Face cache: download it first "
            f"(`hf download {pretrained} config.json`) or pass a local directory"
        )
    return _load(Path(cached))


def available_locally(pretrained: str) -> bool:
    """True when ``pretrained``'s config.json is on this machine: a local directory or the local hub cache."""
    if Path(pretrained).expanduser().is_dir():
        return True
    if pretrained.startswith(("/", ".", "~")) or pretrained.count("/") > 1:
        return False
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id=pretrained, filename="config.json"), str)
    except ValueError:  # not a valid hub id
        return False


def check_agrees(declared: dict[str, Any], found: dict[str, Any], source: str) -> None:
    """Raise ConfigError naming every key that matters where the declared and found configs differ."""
    diffs = [
        f"{key}: declared {declared[key]!r}, config.json {found.get(key)!r}"
        for key in KEYS_THAT_MATTER
        if key in declared and declared[key] != found.get(key)
    ]
    if diffs:
        raise ConfigError(
            f"model.architecture disagrees with {source}/config.json on {'; '.join(diffs)}: "
            "drop model.architecture or fix the keys"
        )


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config.json ({exc})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ConfigError(f"{path}: not an HF config.json (no model_type)")
    return _text_part(data)


def _text_part(data: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config.json whose text_config is a family's (Gemma 3 4B-27B): that text model, the keys that
    matter filled from its config class's defaults; any other config.json as it is."""
    from hetero.families import TEXT_OF

    text_type = TEXT_OF.get(data["model_type"])
    if text_type is None or not isinstance(data.get("text_config"), dict):
        return data
    from transformers import AutoConfig

    text = {**data["text_config"], "model_type": text_type}
    defaults = AutoConfig.for_model(text_type, **{k: v for k, v in text.items() if k != "model_type"})
    for key in KEYS_THAT_MATTER:
        text.setdefault(key, getattr(defaults, key, None))
    return text
