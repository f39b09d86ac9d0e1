"""The measured profile of a fleet for one model (`hetero profile`): versioned, validated, torch-free.

A profile holds, per device, a linear fit ``time = a + b * tokens`` of the forward and backward of
each layer kind (embedding, decoder, norm, head) measured on one real layer of the model at its
dtype, quantization and LoRA; the memory that layer needed (fixed and per token); the device's
usable memory; and, per host pair, the bandwidth and latency measured over the runtime's own
transport. It is tied to one fleet and one model by hashes: a profile of another fleet, model or
schema version is refused with one line, because its numbers would silently mislead the planner.

Every `hetero run` writes one too (RUN_DIR/profile.json, hetero.runtime.run.run_profile): what the run
measured, in this schema, with ``origin`` saying which run and step. ``load_profile`` reads a file or a
run directory; ``merge_profiles`` lays a run's measurements over a `hetero profile` file's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hetero import __version__
from hetero.errors import ConfigError
from hetero.families import FAMILIES
from hetero.serde import check_schema_version, from_dict, read_versioned_json, to_dict
from hetero.specs import ClusterSpec, ModelSpec

# v2 added what a run records (Profile.origin, DeviceProfile.sources); v3 the cores a run's CPU stages got
# (Profile.host_cores); v4 what weight streaming needs (DeviceProfile.host_link_gbs, .host_ram_gb); v5 the codec of
# compressed hand-offs (DeviceProfile.codec_encode, .codec_decode) and links naming the security mode they were
# measured in (LinkProfile.method). Older files load unchanged.
PROFILE_SCHEMA_VERSION = 5
READABLE_VERSIONS = (1, 2, 3, 4, 5)
_REPROFILE = "re-run `hetero profile`"
LAYER_KINDS = ("embedding", "decoder", "norm", "head")
MEASURED_PARTS = (*LAYER_KINDS, "optimizer", "messages", "codec", "host link")  # what a device's profile reports progress on


class ProfileError(ConfigError):
    """A profile file is malformed, from another schema version, or of another fleet or model."""


@dataclass(frozen=True)
class LinearFit:
    """Least-squares fit ``seconds = a_s + b_s_per_token * x`` over measured samples.

    ``x`` is tokens for layer times; the optimizer and message fits say what theirs is.
    """

    a_s: float
    b_s_per_token: float
    r2: float  # coefficient of determination of the fit (1 = perfect line)
    samples: list[list[float]] = field(default_factory=list)  # [x, seconds] pairs (trimmed means of repeats)

    def at(self, tokens: float) -> float:
        """Predicted seconds at ``tokens`` (never negative: a noisy intercept may be)."""
        return max(0.0, self.a_s + self.b_s_per_token * tokens)


def fit_line(xs: list[float], ys: list[float]) -> LinearFit:
    """Ordinary least squares of ys on xs; a single distinct x gives a flat line through the mean."""
    if len(xs) != len(ys) or not xs:
        raise ValueError("fit_line needs as many ys as xs, at least one")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return LinearFit(my, 0.0, 1.0, [[float(x), float(y)] for x, y in zip(xs, ys, strict=True)])
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - (a + b * x)) ** 2 for x, y in zip(xs, ys, strict=True))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return LinearFit(a, b, r2, [[float(x), float(y)] for x, y in zip(xs, ys, strict=True)])


@dataclass(frozen=True)
class LayerProfile:
    """One layer kind measured on one device."""

    kind: str  # embedding | decoder | norm | head
    fwd: LinearFit
    bwd: LinearFit
    weight_bytes: float  # parameters + buffers of the built layer (after quantization, with LoRA)
    lora_params: int
    activation_bytes_per_token: float  # saved for backward, per token of a micro-batch
    peak_bytes_per_token: float  # peak extra memory during forward+backward, per token
    memory_method: str  # how the two numbers above were measured (see hetero.runtime.tools.profiler)
    # Decoder layers: bytes kept per token when the layer recomputes (None: not measured, older profile).
    recompute_bytes_per_token: float | None = None


@dataclass(frozen=True)
class DeviceProfile:
    device: str  # DeviceSpec.name
    host: str
    type: str
    backend: str
    dtype: str  # the compute dtype it was measured in
    quantization: str
    threads: int | None
    usable_memory_gb: float | None  # free device memory when measured (None: unknown)
    seq_len: int
    token_counts: list[int]
    layers: dict[str, LayerProfile]  # by kind
    # Costs outside the layers (absent in profiles written before they were measured):
    optimizer: LinearFit | None = None  # one optimizer step; x = LoRA parameters on the stage
    message_send: LinearFit | None = None  # CPU time to send one activation/gradient; x = bytes
    message_recv: LinearFit | None = None  # CPU time to receive and place one; x = bytes
    telemetry: dict[str, float] = field(default_factory=dict)  # temperature_c, clocks; absent if not exposed
    environment: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0  # how long profiling this device took
    started_unix_s: float = 0.0  # wall clock when it began (0: not recorded)
    measured_with: list[str] = field(default_factory=list)  # this host's stages running a load meanwhile
    # Its compute times are process CPU time per thread, not wall time (a run's profile of a host whose stages
    # share too few cores: runtime/run/run_profile.py), so a plan shares the host's cores on top of them.
    cpu_time: bool = False
    # Where each part came from when not measured by `hetero profile` (a run: "run", "run, scaled"; see
    # hetero.runtime.run.run_profile); a part absent here was measured as the profile's origin says.
    sources: dict[str, str] = field(default_factory=dict)
    # v4, for weight streaming (planner.offload; None: not measured): the GB/s at which one decoder layer's
    # frozen weights reach the device as the runtime's WeightStreamer copies them (pinned, side stream on CUDA;
    # a copy into fresh tensors on CPU), and the host's available RAM (MemAvailable) when measured.
    host_link_gbs: float | None = None
    host_ram_gb: float | None = None
    # v5, for compressed hand-offs (planner.compression): per scheme, the seconds runtime/wire/compress.py takes to
    # encode, and to decode, one hand-off on this device at its compute dtype; x = values (empty: not measured).
    codec_encode: dict[str, LinearFit] = field(default_factory=dict)
    codec_decode: dict[str, LinearFit] = field(default_factory=dict)


@dataclass(frozen=True)
class LinkProfile:
    """Measured path between two hosts (a == b: between two devices of one host)."""

    a: str
    b: str
    bandwidth_gbps: float
    latency_us: float
    samples: list[list[float]] = field(default_factory=list)  # [bytes, one-way seconds]
    method: str = "zmq ping-pong"

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8

    def transfer_s(self, num_bytes: float) -> float:
        """One-way seconds for ``num_bytes``: latency plus bytes over bandwidth."""
        return self.latency_us * 1e-6 + num_bytes / self.bytes_per_s


@dataclass(frozen=True)
class Profile:
    fleet: str
    fleet_hash: str
    model: str
    model_hash: str
    devices: list[DeviceProfile]
    links: list[LinkProfile] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    created: str = ""
    hetero_version: str = __version__
    schema_version: int = PROFILE_SCHEMA_VERSION
    origin: str = ""  # "" : `hetero profile`; a run's profile: "run <dir>, step N" (what plans cite)
    # v3: per host whose CPU stages had more threads than it has cores, the cores they got in the run
    # (runtime/run/run_profile.py: the replay of the run's own work that matches its step time).
    host_cores: dict[str, float] = field(default_factory=dict)

    def device(self, name: str) -> DeviceProfile | None:
        return next((d for d in self.devices if d.device == name), None)

    def link(self, host_a: str, host_b: str) -> LinkProfile | None:
        return next((lk for lk in self.links if {lk.a, lk.b} == {host_a, host_b}), None)

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON (creating parent directories)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(to_dict(self), indent=1))

    @classmethod
    def from_dict(cls, data: Any, where: str = "profile") -> Profile:
        data = _upgraded(data)
        check_schema_version(data, where=where, what="profile", version=PROFILE_SCHEMA_VERSION,
                             error=ProfileError, fix=_REPROFILE)
        return from_dict(cls, data, where, ProfileError)

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read and validate a profile file (or a run directory's profile.json); every defect is one line."""
        p = Path(path)
        if p.is_dir():
            if not (p / "profile.json").is_file():
                raise ProfileError(f"{p}: a directory without profile.json: give a `hetero profile` file or the "
                                   "directory of a `hetero run` (it writes profile.json at each checkpoint and at the end)")
            p = p / "profile.json"
        data: Any = None
        errors: list[ProfileError] = []
        for version in reversed(READABLE_VERSIONS):  # the error to show is the current version's
            try:
                data = read_versioned_json(p, what="profile", version=version, error=ProfileError, fix=_REPROFILE,
                                           missing_fix="run `hetero profile hardware=... model=...`")
                break
            except ProfileError as exc:
                errors.append(exc)
        if data is None:
            raise errors[0]
        return cls.from_dict(data, str(p))


