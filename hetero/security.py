"""Who may talk to a run's processes: per-process keys, and where each host finds its own.

Every process of a run (the coordinator and each stage) has an identity (``coordinator``,
``stage0``, ...) and a key file of its own. Two modes, chosen by `hetero compile` (``security=``):

- ``curve`` (default when any endpoint is off loopback): CurveZMQ. Each process's inbox is a CURVE
  server; peers connect with their own keypair. plan.json carries every identity's *public* key, so
  a process accepts exactly the run's keys and knows which identity sent each message. Traffic is
  encrypted. A host holds only the secret keys of the processes it runs.
- ``token`` (default when every endpoint is loopback): ZeroMQ PLAIN, authenticated without the cost of
  encryption; only for one machine. Each process's key file holds one random 256-bit secret, its own.
  PLAIN hands the password to the server in the clear, so a process presents each peer's inbox a
  password of its own (``peer_token``: HMAC-SHA256 of its secret and the peer's name): what a peer
  learns from a connection logs in nowhere but at that peer. plan.json carries, per inbox and per
  process that may connect to it, the SHA-256 of that password (a verifier: public, useless to log
  in with), so no key file speaks for another process.
- ``none``: no authentication, for a network you trust completely (documented in docs/security.md).

Key files are JSON, mode 0600, in ``<out>/artifacts/<host>/keys/<identity>.key`` (the folder a host
needs is its artifacts folder); `hetero keys plan.json` makes new ones (rotation).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hetero.errors import ConfigError, PlanError

COORDINATOR = "coordinator"  # the run's process names, on the wire and in key files
KEY_SUFFIX = ".key"
_HEX256 = re.compile(r"[0-9a-f]{64}")  # a token-mode secret, password or verifier

Mode = Literal["curve", "token", "none"]


@dataclass(frozen=True)
class SecuritySpec:
    """plan.json's security section: the mode and what lets each process check its peers (nothing secret)."""

    mode: Mode = "none"
    public_keys: dict[str, str] = field(default_factory=dict)  # curve: identity -> z85 public key
    # token: inbox owner -> identity that may connect to it -> SHA-256 hex of the password it presents there.
    # Empty in a token plan compiled before per-process tokens (load_identity says to run `hetero keys`).
    token_verifiers: dict[str, dict[str, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Identity:
    """One process's own key material, read from its key file."""

    name: str
    mode: Mode
    public: str = ""  # z85 (curve)
    secret: str = ""  # z85 (curve)
    token: str = ""  # hex (token): this process's own secret; it presents peer_token(token, peer), never this
    verifiers: tuple[tuple[str, str], ...] = ()  # token: (identity, verifier) of each process its inbox admits

    def token_for(self, peer: str) -> str:
        """The password this process presents at ``peer``'s inbox (token mode)."""
        return peer_token(self.token, peer)


def peer_token(secret: str, server: str) -> str:
    """The PLAIN password that the process holding ``secret`` presents at ``server``'s inbox: HMAC-SHA256.

    The server sees it in the clear; one password per server means a process learns from its clients
    only how to log in at itself."""
    return hmac.new(bytes.fromhex(secret), server.encode(), hashlib.sha256).hexdigest()


def token_verifier(password: str | bytes) -> str:
    """What plan.json holds of a password: its SHA-256 hex (a 256-bit random password is not found from it)."""
    return hashlib.sha256(password.encode() if isinstance(password, str) else password).hexdigest()


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
    """Fresh keys for every identity of a run, written to ``out_dir/artifacts/<host>/keys/``; returns the plan section.

    Old key files of this plan are replaced, so older copies stop working (rotation).
    """
    return generate_for(mode, {name: host_of(name, stage_hosts) for name in identities(len(stage_hosts))}, out_dir)


def generate_for(mode: Mode, hosts: dict[str, str], out_dir: Path) -> SecuritySpec:
    """Fresh keys for each identity of ``hosts`` (identity -> the host it runs on), in
    ``out_dir/artifacts/<host>/keys/<identity>.key``; stale key files there are removed. Also `hetero profile`'s."""
    if mode == "none":
        return SecuritySpec(mode="none")
    import zmq

    names = list(hosts)
    files: dict[str, dict[str, Any]] = {}
    public: dict[str, str] = {}
    verifiers: dict[str, dict[str, str]] = {}
    if mode == "curve":
        for name in names:
            pub, sec = zmq.curve_keypair()
            public[name] = pub.decode("ascii")
            files[name] = {"identity": name, "mode": "curve", "public": public[name], "secret": sec.decode("ascii")}
    else:
        own = {name: secrets.token_hex(32) for name in names}
        files = {name: {"identity": name, "mode": "token", "token": own[name]} for name in names}
        verifiers = {server: {client: token_verifier(peer_token(own[client], server)) for client in names}
                     for server in names}
    for host in sorted(set(hosts.values())):
        folder = out_dir / "artifacts" / host / "keys"
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        for stale in folder.glob(f"*{KEY_SUFFIX}"):
            stale.unlink()
    for name, content in files.items():
        _write_private(out_dir / "artifacts" / hosts[name] / "keys" / f"{name}{KEY_SUFFIX}",
                       json.dumps(content, indent=1))
    return SecuritySpec(mode=mode, public_keys=public, token_verifiers=verifiers)


def _write_private(path: Path, text: str) -> None:
    """Write a key file readable by its owner only (created 0600: never briefly world-readable)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        # O_CREAT's mode applies to a new file only: one that exists (copied, or made 0644 by hand) keeps its own.
        os.fchmod(f.fileno(), 0o600)
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
    if spec.mode == "token" and not spec.token_verifiers:
        raise PlanError("plan.json's token keys are from before per-process tokens (each key file could log in as "
                        "any process): run `hetero keys plan.json` and copy the new plan.json and keys to every host")
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
    return _curve_identity(spec, name, path, data) if spec.mode == "curve" else _token_identity(spec, name, path, data)


def _curve_identity(spec: SecuritySpec, name: str, path: Path, data: dict[str, Any]) -> Identity:
    """``name``'s CURVE keypair from its key file, checked against plan.json's public key."""
    public, secret = data.get("public"), data.get("secret")
    if not (isinstance(public, str) and isinstance(secret, str) and len(public) == 40 and len(secret) == 40):
        raise PlanError(f"key file {path} holds no CURVE keypair: recreate keys with `hetero keys plan.json`")
    if spec.public_keys.get(name) != public:
        raise PlanError(f"key file {path} does not match plan.json's public key for {name} (keys were "
                        "rotated?): copy the new plan.json and keys to every host")
    return Identity(name=name, mode="curve", public=public, secret=secret)


def _token_identity(spec: SecuritySpec, name: str, path: Path, data: dict[str, Any]) -> Identity:
    """``name``'s own token from its key file, checked against plan.json's verifiers, with what its inbox admits."""
    token = data.get("token")
    if "peer_tokens" in data:  # the old format: every process's token in every key file
        raise PlanError(f"key file {path} holds every process's token (made before per-process tokens): run "
                        "`hetero keys plan.json` and copy the new plan.json and keys to every host")
    if not isinstance(token, str) or not _HEX256.fullmatch(token):
        raise PlanError(f"key file {path} holds no token: recreate keys with `hetero keys plan.json`")
    bad = next((f"{server}.{client}" for server, clients in spec.token_verifiers.items()
                for client, verifier in clients.items() if not _HEX256.fullmatch(verifier)), None)
    if bad is not None:
        raise PlanError(f"plan.json's security.token_verifiers.{bad[:80]} is not a SHA-256 hex digest (edited by "
                        "hand?): run `hetero keys plan.json`")
    admitted = spec.token_verifiers.get(name, {})
    if admitted.get(name) != token_verifier(peer_token(token, name)):
        raise PlanError(f"key file {path} does not match plan.json's token verifiers for {name} (keys were "
                        "rotated?): copy the new plan.json and keys to every host")
    return Identity(name=name, mode="token", token=token, verifiers=tuple(sorted(admitted.items())))


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
        elif target.is_file():
            os.chmod(target, 0o600)  # already in place (a resumed run dir): private all the same
