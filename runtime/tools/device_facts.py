"""What a profile records about a device besides timings: the host's available RAM, a device's free memory, and its
temperature and clocks where the vendor library is there (`hetero profile`, runtime/tools/profiler.py)."""

from __future__ import annotations

import math
import os

import torch


def available_ram_gb() -> float | None:
    """The host's available RAM now, GB: MemAvailable (free plus what the kernel can reclaim), else free pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1e9
    except (ValueError, OSError, AttributeError):
        return None


def usable_memory_gb(device: torch.device, share: int = 1) -> float | None:
    """Free memory of a GPU now; on CPU the host's available RAM divided among its ``share`` stages."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free / 1e9
    avail = available_ram_gb()
    return None if avail is None else avail / max(1, share)


def telemetry(device: torch.device) -> dict[str, float]:
    """Temperature and clocks where the vendor library is importable (NVML, amdsmi); else empty."""
    if device.type != "cuda":
        return {}
    index = device.index or 0
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            return {
                "temperature_c": float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
                "sm_clock_mhz": float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
                "memory_clock_mhz": float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)),
                "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
            }
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # absent library, no NVIDIA device (a ROCm build), or a driver refusing: try AMD
        pass
    try:
        import amdsmi  # type: ignore[import-not-found]

        amdsmi.amdsmi_init()
        try:
            h = amdsmi.amdsmi_get_processor_handles()[index]
            temp = amdsmi.amdsmi_get_temp_metric(h, amdsmi.AmdSmiTemperatureType.EDGE,
                                                 amdsmi.AmdSmiTemperatureMetric.CURRENT)
            clock = amdsmi.amdsmi_get_clock_info(h, amdsmi.AmdSmiClkType.GFX)
            return {"temperature_c": float(temp), "sm_clock_mhz": float(clock.get("clk", math.nan))}
        finally:
            amdsmi.amdsmi_shut_down()
    except Exception:
        return {}
