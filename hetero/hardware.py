"""Device datasheets (hardware_specs/*.yaml) and the fleet builder (conf/hardware/*.yaml -> ClusterSpec)."""

from __future__ import annotations

import difflib
import importlib.resources
import math
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from hetero.cores import usable_cores
from hetero.errors import ConfigError, UnknownDeviceError
from hetero.protocol import BASE_PORT
from hetero.safe_yaml import load_yaml
from hetero.serde import from_dict, short_repr
from hetero.specs import ClusterSpec, DeviceSpec, DeviceType, HostSpec, LinkSpec, SshSpec, check_ssh

# Datasheet numbers a fleet file may override per device (a card that is clocked, cut or shared
# differently from its datasheet, e.g. a Strix Halo with a smaller GPU carve-out).
OVERRIDABLE = (
    "memory_gb",
    "memory_bandwidth_gbs",
    "tflops_fp32",
    "tflops_fp16",
    "tflops_bf16",
    "bf16",
    "nf4",
)
_DEVICE_KEYS = frozenset({"type", "count", "name", "index", "threads", "host_link_gbs", "pcie", *OVERRIDABLE})
_HOST_KEYS = frozenset({"name", "address", "port", "devices", "ssh", "cores", "ram_gb"})
# PCIe GB/s one way per lane, theoretical (PCI-SIG: 2.5/5 GT/s with 8b/10b for gen 1/2, 8/16/32/64 GT/s with
# 128b/130b from gen 3): a fleet file's ``pcie: {gen, lanes}`` is lanes x this (x1 risers: 1/16 of x16).
PCIE_GBS_PER_LANE = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
_SSH_KEYS = frozenset({"target", "port", "identity", "options", "python", "plan_dir"})
_LINK_KEYS = frozenset({"a", "b", "bandwidth_gbps", "latency_us"})
_CLUSTER_KEYS = frozenset(
    {
        "name",
        "hosts",
        "links",
        "default_link",
        "intra_host_bandwidth_gbps",
        "intra_host_latency_us",
        "num_devices",
    }
)


# More devices than any home lab (or the planner's search) makes sense for; a typo like count: 1e8 would
# otherwise build that many devices before anything could complain.
MAX_DEVICES = 1024
# Datasheet numbers, and whether one may be zero (tflops_bf16 is, where bf16 is unsupported).
_DATASHEET_NUMBERS = {"memory_gb": False, "memory_bandwidth_gbs": False, "tflops_fp32": False,
                      "tflops_fp16": False, "tflops_bf16": True}


def _device_type_from(path: Path, text: str) -> DeviceType:
    data = load_yaml(path, text)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of DeviceType fields")
    if data.get("name", path.stem) != path.stem:
        raise ConfigError(f"{path}: name {short_repr(data.get('name'))} must equal the file name '{path.stem}'")
    data = {"name": path.stem, **data}
    device_type = from_dict(DeviceType, data, str(path), ConfigError)
    for key, zero_ok in _DATASHEET_NUMBERS.items():
        _number(getattr(device_type, key), f"{path}: {key}", positive=not zero_ok, minimum=0)
    return device_type


