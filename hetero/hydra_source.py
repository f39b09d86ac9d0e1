"""The Hydra config source for the user's --config-dir: each YAML file is checked before OmegaConf reads it.

OmegaConf expands every YAML alias into a copy and recurses once per level, so an alias bomb or a
deeply nested file would hang or crash composition; hetero.safe_yaml measures the file first.
Imported only by hetero.config's compose step (it needs Hydra).
"""

from __future__ import annotations

import os

# Hydra keeps its file source under _internal; this subclass adds a check before Hydra's own loading.
from hydra._internal.core_plugins.file_config_source import FileConfigSource
from hydra.core.plugins import Plugins
from hydra.plugins.config_source import ConfigResult

from hetero.errors import ConfigError
from hetero.safe_yaml import load_yaml

SCHEME = "hetero-file"


class CheckedFileConfigSource(FileConfigSource):
    """``hetero-file://DIR``: Hydra's file source, refusing a file that hetero.safe_yaml refuses."""

    @staticmethod
    def scheme() -> str:
        return SCHEME

    def load_config(self, config_path: str) -> ConfigResult:
        path = os.path.realpath(os.path.join(self.path, self._normalize_file_name(config_path)))
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{path}: cannot read it ({exc})") from None
            data = load_yaml(path, text)
            if data is not None and not isinstance(data, dict):
                raise ConfigError(f"{path}: a config file must be a mapping of keys to values, got a "
                                  f"{type(data).__name__}")
        return super().load_config(config_path)


def register() -> None:
    """Make ``hetero-file://`` known to Hydra (idempotent)."""
    Plugins.instance().register(CheckedFileConfigSource)
