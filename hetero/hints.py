"""Commands the tool suggests (``re-run `hetero profile ...```), built from how the user called it.

A plan and a profile keep the command line they were composed from (``config["command_line"]``), so a
hint repeats the user's overrides (``hardware.num_devices=3``) and works as printed. Torch- and
Hydra-free: the runtime builds hints too.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

COMMAND_LINE = "command_line"  # config[COMMAND_LINE] = {"config_dir": str | None, "overrides": [str, ...]}


def suggest(command: str, config: Mapping[str, Any] | None, *, fallback: Sequence[str],
            drop: Iterable[str] = ("output", "profile"), add: Sequence[str] = ()) -> str:
    """``hetero <command> ...`` with the overrides (and --config-dir) the config was composed from, less
    the keys in ``drop``, plus ``add``: a hint that keeps what the user chose (``hardware.num_devices=3``).

    ``config`` is a plan's or profile's stored config; one from before it recorded its command line gets
    ``fallback`` (e.g. ``model=NAME hardware=FLEET``).
    """
    line = (config or {}).get(COMMAND_LINE)
    if isinstance(line, Mapping) and isinstance(line.get("overrides"), list):
        dropped = set(drop) | {a.split("=", 1)[0] for a in add}
        parts = ["-cd", str(line["config_dir"])] if line.get("config_dir") else []
        parts += [str(o) for o in line["overrides"] if _override_key(str(o)) not in dropped]
    else:
        parts = list(fallback)
    return shlex.join(["hetero", command, *parts, *add])


def _override_key(override: str) -> str:
    """``hardware.num_devices`` for ``hardware.num_devices=3``; ``+``/``++``/``~`` prefixes ignored."""
    return override.split("=", 1)[0].lstrip("+~").strip()