def load_device_types(extra_dirs: Iterable[Path | str] = ()) -> dict[str, DeviceType]:
    """All device types: the bundled hardware_specs/ plus ``extra_dirs`` (later dirs win on a name clash)."""
    types: dict[str, DeviceType] = {}
    bundled = importlib.resources.files("hetero.hardware_specs")
    for entry in sorted(bundled.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            dt = _device_type_from(Path("hardware_specs") / entry.name, entry.read_text())
            types[dt.name] = dt
    for directory in extra_dirs:
        for path in sorted(Path(directory).expanduser().glob("*.yaml")):
            try:
                text = path.read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{path}: cannot read this datasheet ({exc})") from None
            dt = _device_type_from(path, text)
            types[dt.name] = dt
    return types


def _unknown_type_message(type_name: str, where: str, known: Iterable[str]) -> str:
    """The closest known types (a typo?), and how to add a card that is not bundled; one line, however many types."""
    known = sorted(known)
    name = short_repr(type_name) if len(str(type_name)) > 40 else f"'{type_name}'"
    close = difflib.get_close_matches(str(type_name), known, n=1, cutoff=0.6)
    typo = f" (a typo of {close[0]}?)" if close else ""
    nearest = difflib.get_close_matches(str(type_name), known, n=4, cutoff=0.0)
    model = importlib.resources.files("hetero.hardware_specs") / f"{close[0] if close else 'rtx3090'}.yaml"
    return (f"unknown GPU type {name} in {where}{typo}; closest of the {len(known)} known: {', '.join(nearest)}; for "
            f"another card copy {model} to hardware_specs/<type>.yaml beside your fleet (-cd DIR) and edit its figures")


def _check_keys(entry: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    unknown = sorted(str(k) for k in entry if k not in allowed)  # YAML keys may be numbers, too
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {short_repr(unknown)}; allowed: {', '.join(sorted(allowed))}")


def _number(value: Any, where: str, *, integer: bool = False, positive: bool = True,
            minimum: float | None = None, maximum: float | None = None) -> Any:
    """``value`` if it is a finite number (an int when ``integer``) in range, else a ConfigError saying so."""
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not ok:
        raise ConfigError(f"{where} must be {kind}, got {short_repr(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where} must be a finite number, got {short_repr(value)}")
    if abs(value) > 1e300:  # an int this large would overflow float()
        raise ConfigError(f"{where} is out of range, got {short_repr(value)}")
    if positive and value <= 0:
        raise ConfigError(f"{where} must be positive, got {short_repr(value)}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{where} must be at least {minimum:g}, got {short_repr(value)}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{where} must be at most {maximum:g}, got {short_repr(value)}")
    return value


def _device_name_stem(host: str, type_name: str) -> str:
    # "localhost.cpu0", but "desktop.rtx5090_0": a digit right after a digit would be unreadable.
    sep = "_" if type_name[-1:].isdigit() else ""
    return f"{host}.{type_name}{sep}"


def _device_entry(entry: Any, at: str, types: Mapping[str, DeviceType]) -> tuple[Mapping[str, Any], DeviceType]:
    """One ``devices:`` entry as a checked mapping (``- rtx3090`` is short for ``{type: rtx3090}``) and its type."""
    if isinstance(entry, str):
        entry = {"type": entry}
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{at}: expected a mapping like {{type: rtx3090, count: 1}}")
    _check_keys(entry, _DEVICE_KEYS, at)
    if "type" not in entry:
        raise ConfigError(f"{at}: missing 'type' (a file name in hardware_specs/, e.g. rtx3090)")
    type_name = entry["type"]
    if not isinstance(type_name, str):
        raise ConfigError(f"{at}.type must be a device type's name (a file name in hardware_specs/, "
                          f"e.g. rtx3090), got {short_repr(type_name)}")
    if type_name not in types:
        raise UnknownDeviceError(_unknown_type_message(type_name, at, types))
    return entry, types[type_name]


def _entry_count(entry: Mapping[str, Any], at: str, room: int) -> int:
    """How many devices the entry declares (``count``), within ``room``; ``name`` only for a single one."""
    count = _number(entry.get("count", 1), f"{at}.count", integer=True)
    if count > room:
        raise ConfigError(f"{at}.count {count} makes the fleet larger than hetero plans for ({MAX_DEVICES} "
                          "devices); lower the count")
    if "name" in entry and count != 1:
        raise ConfigError(f"{at}: 'name' names one device; drop it or set count: 1")
    if "name" in entry and (not isinstance(entry["name"], str) or not entry["name"]):
        raise ConfigError(f"{at}.name must be a device name (a string), got {short_repr(entry['name'])}")
    return int(count)


def _datasheet_values(entry: Mapping[str, Any], dt: DeviceType, at: str) -> tuple[dict[str, Any], list[str]]:
    """The overridable datasheet numbers with the entry's overrides applied, and a note per changed one."""
    overrides: list[str] = []
    values = {k: getattr(dt, k) for k in OVERRIDABLE}
    for key in OVERRIDABLE:
        if key not in entry:
            continue
        new = entry[key]
        if key in ("bf16", "nf4"):
            if not isinstance(new, bool):
                raise ConfigError(f"{at}.{key} must be true or false, got {new!r}")
        else:
            new = float(_number(new, f"{at}.{key}", positive=key != "tflops_bf16", minimum=0))
        if new != values[key]:
            overrides.append(f"{key}={new:g} (datasheet {values[key]:g})" if key not in ("bf16", "nf4")
                             else f"{key}={new}")
        values[key] = new
    return values, overrides


def _host_link(entry: Mapping[str, Any], dt: DeviceType, at: str) -> tuple[float | None, list[str]]:
    """The device's host-to-device GB/s: ``host_link_gbs:``, else ``pcie: {gen, lanes}``, else the datasheet
    (None where none says); and an override note when the fleet file changed it."""
    if "host_link_gbs" in entry and "pcie" in entry:
        raise ConfigError(f"{at}: give host_link_gbs or pcie, not both")
    if "host_link_gbs" in entry:
        value = float(_number(entry["host_link_gbs"], f"{at}.host_link_gbs"))
    elif "pcie" in entry:
        pcie = entry["pcie"]
        if not isinstance(pcie, Mapping) or set(pcie) - {"gen", "lanes"} or "gen" not in pcie:
            raise ConfigError(f"{at}.pcie: expected {{gen: 1..6, lanes: 1..16}}, got {short_repr(pcie)}")
        gen = int(_number(pcie["gen"], f"{at}.pcie.gen", integer=True, minimum=1, maximum=6))
        lanes = int(_number(pcie.get("lanes", 16), f"{at}.pcie.lanes", integer=True, minimum=1, maximum=16))
        value = PCIE_GBS_PER_LANE[gen] * lanes
    else:
        return (dt.host_link_gbs or None), []
    return value, ([f"host_link_gbs={value:g} (datasheet {dt.host_link_gbs:g})"] if value != dt.host_link_gbs else [])


def _threads_and_index(entry: Mapping[str, Any], at: str) -> tuple[int | None, int | None]:
    """The entry's ``threads`` (cpu stages) and explicit torch ``index`` of its first device, when given."""
    threads = entry.get("threads")
    if threads is not None:
        _number(threads, f"{at}.threads", integer=True, maximum=4096)
    first_index = None
    if "index" in entry:
        first_index = _number(entry["index"], f"{at}.index", integer=True, positive=False, minimum=0,
                              maximum=MAX_DEVICES)
    return threads, first_index


def _device_spec(name: str, host: str, type_name: str, dt: DeviceType, index: int, values: Mapping[str, Any],
                 threads: int | None, overrides: list[str], host_link_gbs: float | None) -> DeviceSpec:
    """One device from its datasheet type and the (overridden) numbers of its entry."""
    return DeviceSpec(
        name=name,
        host=host,
        type=type_name,
        index=int(index),
        backend=dt.backend,
        display_name=dt.display_name,
        memory_gb=float(values["memory_gb"]),
        memory_bandwidth_gbs=float(values["memory_bandwidth_gbs"]),
        tflops={
            "float32": float(values["tflops_fp32"]),
            "float16": float(values["tflops_fp16"]),
            "bfloat16": float(values["tflops_bf16"]) if values["bf16"] else 0.0,
        },
        bf16=bool(values["bf16"]),
        nf4=bool(values["nf4"]),
        threads=threads,
        host_link_gbs=host_link_gbs,
        overrides=list(overrides),
    )


def _expand_devices(
    host: str, entries: list[Any], types: Mapping[str, DeviceType], where: str, room: int
) -> list[DeviceSpec]:
    """The devices of one host's entries; more than ``room`` devices (the fleet's remaining allowance) is refused."""
    devices: list[DeviceSpec] = []
    per_type: dict[str, int] = {}
    per_backend: dict[str, int] = {}
    for j, raw in enumerate(entries):
        at = f"{where}.devices[{j}]"
        entry, dt = _device_entry(raw, at, types)
        type_name = entry["type"]
        count = _entry_count(entry, at, room - len(devices))
        values, overrides = _datasheet_values(entry, dt, at)
        threads, first_index = _threads_and_index(entry, at)
        link, link_note = _host_link(entry, dt, at)
        for k in range(count):
            ordinal = per_type.get(type_name, 0)
            per_type[type_name] = ordinal + 1
            backend_index = per_backend.get(dt.backend, 0)
            per_backend[dt.backend] = backend_index + 1
            name = str(entry.get("name") or f"{_device_name_stem(host, type_name)}{ordinal}")
            index = backend_index if first_index is None else first_index + k
            devices.append(_device_spec(name, host, type_name, dt, index, values, threads, overrides + link_note, link))
    return devices


def _ssh_spec(entry: Any, where: str) -> SshSpec:
    """A host's ``ssh:``: ``user@host``, or a mapping {target, port, identity, options, python, plan_dir}."""
    if isinstance(entry, str):
        entry = {"target": entry}
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where} must be [user@]host or a mapping like {{target: me@strix, python: "
                          f"~/venv/bin/python}}, got {short_repr(entry)}")
    _check_keys(entry, _SSH_KEYS, where)
    if "target" not in entry:
        raise ConfigError(f"{where}: missing 'target' ([user@]host, as you would type it after `ssh`)")
    for key in ("target", "identity", "python", "plan_dir"):
        value = entry.get(key)
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{where}.{key} must be a string, got {short_repr(value)}")
    options = entry.get("options", [])
    if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
        raise ConfigError(f"{where}.options must be a list of KEY=VALUE strings (ssh -o), got {short_repr(options)}")
    port = entry.get("port")
    if port is not None:
        port = int(_number(port, f"{where}.port", integer=True, minimum=1, maximum=65535))
    spec = SshSpec(target=entry["target"], port=port, identity=entry.get("identity"), options=list(options),
                   python="python3" if entry.get("python") is None else entry["python"], plan_dir=entry.get("plan_dir"))
    check_ssh(spec, where, ConfigError)
    return spec


def _build_links(cfg: Mapping[str, Any], host_names: list[str]) -> list[LinkSpec]:
    links: list[LinkSpec] = []
    seen: set[frozenset[str]] = set()
    for i, entry in enumerate(cfg.get("links") or []):
        at = f"hardware.links[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{at}: expected a mapping like {{a: box1, b: box2, bandwidth_gbps: 10}}")
        _check_keys(entry, _LINK_KEYS, at)
        for end in ("a", "b"):
            if entry.get(end) not in host_names:
                raise ConfigError(
                    f"{at}.{end}: {short_repr(entry.get(end))} is not a host; hosts: {', '.join(host_names)}"
                )
        if entry["a"] == entry["b"]:
            raise ConfigError(f"{at}: a link joins two different hosts, got '{entry['a']}' twice")
        pair = frozenset((entry["a"], entry["b"]))
        if pair in seen:
            raise ConfigError(f"{at}: a second link between '{entry['a']}' and '{entry['b']}'")
        seen.add(pair)
        if "bandwidth_gbps" not in entry:
            raise ConfigError(f"{at}: missing bandwidth_gbps (e.g. 10 for 10 GbE)")
        links.append(
            LinkSpec(
                a=entry["a"],
                b=entry["b"],
                bandwidth_gbps=float(_number(entry["bandwidth_gbps"], f"{at}.bandwidth_gbps")),
                latency_us=float(_number(entry.get("latency_us", 100.0), f"{at}.latency_us", positive=False)),
            )
        )
    default = cfg.get("default_link")
    for i, a in enumerate(host_names):
        for b in host_names[i + 1 :]:
            if frozenset((a, b)) in seen:
                continue
            if not default:
                raise ConfigError(
                    f"hardware: no link between hosts '{a}' and '{b}'; add one to hardware.links "
                    "or set hardware.default_link: {bandwidth_gbps: 1, latency_us: 200}"
                )
            if not isinstance(default, Mapping) or set(default) - {"bandwidth_gbps", "latency_us"}:
                raise ConfigError(
                    "hardware.default_link: expected {bandwidth_gbps: <number>, latency_us: <number>}"
                )
            links.append(
                LinkSpec(
                    a=a,
                    b=b,
                    bandwidth_gbps=float(
                        _number(default.get("bandwidth_gbps"), "hardware.default_link.bandwidth_gbps")
                    ),
                    latency_us=float(
                        _number(
                            default.get("latency_us", 100.0),
                            "hardware.default_link.latency_us",
                            positive=False,
                        )
                    ),
                )
            )
    return links


def _host_spec(entry: Any, at: str, types: Mapping[str, DeviceType], earlier: list[HostSpec]) -> HostSpec:
    """One ``hosts:`` entry: name, address, port and its devices (``earlier``: the hosts declared before it)."""
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{at}: expected a mapping with name, address and devices")
    _check_keys(entry, _HOST_KEYS, at)
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{at}.name: every host needs a name (a string)")
    if any(h.name == name for h in earlier):
        raise ConfigError(f"{at}.name: host '{name}' is declared twice")
    devices_cfg = entry.get("devices")
    if not isinstance(devices_cfg, list) or not devices_cfg:
        raise ConfigError(f"{at}.devices: host '{name}' lists no devices")
    address = entry.get("address", "127.0.0.1")
    if not isinstance(address, str) or not address:
        raise ConfigError(f"{at}.address must be a host name or IP address, got {short_repr(address)}")
    port = _number(entry.get("port", BASE_PORT), f"{at}.port", integer=True, minimum=2, maximum=65535)
    devices = _expand_devices(name, list(devices_cfg), types, at, MAX_DEVICES - sum(len(h.devices) for h in earlier))
    if port + len(devices) - 1 > 65535:  # stage k on this host listens on port + k (the coordinator on port - 1)
        raise ConfigError(f"{at}.port {port} leaves no port for each of its {len(devices)} devices: "
                          f"at most {65536 - len(devices)}")
    ssh = _ssh_spec(entry["ssh"], f"{at}.ssh") if entry.get("ssh") is not None else None
    cores = entry.get("cores")
    if cores is not None:
        cores = int(_number(cores, f"{at}.cores", integer=True, maximum=4096))
    ram_gb = entry.get("ram_gb")
    if ram_gb is not None:
        ram_gb = float(_number(ram_gb, f"{at}.ram_gb", maximum=1e6))
    else:  # nothing streams from a host without ram_gb: a datasheet link stays out of the spec (and the plan hash)
        devices = [d if any(o.startswith("host_link_gbs") for o in d.overrides) else replace(d, host_link_gbs=None)
                   for d in devices]
    return HostSpec(name=name, address=address, port=int(port), devices=devices, ssh=ssh, cores=cores,
                    ram_gb=ram_gb)


def _share_cpu_cores(host: HostSpec) -> HostSpec:
    """CPU stages share their host's cores: split them so stage processes do not oversubscribe. The host's
    ``cores`` are the fleet file's, else the cores this process may use (hetero/cores.py: a container's CPU quota
    or affinity mask, not the machine's count) where a CPU stage's threads default to a share of them."""
    cpus = [d for d in host.devices if d.backend == "cpu"]
    if not cpus:
        return host
    here = usable_cores()
    cores = host.cores if host.cores is not None else (here if any(d.threads is None for d in cpus) else None)
    devices = []
    for d in host.devices:
        if d.backend == "cpu":
            threads = d.threads if d.threads is not None else max(1, (cores or here) // len(cpus))
            # A CPU stage computes with its own threads only: its datasheet TFLOPS are per core.
            per_core = not any(o.startswith("tflops") for o in d.overrides)
            d = replace(d, threads=threads, tflops={k: v * threads for k, v in d.tflops.items()} if per_core else d.tflops)
        devices.append(d)
    return replace(host, devices=devices, cores=cores)


def _intra_host_path(cfg_hardware: Mapping[str, Any]) -> dict[str, float]:
    """The fleet file's intra-host bandwidth and latency, where it sets them (else ClusterSpec's defaults)."""
    path: dict[str, float] = {}
    if "intra_host_bandwidth_gbps" in cfg_hardware:
        path["intra_host_bandwidth_gbps"] = float(
            _number(cfg_hardware["intra_host_bandwidth_gbps"], "hardware.intra_host_bandwidth_gbps")
        )
    if "intra_host_latency_us" in cfg_hardware:
        path["intra_host_latency_us"] = float(
            _number(cfg_hardware["intra_host_latency_us"], "hardware.intra_host_latency_us", positive=False)
        )
    return path


def build_cluster(
    cfg_hardware: Mapping[str, Any], device_types: Mapping[str, DeviceType] | None = None
) -> ClusterSpec:
    """Build the fleet from a ``hardware`` config: expand counts, apply overrides, check links."""
    if not isinstance(cfg_hardware, Mapping):
        raise ConfigError("hardware: expected a mapping with 'hosts' (see docs/fleet.md)")
    types = dict(device_types) if device_types is not None else load_device_types()
    _check_keys(cfg_hardware, _CLUSTER_KEYS, "hardware")
    hosts_cfg = cfg_hardware.get("hosts")
    if not isinstance(hosts_cfg, list) or not hosts_cfg:
        raise ConfigError("hardware.hosts: declare at least one host with devices (see docs/fleet.md)")
    hosts: list[HostSpec] = []
    for i, entry in enumerate(hosts_cfg):
        hosts.append(_host_spec(entry, f"hardware.hosts[{i}]", types, hosts))
    if len(hosts) > 1:  # 127.0.0.1 is the default for one host; several must say where the others reach them
        unset = [(i, h.name) for i, (h, entry) in enumerate(zip(hosts, hosts_cfg, strict=True)) if "address" not in entry]
        if unset:
            i, name = unset[0]
            raise ConfigError(f"hardware.hosts[{i}] ('{name}'): a fleet of {len(hosts)} hosts needs every host's "
                              f"address (where the others reach it, e.g. address: 192.168.1.20); "
                              f"{len(unset)} host(s) have none ({', '.join(n for _, n in unset)}). Hosts on one "
                              "machine for a test: address: 127.0.0.1")
    names = [d.name for h in hosts for d in h.devices]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"hardware: device name(s) {dupes} used twice; give each device a unique 'name'")
    hosts = [_share_cpu_cores(h) for h in hosts]
    links = _build_links(cfg_hardware, [h.name for h in hosts])
    fleet_name = cfg_hardware.get("name", "fleet")
    if not isinstance(fleet_name, str) or not fleet_name:
        raise ConfigError(f"hardware.name must be the fleet's name (a string), got {short_repr(fleet_name)}")
    return ClusterSpec(name=fleet_name, hosts=hosts, links=links, **_intra_host_path(cfg_hardware))
