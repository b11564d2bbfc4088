"""The GPU's power, SM clock and energy while a callable runs (NVML, nvidia-ml-py): what the
prefill profile and the op's energy measurement (`op_energy.py`) sample.

`sampled(fn, calls)` runs fn() once (it makes `calls` calls and synchronizes) while a
thread reads the SM clock and the power draw every `period_s`, and reads NVML's energy
counter before and after: the energy of one call and the mean power over the window are
exact where the power reading averages over about a second. NVML's counter does not
resolve windows of 0.3-0.6 s (one H200); windows of about 3 s do.
"""

from __future__ import annotations

import threading
import time

import torch

#: NVML's clock event reasons (nvmlClocksEventReason*): why the SM clock is below its
#: maximum at a sample (several at once; GPU idle among them).
CLOCK_REASONS = ("GpuIdle", "ApplicationsClocksSetting", "SwPowerCap", "HwSlowdown",
                 "SyncBoost", "SwThermalSlowdown", "HwThermalSlowdown", "HwPowerBrakeSlowdown",
                 "DisplayClockSetting")


def nvml_handle():
    """The current device's NVML handle (nvidia-ml-py), or None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        index = torch.cuda._get_nvml_device_index(torch.cuda.current_device())
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # noqa: BLE001 - no NVML: the measurement stands without it
        return None


def reason_reader(handle):
    """A callable giving (clock event reasons bitmask, GPU temperature in C), or None
    where NVML cannot tell."""
    try:
        import pynvml

        read = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons",
                       getattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None))
        read(handle)
        return lambda: (read(handle), pynvml.nvmlDeviceGetTemperature(
            handle, pynvml.NVML_TEMPERATURE_GPU))
    except Exception:  # noqa: BLE001 - an old driver: clocks and power only
        return None


def energy_mj(handle) -> int | None:
    """The GPU's energy counter (mJ since the driver loaded), or None."""
    try:
        import pynvml

        return pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    except Exception:  # noqa: BLE001 - not every GPU or driver has it
        return None


def power_limit_w(handle) -> float | None:
    """The power limit the driver enforces (W), or None."""
    try:
        import pynvml

        return pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3
    except Exception:  # noqa: BLE001 - not every GPU or driver reports it
        return None


def _reasons(masks) -> dict:
    import pynvml

    return {name: sum(bool(m & bit) for m in masks) / len(masks) for name in CLOCK_REASONS
            if (bit := getattr(pynvml, f"nvmlClocksEventReason{name}",
                               getattr(pynvml, f"nvmlClocksThrottleReason{name}", 0)))}


def sampled(fn, period_s: float = 0.01, calls: int = 1, unit: str = "call") -> dict:
    """fn() (`calls` calls, synchronized) under no_grad with the SM clock and power sampled
    every `period_s` by a thread: their mean and minimum over the window, the share of
    samples at which each clock event reason was set, the temperature, and from the
    energy counter the energy of one call and the mean power over the window. Keys name
    the `unit` ("ms_per_call", "energy_j_per_call"); {} without NVML."""
    samples, reasons, done = [], [], threading.Event()
    handle = nvml_handle()
    read_reasons = None if handle is None else reason_reader(handle)

    def sample():  # at least one sample, however short the call
        while True:
            try:
                samples.append((torch.cuda.clock_rate(), torch.cuda.power_draw()))
                if read_reasons is not None:
                    reasons.append(read_reasons())
            except Exception:  # noqa: BLE001 - no NVML: nothing sampled
                return
            if done.wait(period_s):
                return

    thread = threading.Thread(target=sample, daemon=True)
    energy0 = None if handle is None else energy_mj(handle)
    t0 = time.perf_counter()
    thread.start()
    try:
        with torch.no_grad():
            fn()
    finally:
        seconds = time.perf_counter() - t0
        energy1 = None if handle is None else energy_mj(handle)
        done.set()
        thread.join()
    if not samples:
        return {}
    clock, power = zip(*samples)
    out = {"samples": len(samples), "sm_clock_mhz_mean": sum(clock) / len(clock),
           "sm_clock_mhz_min": min(clock), "power_mw_mean": sum(power) / len(power),
           f"{unit}s": calls, f"ms_per_{unit}": 1e3 * seconds / calls}
    if energy0 is not None and energy1 is not None:
        out.update({f"energy_j_per_{unit}": (energy1 - energy0) / 1e3 / calls,
                    "power_w_from_energy": (energy1 - energy0) / 1e3 / seconds})
    if handle is not None and (limit := power_limit_w(handle)) is not None:
        out["power_limit_w"] = limit
    if reasons:
        masks, temps = zip(*reasons)
        out["clock_reasons"] = _reasons(masks)
        out["temperature_c_max"] = max(temps)
    return out