def load_merged(paths: str) -> Profile:
    """The profile a plan's ``cost_sources["profile"]`` names: one path, or several joined by " + ", merged."""
    return merge_profiles([Profile.load(p) for p in paths.split(" + ") if p])


# What a run's profile said in a device's sources where its times were CPU time, before ``cpu_time`` said it.
SHARED_CORES_NOTE = " (CPU time: the host has fewer cores than its stages' threads)"


def _upgraded(data: Any) -> Any:
    """An older profile as the current version: the fields each version added have defaults, so only the version
    number changes; a device from before ``cpu_time`` has it from its sources' note."""
    if isinstance(data, dict) and data.get("schema_version") in READABLE_VERSIONS[:-1]:
        data = {**data, "schema_version": PROFILE_SCHEMA_VERSION}
    if isinstance(data, dict) and isinstance(data.get("devices"), list):
        data = {**data, "devices": [_with_cpu_time(d) for d in data["devices"]]}
    return data


def _with_cpu_time(device: Any) -> Any:
    if not isinstance(device, dict) or "cpu_time" in device or not isinstance(device.get("sources"), dict):
        return device
    said = any(isinstance(v, str) and SHARED_CORES_NOTE in v for v in device["sources"].values())
    return {**device, "cpu_time": said} if said else device


