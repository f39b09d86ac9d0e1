"""Who may talk to a run's processes: per-process keys, and where each host finds its own.

Every process of a run (the coordinator and each stage) has an identity (``coordinator``,
``stage0``, ...) and a key file of its own. Two modes, chosen by `hetero compile` (``security=``):

- ``curve`` (default when any endpoint is off loopback): CurveZMQ. Each process's inbox is a CURVE
  server; peers connect with their own keypair. plan.json carries every identity's *public* key, so
  a process accepts exactly the run's keys and knows which identity sent each message. Traffic is
  encrypted. A host holds only the secret keys of the processes it runs.
- ``token`` (default when every endpoint is loopback): ZeroMQ PLAIN with a random 256-bit token per
  identity. Authenticates without the cost of encryption; only for one machine, where every key
  file lies on the same disk anyway (the tokens are in each key file, never in plan.json).
- ``none``: no authentication, for a network you trust completely (documented in docs/security.md).

Key files are JSON, mode 0600, in ``<out>/artifacts/<host>/keys/<identity>.key`` (the folder a host
needs is its artifacts folder); `hetero keys plan.json` makes new ones (rotation).
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hetero.errors import ConfigError, PlanError

COORDINATOR = "coordinator"  # the run's process names, on the wire and in key files
KEY_SUFFIX = ".key"

Mode = Literal["curve", "token", "none"]


@dataclass(frozen=True)
class SecuritySpec:
    """plan.json's security section: the mode and every identity's public key (curve only)."""

    mode: Mode = "none"
    public_keys: dict[str, str] = field(default_factory=dict)  # identity -> z85 public key


@dataclass(frozen=True)
class Identity:
    """One process's own key material, read from its key file."""

    name: str
    mode: Mode
    public: str = ""  # z85 (curve)
    secret: str = ""  # z85 (curve)
    token: str = ""  # hex (token)
    peer_tokens: tuple[tuple[str, str], ...] = ()  # token mode: (identity, token) of every process


def stage_name(k: int) -> str:
    """The process name of stage k (its transport name, its peers' name for it, its key file's)."""
    return f"stage{k}"


def identities(num_stages: int) -> list[str]:
    return [COORDINATOR, *(stage_name(k) for k in range(num_stages))]


def is_loopback(address: str) -> bool:
    """Whether only this machine reaches ``address`` (localhost, 127.0.0.0/8, ::1): the one loopback check."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def default_mode(addresses: list[str]) -> Mode:
    """curve if any host is reached off loopback, token otherwise."""
    return "token" if all(is_loopback(a) for a in addresses) else "curve"


def resolve_mode(requested: str, addresses: list[str]) -> Mode:
    if requested == "auto":
        return default_mode(addresses)
    if requested not in ("curve", "token", "none"):
        raise ConfigError(f"security={requested!r} is not one of auto, curve, token, none")
    if requested == "token" and default_mode(addresses) == "curve":
        raise ConfigError("security=token sends its tokens unencrypted and is for one machine only; this fleet has "
                          "non-loopback addresses: use security=curve (or auto)")
    return requested  # type: ignore[return-value]


def host_of(identity: str, stage_hosts: list[str]) -> str:
    """The host an identity runs on: the coordinator runs on stage 0's host (its default)."""
    return stage_hosts[0] if identity == COORDINATOR else stage_hosts[int(identity[len("stage"):])]


