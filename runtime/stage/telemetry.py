"""Per-step device telemetry: SM clock, temperature, power and throttle reasons from NVML or amdsmi.

A stage samples its device after every step (``StepDone.telemetry``); the coordinator writes the
samples into metrics.jsonl (``stage_telemetry``: one dict or null per stage) and the rebalancer names
a throttling device as the cause of a slowdown (``throttle_cause``). Only where the library is
installed and the device is a GPU: a CPU stage reports null (nothing is invented). A failed sample is
null for that step; telemetry never fails a training step.

Torch-free at import (the coordinator's report reads it); the device's identity is asked of torch
only when a CUDA/ROCm stage opens its telemetry.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
from typing import Any, Protocol

log = logging.getLogger(__name__)

# NVML clocks event ("throttle") reasons: nvml.h nvmlClocksEventReason* bit values.
NVML_REASONS: dict[int, str] = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 1, 0  # nvmlClockType_t / nvmlTemperatureSensors_t values
AMD_THROTTLE = "firmware_throttle"  # amdsmi's throttle_status bits differ per ASIC: kept raw, named once
NUMBER_KEYS = ("sm_clock_mhz", "max_sm_clock_mhz", "temperature_c", "power_w", "power_limit_w", "throttle_status")
REASON_NAMES = frozenset(NVML_REASONS.values()) | {AMD_THROTTLE}


class Telemetry(Protocol):
    def sample(self) -> dict[str, Any] | None: ...


def _number(value: Any) -> float | None:
    """A reading as a float; None for 'N/A', a missing sensor or a non-finite value."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _read(call: Any, *args: Any) -> Any:
    """One reading; None when this device or driver does not support it."""
    try:
        return call(*args)
    except Exception:  # NVMLError_NotSupported, AmdSmiException, ...: one missing sensor is no failure
        return None


def nvml_reasons(mask: int) -> list[str]:
    """The names of the set bits of an NVML clocks event reasons mask, lowest bit first."""
    return [name for bit, name in NVML_REASONS.items() if mask & bit]


class NvmlTelemetry:
    """One NVIDIA GPU's readings through pynvml (the nvidia-ml-py package)."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml, self.handle = nvml, handle
        # Newer drivers renamed "throttle reasons" to "clocks event reasons"; same bits.
        self._reasons = (getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                         or getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None))
        self.max_sm_clock_mhz = _number(_read(nvml.nvmlDeviceGetMaxClockInfo, handle, NVML_CLOCK_SM))

    def sample(self) -> dict[str, Any] | None:
        """This moment's SM clock (MHz), temperature (C), power and its limit (W), throttle reasons."""
        nvml, h = self.nvml, self.handle
        power = _number(_read(nvml.nvmlDeviceGetPowerUsage, h))
        limit = _number(_read(nvml.nvmlDeviceGetEnforcedPowerLimit, h))
        mask = _read(self._reasons, h) if self._reasons is not None else None
        return {
            "source": "nvml",
            "sm_clock_mhz": _number(_read(nvml.nvmlDeviceGetClockInfo, h, NVML_CLOCK_SM)),
            "max_sm_clock_mhz": self.max_sm_clock_mhz,
            "temperature_c": _number(_read(nvml.nvmlDeviceGetTemperature, h, NVML_TEMPERATURE_GPU)),
            "power_w": None if power is None else power / 1000.0,  # NVML reports milliwatts
            "power_limit_w": None if limit is None else limit / 1000.0,
            "throttle": nvml_reasons(int(mask)) if isinstance(mask, int) else None,
        }