def typical(samples: list[float], trim: float = 0.1) -> float:
    """The trimmed mean (``trim`` cut at each end): what many repetitions cost on average, without outliers.

    Not the median: where stages share cores, a call either runs through or is preempted for a
    scheduler time slice, and the median picks one of the two modes, while a run pays their mix.
    """
    ordered = sorted(samples)
    cut = int(len(ordered) * trim)
    kept = ordered[cut : len(ordered) - cut] or ordered
    return sum(kept) / len(kept)


def source_of(profile: Profile, device: DeviceProfile, part: str) -> str:
    """What a plan's cost_sources says for one part of a device's profile: "profile" or "run <dir>, step N"."""
    return device.sources.get(part) or profile.origin or "profile"


def merge_profiles(profiles: list[Profile]) -> Profile:
    """One profile from several of the same fleet and model: per device, a run's measurements win over a
    `hetero profile` file's (the run is newer and measured the real program: whole stages, as scheduled,
    beside their neighbours), the newest run first; what the winner lacks (a layer kind, the receive
    cost, a link) comes from the others, each part labelled with where it came from."""
    if len(profiles) == 1:
        return profiles[0]
    newest = sorted(profiles, key=lambda p: p.created, reverse=True)
    ranked = [p for p in newest if p.origin.startswith("run")] + [p for p in newest if not p.origin.startswith("run")]
    head = ranked[0]
    devices: list[DeviceProfile] = []
    notes = list(head.notes)
    for name in dict.fromkeys(d.device for p in ranked for d in p.devices):
        holders = [(p, d) for p in ranked if (d := p.device(name)) is not None]
        devices.append(_merge_device(holders))
        winner = holders[0][0]
        if len(holders) > 1:
            notes.append(f"{name}: {winner.origin or 'the profile file'} wins over "
                         f"{', '.join(p.origin or 'the profile file' for p, _ in holders[1:])} "
                         f"({'the run measured the real program, and is newer' if winner.origin else 'the newer'})")
    links = list(head.links)
    for p in ranked[1:]:
        links += [lk for lk in p.links if not any({x.a, x.b} == {lk.a, lk.b} for x in links)]
    host_cores = {h: c for p in reversed(ranked) for h, c in p.host_cores.items()}  # the winner's last: it stays
    return replace(head, devices=devices, links=links, notes=notes, host_cores=host_cores,
                   origin=" + ".join(p.origin or "profile" for p in ranked))