def generate(mode: Mode, stage_hosts: list[str], out_dir: Path) -> SecuritySpec:
    """Fresh keys for every identity, written to ``out_dir/artifacts/<host>/keys/``; returns the plan section.

    Old key files of this plan are replaced, so older copies stop working (rotation).
    """
    if mode == "none":
        return SecuritySpec(mode="none")
    import zmq

    names = identities(len(stage_hosts))
    files: dict[str, dict[str, Any]] = {}
    public: dict[str, str] = {}
    if mode == "curve":
        for name in names:
            pub, sec = zmq.curve_keypair()
            public[name] = pub.decode("ascii")
            files[name] = {"identity": name, "mode": "curve", "public": public[name], "secret": sec.decode("ascii")}
    else:
        tokens = {name: secrets.token_hex(32) for name in names}
        for name in names:
            files[name] = {"identity": name, "mode": "token", "token": tokens[name], "peer_tokens": tokens}
    for host in sorted(set(stage_hosts)):
        folder = out_dir / "artifacts" / host / "keys"
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        for stale in folder.glob(f"*{KEY_SUFFIX}"):
            stale.unlink()
    for name, content in files.items():
        _write_private(out_dir / "artifacts" / host_of(name, stage_hosts) / "keys" / f"{name}{KEY_SUFFIX}",
                       json.dumps(content, indent=1))
    return SecuritySpec(mode=mode, public_keys=public)


def _write_private(path: Path, text: str) -> None:
    """Write a key file readable by its owner only (created 0600: never briefly world-readable)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _find_key(name: str, folders: list[Path]) -> Path | None:
    return next((f / f"{name}{KEY_SUFFIX}" for f in folders if (f / f"{name}{KEY_SUFFIX}").is_file()), None)


def key_dirs(plan_path: Path, host: str) -> list[Path]:
    """Where a process of ``host`` looks for its key file, in order."""
    base = Path(plan_path).resolve().parent
    return [base / "keys", base / "artifacts" / host / "keys"]


def load_identity(spec: SecuritySpec, name: str, folders: list[Path]) -> Identity | None:
    """The key file of ``name`` (None in mode none); a one-line PlanError when missing or wrong."""
    if spec.mode == "none":
        return None
    path = _find_key(name, folders)
    if path is None:
        where = " or ".join(str(f) for f in folders)
        raise PlanError(f"no key file {name}{KEY_SUFFIX} in {where}: copy the plan's artifacts/<host>/keys folder "
                        "to this host (or pass --keys DIR); `hetero keys plan.json` makes new keys")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"key file {path} is unreadable ({exc}): recreate keys with `hetero keys plan.json`") from None
    if not isinstance(data, dict) or data.get("identity") != name or data.get("mode") != spec.mode:
        raise PlanError(f"key file {path} is not {name}'s {spec.mode} key: recreate keys with `hetero keys plan.json`")
    if spec.mode == "curve":
        public, secret = data.get("public"), data.get("secret")
        if not (isinstance(public, str) and isinstance(secret, str) and len(public) == 40 and len(secret) == 40):
            raise PlanError(f"key file {path} holds no CURVE keypair: recreate keys with `hetero keys plan.json`")
        if spec.public_keys.get(name) != public:
            raise PlanError(f"key file {path} does not match plan.json's public key for {name} (keys were "
                            "rotated?): copy the new plan.json and keys to every host")
        return Identity(name=name, mode="curve", public=public, secret=secret)
    token, peers = data.get("token"), data.get("peer_tokens")
    if not isinstance(token, str) or not isinstance(peers, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in peers.items()):
        raise PlanError(f"key file {path} holds no token: recreate keys with `hetero keys plan.json`")
    return Identity(name=name, mode="token", token=token, peer_tokens=tuple(sorted(peers.items())))


def install_keys(spec: SecuritySpec, names: list[str], folders: list[Path], dest: Path) -> None:
    """Copy the key files of ``names`` (found in ``folders``) to ``dest`` (0700), for processes started there.

    `hetero run` copies plan.json into its run directory and starts local stages from that copy; the
    stages find their keys in ``RUN_DIR/keys``. Only this host's identities are copied.
    """
    if spec.mode == "none":
        return
    dest.mkdir(parents=True, exist_ok=True)
    os.chmod(dest, 0o700)
    for name in names:
        load_identity(spec, name, folders)  # one-line error when missing or wrong
        src = _find_key(name, folders)
        target = dest / f"{name}{KEY_SUFFIX}"
        if src is not None and src.resolve() != target.resolve():
            _write_private(target, src.read_text())