class AmdTelemetry:
    """One AMD GPU's readings through amdsmi (the GPU metrics table)."""

    def __init__(self, amdsmi: Any, handle: Any) -> None:
        self.amdsmi, self.handle = amdsmi, handle
        clocks = _read(amdsmi.amdsmi_get_clock_info, handle, amdsmi.AmdSmiClkType.GFX) or {}
        self.max_sm_clock_mhz = _number(clocks.get("max_clk"))

    def sample(self) -> dict[str, Any] | None:
        """This moment's graphics clock (MHz), hotspot temperature (C), socket power (W), throttle status."""
        metrics = _read(self.amdsmi.amdsmi_get_gpu_metrics_info, self.handle)
        if not isinstance(metrics, dict):
            return None
        status = metrics.get("throttle_status")
        clock = _number(metrics.get("current_gfxclk"))
        power = _number(metrics.get("current_socket_power"))
        return {
            "source": "amdsmi",
            "sm_clock_mhz": clock if clock is not None else _number(metrics.get("average_gfxclk_frequency")),
            "max_sm_clock_mhz": self.max_sm_clock_mhz,
            "temperature_c": _number(metrics.get("temperature_hotspot")),
            "power_w": power if power is not None else _number(metrics.get("average_socket_power")),
            "power_limit_w": None,
            "throttle": ([AMD_THROTTLE] if status else []) if isinstance(status, int) else None,
            "throttle_status": status if isinstance(status, int) else None,
        }


def _optional_module(name: str) -> Any:
    """``name`` imported, or None when it is not installed (telemetry is optional)."""
    try:
        return importlib.import_module(name)
    except Exception:  # not installed, or its shared library is missing on this host
        return None


