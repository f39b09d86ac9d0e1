"""Command-line overrides checked before Hydra composes them: each malformed one is a one-line ConfigError.

Hydra's grammar accepts forms its composer then rejects with a bare ValueError (``~train=3``: a group
deleted with a value that is no file name; ``=3``: no key; ``hydra/launcher=3``) or that reach Hydra's own
settings, which hetero never reads (it composes with Hydra's API: no launcher, sweeper or output
directory). Each is refused here with what to write instead. Imported by hetero.config's compose step
(it needs Hydra).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser

from hetero.config import GROUPS, available_options
from hetero.errors import ConfigError
from hetero.serde import short_repr

MAX_KEY_CHARS = 200  # hetero's longest key is under 40 characters


def check_overrides(overrides: list[str], user_dir: Path | None) -> None:
    """Refuse what Hydra would fail on with a traceback, and a config group given something but a file name."""
    for override in OverridesParser.create().parse_overrides(overrides):
        given = (override.input_line or override.key_or_group or "")[:60]
        _check_key(override, given)
        if override.key_or_group in GROUPS:
            _check_group(override, given, user_dir)


def quote_file_names(overrides: list[str], user_dir: Path | None) -> list[str]:
    """``hardware=3090_4090``: Hydra reads a bare 3090_4090 as the integer 30904090; where the text after '='
    names one of the group's files, quote it so the file is picked."""
    out = []
    for line in overrides:
        key, eq, value = line.partition("=")
        if eq and key in GROUPS and value and value[0] not in "'\"" and value in available_options(key, user_dir):
            line = f"{key}='{value}'"
        out.append(line)
    return out


def _check_key(override: Any, given: str) -> None:
    """A key is there, names one of hetero's keys (not Hydra's own settings) and has no @package."""
    key = str(override.key_or_group or "")
    if not key:
        raise ConfigError(f"{short_repr(given)} has no key before '=': write key=value, e.g. train.lr=1e-4")
    if len(key) > MAX_KEY_CHARS:  # Hydra would look for a config group of that name on disk: a traceback
        raise ConfigError(f"{short_repr(key)}: no key of hetero is {len(key):,} characters long; `hetero compile "
                          "--help` lists them")
    if key == "hydra" or key.startswith(("hydra.", "hydra/")):
        raise ConfigError(f"{given}: hetero has no hydra settings (Hydra only composes its config); your own "
                          "config files go in a directory passed with --config-dir DIR")
    if override.package is not None:
        raise ConfigError(f"{given}: hetero's config groups have fixed places; drop '@{override.package}' "
                          f"and write {key}=...")


def _check_group(override: Any, given: str, user_dir: Path | None) -> None:
    """``model=5``, ``~model=5``: a config group takes the name of one of its files (Hydra fails otherwise)."""
    group = override.key_or_group
    options = ", ".join(available_options(group, user_dir))
    if override.is_delete():
        if override.value() is not None and not isinstance(override.value(), str):
            raise ConfigError(f"{given}: ~{group} removes the {group} group and takes no value (or the name of "
                              f"its selected file); to change one of its keys write {group}.KEY=VALUE")
        return
    if override.is_sweep_override():
        raise ConfigError(f"{given}: one {group} per compile, not a sweep; pick one of: {options}")
    if not isinstance(override.value(), str):
        raise ConfigError(f"{given}: {group}= takes the name of one of its files ({options}), "
                          f"got {short_repr(override.value())}")