def _merge_device(holders: list[tuple[Profile, DeviceProfile]]) -> DeviceProfile:
    """The first holder's device profile, its missing parts filled from the next holders (labelled)."""
    (top, first), rest = holders[0], holders[1:]
    layers = dict(first.layers)
    sources = {part: source_of(top, first, part) for part in [*first.layers, *_OTHER_PARTS]}
    fill: dict[str, Any] = {}
    for prof, dev in rest:
        for kind, layer in dev.layers.items():
            if kind not in layers and (dev.dtype, dev.quantization) == (first.dtype, first.quantization):
                layers[kind] = layer
                sources[kind] = source_of(prof, dev, kind)
        for part in _OTHER_PARTS:
            if getattr(first, part) in (None, {}) and part not in fill and getattr(dev, part) not in (None, {}):
                fill[part] = getattr(dev, part)
                sources[part] = source_of(prof, dev, part)
    return replace(first, layers=layers, sources=sources, **fill)


_OTHER_PARTS = ("optimizer", "message_send", "message_recv", "host_link_gbs", "host_ram_gb", "codec_encode",
                "codec_decode")


def fleet_hash(cluster: ClusterSpec) -> str:
    """What makes measurements transferable: each device's name, host, type, backend, threads, memory."""
    payload = [
        (d.name, d.host, d.type, d.backend, d.index, d.threads, d.memory_gb) for d in cluster.devices
    ]
    hosts = [(h.name, h.address) for h in cluster.hosts]
    return _hash({"devices": payload, "hosts": hosts})


def model_hash(model: ModelSpec) -> str:
    """What changes a layer's cost: architecture, dtype, quantization, LoRA rank/targets, sequence length, and the
    kernels where they are not the default (the attention) or the model has experts (how they run: a profile of the
    per-expert loop, from before grouped experts, is not one of grouped experts)."""
    payload: dict[str, Any] = {
        "architecture": model.architecture,
        "dtype": model.dtype,
        "quantization": model.quantization,
        "lora": [model.lora.r, sorted(model.lora.target_modules)],
        "seq_len": model.seq_len,
    }
    if model.attn_implementation != "auto":
        payload["attention"] = model.attn_implementation
    fam = FAMILIES.get(model.model_type)
    if fam is not None and fam.experts is not None:
        payload["experts"] = model.experts_implementation
    return _hash(payload)


def _hash(payload: Any) -> str:
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def check_profile(profile: Profile, cluster: ClusterSpec, model: ModelSpec, where: str = "profile",
                  rerun: str | None = None) -> None:
    """Refuse a profile measured on another fleet or for another model (one line, what to do).

    ``rerun`` is the `hetero profile` command to suggest (with the user's own overrides); by default one
    naming only the fleet and the model.
    """
    rerun = rerun or f"hetero profile hardware={cluster.name} model={model.name}"
    if profile.origin.startswith("run"):  # a run directory: another run, not a profile, is the fix
        if profile.fleet_hash != fleet_hash(cluster) or profile.model_hash != model_hash(model):
            what = ("another fleet" if profile.fleet_hash != fleet_hash(cluster)
                    else "another model (architecture, dtype, quantization, LoRA, seq_len or kernels)")
            raise ProfileError(f"{where} is a run of {what} (fleet '{profile.fleet}', model '{profile.model}') than "
                               f"this compile's (fleet '{cluster.name}', model '{model.name}'): give the directory "
                               "of a run of this fleet and model, or leave out profile=")
        return
    if profile.fleet_hash != fleet_hash(cluster):
        what = "another fleet" if profile.fleet != cluster.name else "this fleet with other devices/threads"
        raise ProfileError(
            f"{where} was measured on {what} ('{profile.fleet}', {len(profile.devices)} devices) but this "
            f"compile uses fleet '{cluster.name}' ({len(cluster.devices)} devices): re-run `{rerun}`"
        )
    if profile.model_hash != model_hash(model):
        raise ProfileError(
            f"{where} was measured for model '{profile.model}' with another architecture, dtype, quantization, "
            f"LoRA, seq_len or kernels than '{model.name}' here: re-run `{rerun}`"
        )


def now_iso() -> str:
    """UTC timestamp, to the second, as profiles and plans record it."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
