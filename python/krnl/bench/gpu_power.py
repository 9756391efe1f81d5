"""The GPU's SM clock, power and energy while a benchmark runs, from NVML (the NVIDIA driver's
libnvidia-ml, through ctypes: nothing to install). Under a power cap a step's time follows the
energy it uses, so a row's milliseconds mean little without the clock it ran at
(docs/performance.md, 'The power cap').

A Meter samples in a thread every `period` seconds from start() to stop(); window(spans) summarises
the samples between pairs of time.perf_counter() stamps. NVML's energy counter moves in steps (about
every 100 ms on an H200), so the window's energy is taken between the counter's first and last
moves inside it, over the time between those moves: the mean power of whole counter periods."""

import contextlib
import ctypes
import threading
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

NVML_CLOCK_SM = 1
SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap


@dataclass(frozen=True)
class Reading:
    t: float          # time.perf_counter()
    sm_mhz: int
    energy_mj: int    # the counter since the driver loaded
    capped: bool      # the software power cap is holding the clock down


class Nvml:
    """One GPU through NVML, found by its PCI bus id (Capabilities' details["pci_bus_id"])."""

    def __init__(self, pci_bus_id: str, lib: str = "libnvidia-ml.so.1"):
        self.lib = ctypes.CDLL(lib)
        self._check(self.lib.nvmlInit_v2(), "nvmlInit_v2")
        self.handle = ctypes.c_void_p()
        self._check(self.lib.nvmlDeviceGetHandleByPciBusId_v2(pci_bus_id.encode(), ctypes.byref(self.handle)),
                    f"nvmlDeviceGetHandleByPciBusId_v2({pci_bus_id})")

    def _check(self, rc, what):
        if rc != 0:
            self.lib.nvmlErrorString.restype = ctypes.c_char_p
            raise OSError(f"[gpu_power] {what}: NVML error {rc} ({self.lib.nvmlErrorString(rc).decode()})")

    def read(self) -> Reading:
        mhz, mj, why = ctypes.c_uint(), ctypes.c_ulonglong(), ctypes.c_ulonglong()
        self._check(self.lib.nvmlDeviceGetClockInfo(self.handle, NVML_CLOCK_SM, ctypes.byref(mhz)), "clock")
        self._check(self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(mj)), "energy")
        self._check(self.lib.nvmlDeviceGetCurrentClocksEventReasons(self.handle, ctypes.byref(why)), "reasons")
        return Reading(time.perf_counter(), int(mhz.value), int(mj.value), bool(why.value & SW_POWER_CAP))


def window(readings: List[Reading], spans) -> Optional[dict]:
    """The samples inside the spans [(a, b), ...] of time.perf_counter() stamps: median SM clock,
    the share held by the power cap, and the mean power over the whole energy-counter periods
    inside the spans (None where no span holds two moves of the counter, e.g. spans of a few
    milliseconds)."""
    inside = [sorted((r for r in readings if a <= r.t <= b), key=lambda r: r.t) for a, b in spans]
    rs = [r for part in inside for r in part]
    if not rs:
        return None
    joules = seconds = 0.0
    for part in inside:
        moves = [r for p, r in zip(part, part[1:]) if r.energy_mj != p.energy_mj]  # a step's first reading
        if len(moves) >= 2 and moves[-1].t > moves[0].t:
            joules += (moves[-1].energy_mj - moves[0].energy_mj) / 1e3
            seconds += moves[-1].t - moves[0].t
    mhz = sorted(r.sm_mhz for r in rs)
    return {"sm_mhz": mhz[len(mhz) // 2], "capped": sum(r.capped for r in rs) / len(rs),
            "watts": joules / seconds if seconds else None, "samples": len(rs)}


def describe(g):
    """A row note's words for window()'s figures (with joules_per_step where the caller added it)."""
    if not g or "sm_mhz" not in g:
        return ""
    watts = f", {g['watts']:.0f} W" if g.get("watts") is not None else ""
    joules = f", {g['joules_per_step']:.1f} J a step" if g.get("joules_per_step") is not None else ""
    return f"SM {g['sm_mhz']} MHz{watts}{joules}, power cap {100 * g['capped']:.0f}% of {g['samples']} samples"


class Meter:
    """Readings of `read` (a Reading-returning callable) every `period` s in a thread."""

    def __init__(self, read: Callable[[], Reading], period: float = 0.02):
        self.read, self.period = read, period
        self.readings: List[Reading] = []
        self._stop = threading.Event()
        self._thread = None

    def _run(self):
        while not self._stop.is_set():
            self.readings.append(self.read())
            self._stop.wait(self.period)

    def start(self):
        self._thread = threading.Thread(target=self._run, name="krnl-gpu-power", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def window(self, spans):
        return window(list(self.readings), spans)


def meter_for(dev):
    """(a started Meter, None) for a CUDA device whose NVML loads, else (None, why not)."""
    caps = dev.capabilities()
    bus = dict(caps.get("details", {})).get("pci_bus_id")
    if caps["kind"] != "cuda" or not bus:
        return None, f"no NVML GPU behind a {caps['kind']} device"
    try:
        nv = Nvml(bus)
        nv.read()
    except (OSError, AttributeError) as e:  # no driver library, or one without these calls
        return None, f"NVML unavailable: {e}"
    return Meter(nv.read).start(), None


@contextlib.contextmanager
def metered(dev, on=True):
    """meter_for(dev)'s (a started Meter, None) or (None, why not) for the with block, the meter
    stopped after it, whatever the block raises; (None, None) where `on` is false."""
    meter, why = meter_for(dev) if on else (None, None)
    try:
        yield meter, why
    finally:
        if meter is not None:
            meter.stop()
