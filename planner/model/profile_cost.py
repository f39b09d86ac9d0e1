"""A cost model from a measured profile (`hetero profile`), with the roofline for what it lacks.

Same interface as ``RooflineCostModel``. Per (device, layer kind) it uses the measured linear fit
``a + b * tokens``; per host pair the measured latency and bandwidth; weights and LoRA state stay
analytic (they are exact byte counts), activations come from the measured bytes per token. Every
number it hands out is recorded in ``sources`` ("profile", "run RUN_DIR, step N" for a run's
profile, or "roofline (why)"), so the plan can say which numbers came from where.
"""

from __future__ import annotations

from collections.abc import Callable

from hetero.graph import LayerGraph
from hetero.plan import StagePlan
from hetero.planner.model.cost_model import CostModel, NodeMemory, RooflineCostModel, compute_dtype
from hetero.profile import LayerProfile, Profile, check_profile, source_of
from hetero.specs import ClusterSpec, DeviceSpec, HostSpec, ModelSpec


class ProfileCostModel:
    """Measured per-device layer times and per-link transfers; roofline fallback, with provenance."""

    def __init__(
        self,
        profile: Profile,
        fallback: CostModel | None = None,
        *,
        path: str = "",
        cluster: ClusterSpec | None = None,
        model: ModelSpec | None = None,
        rerun: str | None = None,
    ) -> None:
        if cluster is not None and model is not None:
            check_profile(profile, cluster, model, path or "profile", rerun)
        self.profile = profile
        self.fallback: CostModel = fallback or RooflineCostModel()
        self.path = path
        self.sources: dict[str, str] = {}  # "time cpu0/decoder" -> "profile" | "roofline (why)"

    def _source(self, device: DeviceSpec, part: str) -> str:
        """Where a measured part of a device came from: "profile" or "run RUN_DIR, step N"."""
        dev = self.profile.device(device.name)
        return "profile" if dev is None else source_of(self.profile, dev, part)

    def _layer(self, device: DeviceSpec, kind: str, model: ModelSpec) -> tuple[LayerProfile | None, str]:
        dev = self.profile.device(device.name)
        if dev is None:
            return None, "device not in the profile"
        if dev.dtype != compute_dtype(device, model):
            return None, f"profiled in {dev.dtype}, runs in {compute_dtype(device, model)}"
        if dev.quantization != device.quantization(model.quantization):
            return None, f"profiled with quantization {dev.quantization}"
        layer = dev.layers.get(kind)
        if layer is None:
            return None, f"no {kind} layer measured"
        return layer, ""

    def node_time_s(
        self, graph: LayerGraph, model: ModelSpec, node: int, device: DeviceSpec, tokens: int
    ) -> tuple[float, float]:
        """(forward, backward) seconds: the device's measured fit for this layer kind."""
        kind = graph.nodes[node].kind
        layer, why = self._layer(device, kind, model)
        key = f"time {device.name}/{kind}"
        if layer is None:
            self.sources[key] = f"roofline ({why})"
            return self.fallback.node_time_s(graph, model, node, device, tokens)
        self.sources[key] = self._source(device, kind)
        return layer.fwd.at(tokens), layer.bwd.at(tokens)

    def node_memory(
        self, graph: LayerGraph, model: ModelSpec, node: int, device: DeviceSpec, tokens: int
    ) -> NodeMemory:
        """Analytic weights and LoRA state; measured saved activations per token where profiled."""
        base = self.fallback.node_memory(graph, model, node, device, tokens)
        kind = graph.nodes[node].kind
        layer, why = self._layer(device, kind, model)
        key = f"activations {device.name}/{kind}"
        if layer is None or layer.activation_bytes_per_token <= 0:
            self.sources[key] = f"roofline ({why or 'not measured'})"
            return base
        self.sources[key] = f"profile ({layer.memory_method})"
        rec = layer.recompute_bytes_per_token
        return NodeMemory(base.weights, base.lora, layer.activation_bytes_per_token * tokens,
                          base.recompute_per_mb if rec is None or base.recompute_per_mb is None else rec * tokens)

    def transfer_time_s(self, cluster: ClusterSpec, host_a: str, host_b: str, num_bytes: float) -> float:
        """Measured latency + bytes / measured bandwidth between the two hosts, else the fleet file's link."""
        link = self.profile.link(host_a, host_b)
        key = f"link {min(host_a, host_b)}<->{max(host_a, host_b)}"
        if link is None or link.bandwidth_gbps <= 0:
            self.sources[key] = "fleet file (not measured)"
            return self.fallback.transfer_time_s(cluster, host_a, host_b, num_bytes)
        if link.method.startswith("run "):  # timed by a run: "run DIR, step N (...)"
            self.sources[key] = link.method
        else:
            self.sources[key] = ("profile" if "(from " not in link.method else f"profile ({link.method})") + (
                ", under CurveZMQ" if "security curve" in link.method else "")
        # A link measured in plaintext (a profile or run of security none or token) does not include the cipher a
        # curve plan adds: priced with the datasheet estimate on top. One whose method names no mode (profiles
        # before v5, runs) was measured in the mode compile chooses, curve between hosts: taken as it is.
        cipher = getattr(self.fallback, "cipher_s_per_byte", 0.0)
        if cipher and ("security none" in link.method or "security token" in link.method):
            self.sources[key] += " + CurveZMQ estimate (measured in plaintext)"
            return link.transfer_s(num_bytes) + num_bytes * cipher
        return link.transfer_s(num_bytes)

    def optimizer_step_s(self, device: DeviceSpec, model: ModelSpec, lora_params: int, lora_tensors: int) -> float:
        """The device's measured optimizer step (a + b * LoRA parameters), else the roofline's."""
        dev = self.profile.device(device.name)
        key = f"optimizer {device.name}"
        if dev is None or dev.optimizer is None:
            self.sources[key] = f"roofline ({'device not in the profile' if dev is None else 'not measured'})"
            return self.fallback.optimizer_step_s(device, model, lora_params, lora_tensors)
        self.sources[key] = self._source(device, "optimizer")
        # Linear, not clamped at 0: the planner splits it into a constant and per-node parts.
        return dev.optimizer.a_s + dev.optimizer.b_s_per_token * lora_params

    def message_s(self, device: DeviceSpec, num_bytes: float) -> tuple[float, float]:
        """The device's measured send and receive CPU time for a message of ``num_bytes`` (each direction
        from the roofline where not measured: a run measures its sends, not its receives)."""
        dev = self.profile.device(device.name)
        key = f"messages {device.name}"
        if dev is None or (dev.message_send is None and dev.message_recv is None):
            self.sources[key] = f"roofline ({'device not in the profile' if dev is None else 'not measured'})"
            return self.fallback.message_s(device, num_bytes)
        send, recv = self.fallback.message_s(device, num_bytes)
        parts = []
        if dev.message_send is not None:
            send = dev.message_send.at(int(num_bytes))
            parts.append(("send", self._source(device, "message_send")))
        if dev.message_recv is not None:
            recv = dev.message_recv.at(int(num_bytes))
            parts.append(("receive", self._source(device, "message_recv")))
        same = len(parts) == 2 and parts[0][1] == parts[1][1]
        self.sources[key] = parts[0][1] if same else "; ".join(f"{what}: {src}" for what, src in parts) + (
            "" if len(parts) == 2 else f"; {'receive' if parts[0][0] == 'send' else 'send'}: roofline (not measured)")
        return send, recv

    def codec_s(self, device: DeviceSpec, compression: str, values: float) -> tuple[float, float]:
        """The device's measured encode and decode of a ``compression`` hand-off of ``values`` values (a `hetero
        profile` times runtime/wire/compress.py there), else the roofline's."""
        dev = self.profile.device(device.name)
        if compression == "none" or values <= 0:
            return 0.0, 0.0
        key = f"codec {device.name}"
        encode, decode = (None, None) if dev is None else (dev.codec_encode.get(compression),
                                                         dev.codec_decode.get(compression))
        if encode is None or decode is None:
            self.sources[key] = f"roofline ({'device not in the profile' if dev is None else 'not measured'})"
            return self.fallback.codec_s(device, compression, values)
        self.sources[key] = self._source(device, "codec_encode")
        return max(0.0, encode.at(int(values))), max(0.0, decode.at(int(values)))

    def host_copy_bytes_per_s(self, device: DeviceSpec) -> float:
        """The rate the profile measured for the runtime's own streaming copy (no efficiency factor: it is what a
        copy reached), else the roofline's."""
        dev = self.profile.device(device.name)
        key = f"host link {device.name}"
        if dev is not None and dev.host_link_gbs:
            self.sources[key] = self._source(device, "host_link_gbs")
            return dev.host_link_gbs * 1e9
        self.sources[key] = "roofline (not measured)"
        return self.fallback.host_copy_bytes_per_s(device)

    def with_measured_hosts(self, cluster: ClusterSpec) -> ClusterSpec:
        """The fleet with what the profile measured of its hosts, the source of each noted: ``usable_cores`` as a
        run measured them (hosts whose CPU stages shared too few cores: docs/profiling.md), no ``cores`` where the
        profile's times of its CPU stages already include their waits for a core, and ``ram_gb`` lowered
        to the RAM the host had available when profiled (streamed weights must fit in what is there)."""
        from dataclasses import replace

        hosts = []
        for h in cluster.hosts:
            got = self.profile.host_cores.get(h.name)
            if h.cores and self._timed_sharing(h):
                self.sources[f"cores {h.name}"] = (
                    f"{self.profile.origin or 'profile'} (not shared again: its CPU stages were each timed while the "
                    f"host's others ran, so their times already include the waits for its {h.cores} cores)")
                h = replace(h, cores=None)
            elif got is not None and h.cores and 0 < got <= h.cores:
                self.sources[f"cores {h.name}"] = f"{self.profile.origin or 'profile'} ({got:.2f} of {h.cores} cores)"
                h = replace(h, usable_cores=float(got))
            measured = [d for d in self.profile.devices if d.host == h.name and d.host_ram_gb]
            if h.ram_gb is not None and measured:
                least = min(measured, key=lambda d: d.host_ram_gb or 0.0)
                available = float(least.host_ram_gb or 0.0)
                if available < h.ram_gb:
                    self.sources[f"ram_gb {h.name}"] = (f"{source_of(self.profile, least, 'host_ram_gb')} ({available:.1f}"
                                                        f" GB available when measured; the fleet file says {h.ram_gb:g})")
                    h = replace(h, ram_gb=round(available, 1))
            hosts.append(h)
        return replace(cluster, hosts=hosts)

    def _timed_sharing(self, host: HostSpec) -> bool:
        """Whether the host's CPU stages share too few cores and the profile timed every one of them in wall time
        while the others ran (`hetero profile`'s load): the simulator must not make them wait for a core again.
        Measured on bench_experts' qwen3_moe, 3 one-thread stages on 2 cores (docs/benchmarks.md, 2026-11-29): the
        processor sharing on top of those times predicted a step 1.3x too slow (measured / predicted 0.77)."""
        cpus = {d.name: d.threads or 1 for d in host.devices if d.backend == "cpu"}
        if not cpus or sum(cpus.values()) <= (host.cores or 0):
            return False
        return all(self._waited(name, host.cores or 0, lambda n: cpus.get(n, 0)) is not None for name in cpus)

    def _waited(self, name: str, cores: int, threads_of: Callable[[str], int]) -> int | None:
        """The threads device ``name`` was timed beside (its own included, each ``threads_of``) where its profile is
        wall time taken with more of them than ``cores``: its times include waits for a core. None where not."""
        t = self.profile.device(name)
        if t is None or t.cpu_time:
            return None
        threads = sum(threads_of(n) for n in dict.fromkeys([name, *t.measured_with]))
        return threads if threads > cores else None

    def _profiled_threads(self, name: str) -> int:
        t = self.profile.device(name)
        return 0 if t is None else t.threads or 1

    def loaded_lines(self, stages: list[StagePlan], busy: list[float]) -> list[str]:
        """The verdict's caveat per host whose CPU stages were all profiled by `hetero profile` beside the others
        running without pause, on fewer cores than the threads (``_waited``): in this plan fewer threads compute at a
        time (the stages idle in its bubbles, or some of the profiled devices are not used), so they wait less for
        a core and the prediction leans slow (docs/profiling.md). A run's own profile timed them at its own duty
        cycle: no caveat."""
        out = []
        for host in dict.fromkeys(s.host for s in stages if s.backend == "cpu"):
            ks = [k for k, s in enumerate(stages) if s.backend == "cpu" and s.host == host]
            timed = [self.profile.device(stages[k].device) for k in ks]
            cores = min((_cores_of(t.environment) for t in timed if t is not None), default=0)
            waited = [self._waited(stages[k].device, cores, self._profiled_threads) for k in ks]
            if (not cores or any(w is None for w in waited) or any(  # a run's profile: "run DIR, step N"
                    source_of(self.profile, t, "decoder").startswith("run ") for t in timed if t is not None)):
                continue
            profiled = max(w for w in waited if w is not None)
            computing = sum(min(1.0, busy[k] if k < len(busy) else 1.0) * (stages[k].threads or 1) for k in ks)
            if computing <= 0.95 * profiled:
                out.append(f"{host}'s CPU stages were profiled each while the host's other CPU stages ran without "
                           f"pause ({profiled} threads on {cores} cores), so their times include waits for a core; "
                           f"in this plan {computing:.1f} threads compute at a time on average and wait less: expect "
                           "the step faster than predicted (three one-thread stages on 2 cores ran at 0.73-0.96x "
                           "their prediction, docs/profiling.md).")
        return out

    def usable_memory_gb(self, device: DeviceSpec) -> float | None:
        """The device's measured free memory, when the profile has it."""
        dev = self.profile.device(device.name)
        return None if dev is None else dev.usable_memory_gb

    def summary(self) -> list[str]:
        """Sentences for the plan: which numbers came from the profile and which from datasheets."""
        measured = sorted(k for k, v in self.sources.items() if _measured(v))
        other = sorted(f"{k} ({v})" for k, v in self.sources.items() if not _measured(v))
        where = self.profile.origin or self.path or "the profile"  # "run DIR, step N [+ profile]"
        out = [f"Costs from {where} (measured {self.profile.created or 'at an unknown date'}): "
               f"{len(measured)} of {len(self.sources)} numbers measured."]
        if other:
            out.append("Not in the profile, from datasheets/fleet file: " + "; ".join(other) + ".")
        return out


def _measured(source: str) -> bool:
    """A source that is a measurement (a profile's, a run's), not a datasheet or the fleet file."""
    return source.startswith(("profile", "run ", "send: profile", "send: run "))


def _cores_of(environment: dict) -> int:
    """The cores a profile's machine gave it: its CPU count, or fewer where the profile recorded a container's
    quota or affinity mask (``usable_cores``, hetero/cores.py); 0: not recorded."""
    counts = [int(environment.get(key) or 0) for key in ("cpu_count", "usable_cores")]
    return min((c for c in counts if c > 0), default=0)