def _nvml_handle(nvml: Any, index: int) -> Any:
    """The NVML handle of CUDA device ``index``: by UUID, since CUDA and NVML may number devices differently."""
    import torch

    uuid = _read(lambda: str(torch.cuda.get_device_properties(index).uuid))
    if uuid:
        handle = _read(nvml.nvmlDeviceGetHandleByUUID, uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
        if handle is not None:
            return handle
    to_nvml = getattr(torch.cuda, "_get_nvml_device_index", None)  # honours CUDA_VISIBLE_DEVICES
    nvml_index = _read(to_nvml, index) if to_nvml is not None else None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if nvml_index is None and visible:
        return None  # a remapped fleet without torch's mapping: better no telemetry than another GPU's
    return nvml.nvmlDeviceGetHandleByIndex(index if nvml_index is None else nvml_index)


def _amd_handle(amdsmi: Any, index: int) -> Any:
    """The amdsmi handle of ROCm device ``index`` (torch's own mapping where it has one)."""
    import torch

    to_amdsmi = getattr(torch.cuda, "_get_amdsmi_device_index", None)
    amd_index = _read(to_amdsmi, index) if to_amdsmi is not None else None
    return amdsmi.amdsmi_get_processor_handles()[index if amd_index is None else amd_index]


def open_telemetry(device: Any) -> Telemetry | None:
    """Telemetry of a torch device (``.type``, ``.index``): NVML on CUDA, amdsmi on ROCm, None otherwise
    (a CPU or MPS device, the library not installed, or the device not found)."""
    if getattr(device, "type", None) != "cuda":
        return None
    index = device.index or 0
    try:
        import torch

        if getattr(torch.version, "hip", None):
            amdsmi = _optional_module("amdsmi")
            if amdsmi is None:
                return None
            amdsmi.amdsmi_init()
            return AmdTelemetry(amdsmi, _amd_handle(amdsmi, index))
        nvml = _optional_module("pynvml")
        if nvml is None:
            return None
        nvml.nvmlInit()
        handle = _nvml_handle(nvml, index)
        return NvmlTelemetry(nvml, handle) if handle is not None else None
    except Exception as exc:  # no driver, no permission, an old library: train without telemetry
        log.info("no device telemetry for %s: %s", device, exc)
        return None


def sample(telemetry: Telemetry | None) -> dict[str, Any] | None:
    """One step's reading, or None (no telemetry, or the reading failed this time)."""
    if telemetry is None:
        return None
    try:
        return telemetry.sample()
    except Exception:  # a driver hiccup costs one step's reading, never the step
        return None


def clean_telemetry(value: Any) -> dict[str, Any] | None:
    """A stage's reported telemetry, keeping only the known keys with values of the right type (it came over
    the wire and goes into metrics.jsonl); None when there is nothing usable."""
    if not isinstance(value, dict):
        return None
    out: dict[str, Any] = {k: _number(value.get(k)) for k in NUMBER_KEYS if k in value}
    if value.get("source") in ("nvml", "amdsmi"):
        out["source"] = value["source"]
    reasons = value.get("throttle")
    if isinstance(reasons, list):
        out["throttle"] = [r for r in reasons if isinstance(r, str) and r in REASON_NAMES]
    return out if any(v is not None for k, v in out.items() if k != "source") else None


def _temperature(t: dict[str, Any]) -> str:
    return f" at {t['temperature_c']:.0f} C" if _number(t.get("temperature_c")) is not None else ""


def _clock(t: dict[str, Any]) -> str:
    clock, top = _number(t.get("sm_clock_mhz")), _number(t.get("max_sm_clock_mhz"))
    if clock is None:
        return ""
    return f", SM clock {clock:.0f} MHz" + (f" of {top:.0f}" if top else "")


def throttle_kind(telemetry: dict[str, Any] | None) -> str | None:
    """Which throttling one telemetry sample reports: 'thermal slowdown', 'power brake', 'power cap',
    'hardware slowdown', 'firmware throttling', 'application clocks'; None for none (idle, sync boost
    and display clocks are not causes)."""
    if not isinstance(telemetry, dict):
        return None
    reasons = set(telemetry.get("throttle") or [])
    for kind, names in (("thermal slowdown", {"hw_thermal_slowdown", "sw_thermal_slowdown"}),
                        ("power brake", {"hw_power_brake_slowdown"}), ("power cap", {"sw_power_cap"}),
                        ("hardware slowdown", {"hw_slowdown"}), ("firmware throttling", {AMD_THROTTLE})):
        if reasons & names:
            return kind
    clock, top = _number(telemetry.get("sm_clock_mhz")), _number(telemetry.get("max_sm_clock_mhz"))
    if "applications_clocks_setting" in reasons and clock is not None and top and clock < 0.9 * top:
        return "application clocks"
    return None


def throttle_cause(telemetry: dict[str, Any] | None) -> str | None:
    """Why a device runs slow, in words ("thermal slowdown at 87 C, SM clock 1100 MHz of 1980", "power cap
    (250 W of 250 W)", ...) from one telemetry sample; None when it reports no throttling."""
    kind = throttle_kind(telemetry)
    if kind is None or telemetry is None:
        return None
    t, clock = telemetry, _clock(telemetry)
    if kind == "power cap":
        power, limit = _number(t.get("power_w")), _number(t.get("power_limit_w"))
        return f"power cap{f' ({power:.0f} W of {limit:.0f} W)' if power is not None and limit else ''}{clock}"
    if kind == "power brake":
        return f"power brake (the power supply asked the GPU to slow down){clock}"
    if kind == "hardware slowdown":
        return f"hardware slowdown (heat or power){_temperature(t)}{clock}"
    if kind == "firmware throttling":
        status = _number(t.get("throttle_status"))
        code = f" (amdsmi throttle status {int(status):#x})" if status is not None else ""
        return f"firmware throttling{code}{_temperature(t)}{clock}"
    if kind == "application clocks":
        return f"clocks held down by the application clocks setting (nvidia-smi -ac / -lgc){clock}"
    return f"thermal slowdown{_temperature(t)}{clock}"


def _values(samples: list[dict[str, Any]], key: str) -> list[float]:
    return [v for v in (_number(t.get(key)) for t in samples) if v is not None]


def telemetry_summary(steps: list[Any], stages: int) -> list[dict[str, Any] | None]:
    """Per stage over the run's steps (metrics.jsonl's StepLine): lowest SM clock, hottest, most power, throttled
    steps and their kinds; None for a stage that reported no telemetry (a CPU)."""
    out: list[dict[str, Any] | None] = []
    for k in range(stages):
        samples = [t[k] for s in steps if (t := s.stage_telemetry) is not None and k < len(t) and t[k] is not None]
        if not samples:
            out.append(None)
            continue
        kinds = [kind for kind in map(throttle_kind, samples) if kind]
        out.append({
            "samples": len(samples), "min_sm_clock_mhz": min(_values(samples, "sm_clock_mhz"), default=None),
            "max_temperature_c": max(_values(samples, "temperature_c"), default=None),
            "max_power_w": max(_values(samples, "power_w"), default=None),
            "throttled_steps": len(kinds), "throttle": sorted(set(kinds)),
        })
    return out
