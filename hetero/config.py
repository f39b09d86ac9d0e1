"""Compose the Hydra config (conf/ + the user's --config-dir) and convert it to typed specs at the edge.

Hydra is used only through its compose API: no @hydra.main, no working-directory change, no output
directories. Every failure becomes a one-line ConfigError.
"""

from __future__ import annotations

import importlib.resources
import math
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from hetero.errors import ConfigError
from hetero.families import ATTENTION_CHOICES, EXPERTS_CHOICES, check_seq_len
from hetero.hardware import build_cluster, load_device_types
from hetero.hints import COMMAND_LINE
from hetero.safe_yaml import check_interpolations, check_yaml, yaml_error_message
from hetero.security import Mode, resolve_mode
from hetero.serde import from_dict, short_repr
from hetero.specs import (
    ClusterSpec,
    DataSpec,
    EvalSpec,
    LoraSpec,
    ModelSpec,
    PlannerOptions,
    TrainSpec,
    check_eval,
    check_ranges,
    check_run_length,
)

GROUPS = ("model", "hardware", "train", "planner")
_TOP_KEYS = frozenset({"model", "lora", "hardware", "train", "planner", "data", "eval", "output", "profile",
                       "security"})
_DTYPES = {
    "auto": "auto",
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


_SECTION_TYPES: dict[str, type] = {
    "model": ModelSpec,
    "lora": LoraSpec,
    "train": TrainSpec,
    "data": DataSpec,
    "eval": EvalSpec,
    "planner": PlannerOptions,
}


@dataclass(frozen=True)
class Config:
    """The composed configuration as typed specs, plus the resolved dict (stored in plan.json).

    Built and validated once, by ``load``; frozen, like the specs it holds (a sweep point is a ``replace``)."""

    model: ModelSpec
    cluster: ClusterSpec
    train: TrainSpec
    data: DataSpec
    planner: PlannerOptions
    output: Path
    raw: dict[str, Any] = field(default_factory=dict)
    profile: Path | None = None  # a measured profile (`hetero profile`) to plan with instead of datasheets
    profiles: tuple[Path, ...] = ()  # every profile=[...] entry (a file or a run directory), merged; [0] is profile
    security: Mode = "curve"  # resolved: curve | token | none (hetero/security.py)
    eval: EvalSpec = field(default_factory=EvalSpec)


def package_conf_dir() -> Path:
    """The bundled conf/ directory (package data, so a non-editable install finds it too)."""
    return Path(str(importlib.resources.files("hetero.conf")))


def available_options(group: str, config_dir: str | Path | None = None) -> list[str]:
    """Names selectable for a config group, from the bundled conf/ and the user's config dir."""
    names = {p.stem for p in (package_conf_dir() / group).glob("*.yaml")}
    if config_dir is not None:
        names |= {p.stem for p in (Path(config_dir).expanduser() / group).glob("*.yaml") if p.is_file()}
    return sorted(names)


def _yaml_file(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _defaults_line(values: dict[str, Any], skip: tuple[str, ...] = ()) -> str:
    def show(v: Any) -> str:
        if v is None:
            return "null"
        if isinstance(v, list):
            return "[" + ",".join(map(str, v)) + "]"
        return str(v).lower() if isinstance(v, bool) else str(v)

    return " ".join(f"{k}={show(v)}" for k, v in values.items() if k not in skip and not isinstance(v, dict))


def choices_help(commands: bool = True) -> str:
    """What `hetero compile --help` lists: the shipped models and fleets, where your own fleet goes, and
    each group's main keys with their defaults (read from the bundled conf/, so it cannot drift)."""
    conf = package_conf_dir()
    root = _yaml_file(conf / "config.yaml")
    tiny = _yaml_file(conf / "model" / "tiny.yaml")  # @package _global_: model: and lora: at the top
    lines = [
        f"models (model=NAME):     {', '.join(available_options('model'))}  (hf: any hub id or local dir, "
        "model.pretrained=...)",
        f"fleets (hardware=NAME):  {', '.join(available_options('hardware'))}  (yours: -cd DIR with "
        "DIR/hardware/NAME.yaml; docs/fleet.md)",
    ]
    if not commands:
        return "\n".join(lines)
    lines += [
        "",
        "keys, with their defaults (key=value on the command line):",
        f"  train.*    {_defaults_line(_yaml_file(conf / 'train' / 'default.yaml'))}",
        f"  planner.*  {_defaults_line(_yaml_file(conf / 'planner' / 'default.yaml'))}",
        f"  model.*    {_defaults_line(tiny.get('model') or {}, skip=('name',))}  (model=tiny's; each model "
        "file sets its own)",
        f"  lora.*     {_defaults_line(tiny.get('lora') or {})}",
        f"  data.*     {_defaults_line(root.get('data') or {})}  (docs/data.md: formats)",
        f"  eval.*     {_defaults_line(root.get('eval') or {})}  (docs/running.md)",
        f"  profile={root.get('profile') or 'null'} (a `hetero profile` file or a run dir)  security={root.get('security')} "
        f"(auto|curve|token|none)  output={root.get('output')}",
    ]
    return "\n".join(lines)


def compose_raw(overrides: list[str], config_dir: str | Path | None = None) -> dict[str, Any]:
    """Compose conf/config.yaml with ``overrides`` and return the resolved plain dict."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import (
        ConfigCompositionException,
        HydraException,
        MissingConfigException,
        OverrideParseException,
    )
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from hetero import hydra_source
    from hetero.overrides import check_overrides, quote_file_names

    user_dir: Path | None = None
    if config_dir is not None:
        user_dir = Path(config_dir).expanduser().resolve()
        if not user_dir.is_dir():
            raise ConfigError(f"--config-dir {config_dir}: no such directory")
    given = quote_file_names(list(overrides), user_dir)
    overrides = list(given)
    if config_dir is not None:
        # Through hetero's checked source: each file of the user's dir is measured before OmegaConf reads it.
        hydra_source.register()
        quoted = str(user_dir).replace("\\", "\\\\").replace("'", "\\'")
        overrides.append(f"hydra.searchpath=['{hydra_source.SCHEME}://{quoted}']")
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        check_overrides(given, user_dir)  # the user's own: the searchpath above is hetero's
        with initialize_config_dir(config_dir=str(package_conf_dir()), version_base=None):
            cfg = compose(config_name="config", overrides=overrides)
            check_interpolations(OmegaConf.to_container(cfg, resolve=False))  # before resolving them
            raw = OmegaConf.to_container(cfg, resolve=True)
    except yaml.YAMLError as exc:
        raise ConfigError(_locate_yaml_error(exc, user_dir)) from None
    except MissingConfigException as exc:
        raise ConfigError(_missing_option_message(str(exc), user_dir)) from None
    except OverrideParseException as exc:
        # The lexer's own message only repeats the override.
        reason = "" if _first_line(exc).startswith("LexerNoViable") else f" ({_first_line(exc)[:80]})"
        raise ConfigError(f"cannot read the override {short_repr(exc.override)}{reason}; write key=value, and "
                          "quote a value with spaces or symbols: key='a b'") from None
    except ConfigCompositionException as exc:
        raise ConfigError(_composition_message(exc)) from None
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(_first_line(exc)) from None
    assert isinstance(raw, dict)
    return {str(k): v for k, v in raw.items()}


def load(overrides: list[str], config_dir: str | None = None) -> Config:
    """Compose the config and build the typed specs; any defect raises a one-line ConfigError."""
    raw = compose_raw(overrides, config_dir)
    unknown = sorted(set(raw) - _TOP_KEYS)
    if unknown:
        raise ConfigError(f"unknown top-level key(s) {unknown}; known: {', '.join(sorted(_TOP_KEYS))}")
    model = _model_spec(raw.get("model"), raw.get("lora"))
    raw["model"]["architecture"] = model.architecture  # resolved for model=hf; stored in plan.json
    raw["model"]["name"] = model.name
    extra_specs = []
    if config_dir is not None and (Path(config_dir).expanduser() / "hardware_specs").is_dir():
        extra_specs.append(Path(config_dir).expanduser() / "hardware_specs")
    cluster = build_cluster(_section(raw, "hardware"), load_device_types(extra_specs))
    train = _convert(TrainSpec, raw.get("train"), "train")
    data = _convert(DataSpec, raw.get("data"), "data")
    planner = _convert(PlannerOptions, raw.get("planner"), "planner")
    evaluation = _convert(EvalSpec, raw.get("eval"), "eval")
    check_ranges(model, train, planner, ConfigError)
    check_run_length(train, overrides)
    check_eval(evaluation, cluster)
    _check_manual_split(planner, model, cluster)
    output = raw.get("output", ".")
    if not isinstance(output, str) or not output:
        raise ConfigError(f"output must be a directory path, got {short_repr(output)}")
    profile = raw.get("profile")
    profiles = [profile] if isinstance(profile, str) else profile if isinstance(profile, list) else [profile]
    if profile is not None and (not profiles or not all(isinstance(p, str) and p for p in profiles)):
        raise ConfigError(f"profile must be the path of a `hetero profile` file or of a run directory (or a list "
                          f"of them: profile=[RUN_DIR,profile.json]), got {short_repr(profile)}")
    requested = raw.get("security", "auto")
    if not isinstance(requested, str):
        raise ConfigError(f"security must be one of auto, curve, token, none, got {short_repr(requested)}")
    security = resolve_mode(requested, [h.address for h in cluster.hosts])
    # The command line itself, so every hint built from this config (plan.json's copy) repeats the user's choices.
    raw[COMMAND_LINE] = {"config_dir": str(Path(config_dir).expanduser().resolve()) if config_dir else None,
                         "overrides": [str(o) for o in overrides]}
    return Config(
        security=security,
        model=model,
        cluster=cluster,
        train=train,
        data=data,
        planner=planner,
        output=Path(output).expanduser(),
        raw=raw,
        profile=Path(str(profiles[0])).expanduser() if profile else None,
        profiles=tuple(Path(str(p)).expanduser() for p in profiles) if profile else (),
        eval=evaluation,
    )


def _section(raw: dict[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key)
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a mapping, got {short_repr(value)}")
    return value


def _convert(cls: type, data: Any, where: str) -> Any:
    if data is None:
        data = {}
    try:
        return from_dict(cls, data, where, ConfigError)
    except ConfigError as exc:
        raise ConfigError(_reword(str(exc), cls, where)) from None


def _reword(message: str, cls: type, where: str) -> str:
    """serde's ``a.b: expected an integer, got 'x'`` -> ``a.b must be an integer, got 'x'``."""
    m = re.match(r"^(\S+): unknown field\(s\) \[(.*)\]$", message)
    if m:
        keys = [k.strip(" '\"") for k in m.group(2).split(",")]
        known = ", ".join(f.name for f in fields(cls))
        return f"unknown key(s) {', '.join(f'{m.group(1)}.{k}' for k in keys)}; {where} has: {known}"
    m = re.match(r"^(\S+): expected (an integer|a number|a list|an object|str|bool), got (.*)$", message)
    if m:
        kind = {"str": "a string", "bool": "true or false", "an object": "a mapping"}.get(
            m.group(2), m.group(2)
        )
        return f"{m.group(1)} must be {kind}, got {m.group(3)}"
    m = re.match(r"^(\S+): expected one of (\[.*\]), got (.*)$", message)
    if m:
        return f"{m.group(1)} must be one of {m.group(2)}, got {m.group(3)}"
    return message


def _model_spec(model: Any, lora: Any) -> ModelSpec:
    if not isinstance(model, dict):
        raise ConfigError(f"model must be a mapping (pick one with model=<name>), got {short_repr(model)}")
    model = dict(model)
    if model.get("architecture") is not None and not isinstance(model["architecture"], dict):
        raise ConfigError("model.architecture must be a mapping (an HF config.json) or null, got "
                          f"{short_repr(model['architecture'])}")
    if model.get("pretrained") is not None and not isinstance(model["pretrained"], str):
        raise ConfigError(f"model.pretrained must be a hub id or a directory, got {short_repr(model['pretrained'])}")
    if model.get("architecture") is None:
        pretrained = model.get("pretrained")
        if not pretrained:
            raise ConfigError(
                "model.pretrained is required when model.architecture is null: "
                "pass model.pretrained=<hub id or local dir>"
            )
        model["architecture"] = resolve_architecture(None, str(pretrained))
    elif model.get("pretrained"):
        # A model file's architecture must agree with the weights it names whenever their config.json
        # is on this machine; one not downloaded yet is taken as declared (compile needs no weights).
        model["architecture"] = resolve_architecture(dict(model["architecture"]), str(model["pretrained"]),
                                                     required=False)
    if not model.get("name"):
        model["name"] = str(model.get("pretrained", "model")).rstrip("/").split("/")[-1]
    dtype = model.get("dtype", "auto")
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise ConfigError(f"model.dtype must be one of {sorted(set(_DTYPES.values()))}, got {short_repr(dtype)}")
    model["dtype"] = _DTYPES[dtype]
    spec = _convert(ModelSpec, {k: v for k, v in model.items()}, "model")
    if spec.attn_implementation not in ATTENTION_CHOICES:
        raise ConfigError(f"model.attn_implementation must be one of {', '.join(ATTENTION_CHOICES)}, got "
                          f"{short_repr(spec.attn_implementation)}")
    if spec.experts_implementation not in EXPERTS_CHOICES:
        raise ConfigError(f"model.experts_implementation must be one of {', '.join(EXPERTS_CHOICES)}, got "
                          f"{short_repr(spec.experts_implementation)}")
    if "model_type" not in spec.architecture:
        raise ConfigError("model.architecture has no model_type (it must be an HF config.json as a mapping)")
    check_seq_len(spec.architecture, spec.seq_len)
    _check_architecture(spec.architecture)
    positions = spec.architecture.get("max_position_embeddings")
    if isinstance(positions, int) and not isinstance(positions, bool) and 0 < positions < spec.seq_len:
        raise ConfigError(f"model.seq_len={spec.seq_len} is longer than the model's max_position_embeddings="
                          f"{positions} (its config.json): set model.seq_len={positions} or less")
    return replace(spec, lora=_convert(LoraSpec, lora, "lora"))


# Architecture keys the compiler sizes the model by: positive integers, a bound past any real model
# (so meta tensors and cost arithmetic stay finite), and None where HF allows it (head_dim). Layers:
# released models have at most ~130; tracing and planning grow with the count (256 take a minute).
_ARCHITECTURE_SIZES = {
    "hidden_size": 2**20,
    "intermediate_size": 2**22,
    "num_hidden_layers": 256,
    "num_attention_heads": 2**12,
    "num_key_value_heads": 2**12,
    "head_dim": 2**12,
    "vocab_size": 2**24,
    "max_position_embeddings": 2**30,
}
_ARCHITECTURE_NUMBERS = ("rms_norm_eps", "rope_theta", "initializer_range")


def _check_architecture(architecture: dict[str, Any]) -> None:
    """The sizes the compiler reads: what to fix, before transformers fails on it with a page of text."""
    if not isinstance(architecture.get("model_type"), str):
        raise ConfigError(f"model.architecture.model_type must be a string such as llama, got "
                          f"{short_repr(architecture.get('model_type'))}")
    for key, high in _ARCHITECTURE_SIZES.items():
        value = architecture.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
            raise ConfigError(f"model.architecture.{key} must be a positive integer (at most {high}), got "
                              f"{short_repr(value)}")
    for key in _ARCHITECTURE_NUMBERS:
        value = architecture.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise ConfigError(f"model.architecture.{key} must be a finite number, got {short_repr(value)}")


def resolve_architecture(
    architecture: dict[str, Any] | None, pretrained: str, *, required: bool = True
) -> dict[str, Any]:
    """The HF config dict for ``pretrained`` (delegates to hetero.compiler.models, imported lazily)."""
    try:
        from hetero.compiler.models import resolve_architecture as resolve
    except ImportError as exc:
        raise ConfigError(f"model=hf needs hetero.compiler.models, which is not available ({exc})") from None
    arch = resolve(architecture, pretrained, required=required)
    if not isinstance(arch, dict):
        raise ConfigError(f"model.pretrained={pretrained}: could not read its architecture")
    return arch


def _check_manual_split(planner: PlannerOptions, model: ModelSpec, cluster: ClusterSpec) -> None:
    """A manual split must cover every decoder layer and name real devices; planner.exclude names devices too."""
    names = [d.name for d in cluster.devices]
    unknown = [d for d in planner.exclude if d not in names]
    if unknown:
        raise ConfigError(f"planner.exclude names unknown device(s) {unknown}; the fleet has: {', '.join(names)}")
    if set(names) <= set(planner.exclude):
        raise ConfigError(f"planner.exclude={list(planner.exclude)} leaves fleet '{cluster.name}' no device to train on")
    both = [d for d in planner.devices or [] if d in planner.exclude]
    if both:
        raise ConfigError(f"planner.devices and planner.exclude both name {both}: keep each device in one of them")
    names = [d for d in names if d not in planner.exclude]
    if planner.devices is not None:
        missing = [d for d in planner.devices if d not in names]
        if missing:
            raise ConfigError(
                f"planner.devices names unknown device(s) {missing}; the fleet has: {', '.join(names)}"
            )
        if len(set(planner.devices)) != len(planner.devices):
            raise ConfigError(f"planner.devices lists a device twice: {planner.devices}")
    if planner.split is None:
        return
    layers = model.architecture.get("num_hidden_layers")
    if isinstance(layers, int) and sum(planner.split) != layers:
        raise ConfigError(
            f"planner.split {planner.split} covers {sum(planner.split)} decoder layers but {model.name} "
            f"has {layers}; make the counts add up to {layers}"
        )
    stages = len(planner.split)
    if planner.devices is not None and len(planner.devices) != stages:
        raise ConfigError(
            f"planner.split has {stages} stages but planner.devices names {len(planner.devices)} devices; "
            "give one device per stage"
        )
    if stages > len(names):
        raise ConfigError(f"planner.split has {stages} stages but the fleet has only {len(names)} devices")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return re.sub(r"\{[^{}]{80,}\}", "{...}", line)  # a whole section quoted back: the key in the line says which


def _missing_option_message(text: str, user_dir: Path | None) -> str:
    m = re.search(r"Could not (?:find|load) '([^'/]+)/([^']+)'", text)
    if not m:
        return text.strip().splitlines()[0] if text.strip() else "missing config"
    group, name = m.groups()
    options = available_options(group, user_dir) if group in GROUPS else []
    hint = (
        ""
        if user_dir is not None or group != "hardware"
        else " (your own fleet file: add --config-dir <dir>)"
    )
    return f"unknown {group} '{name}'; available: {', '.join(options) or 'none'}{hint}"


def _composition_message(exc: BaseException) -> str:
    text = str(exc)
    m = re.match(r"Could not override '([^']+)'", text)
    cause = exc.__cause__ or exc.__context__
    if m and cause is not None and "not in struct" in str(cause):
        key = m.group(1)
        section = key.split(".")[0]
        cls = _SECTION_TYPES.get(section)
        if cls is not None and "." in key:
            names = [f.name for f in fields(cls)]
            if key.partition(".")[2] in names:  # a key the file leaves out
                return f"'{key}' is not in this {section} file: add it with +{key}=<value>"
            return f"unknown key '{key}'; {section} has: {', '.join(names)}"
        return f"unknown key '{key}'; top-level keys: {', '.join(sorted(_TOP_KEYS))}"
    if m:
        return f"cannot override '{m.group(1)}': {_first_line(cause) if cause else _first_line(exc)}"
    return _first_line(exc)


def _locate_yaml_error(exc: yaml.YAMLError, user_dir: Path | None) -> str:
    """Hydra's YAML errors carry no file name: find the file that fails to parse."""
    roots = [d for d in (user_dir, package_conf_dir()) if d is not None]
    for root in roots:
        # Only where Hydra looks: the root and its group folders (a fleet dir may sit in $HOME).
        for path in sorted([*root.glob("*.yaml"), *root.glob("*/*.yaml")]):
            try:
                check_yaml(path, path.read_text())
            except ConfigError as found:
                return str(found)
            except (OSError, UnicodeDecodeError):
                continue
    return yaml_error_message("config", exc)
