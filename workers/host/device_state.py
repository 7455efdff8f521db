"""The device's state while it is measured: SM clock, temperature, power and why its clocks are low.

Where the backend tells (CUDA, through NVML: nvidia-ml-py, optional as for the GPU-user probe in
`workers.lock.probes.cuda`), the timed loop reads the state once per round, right after the round,
and every row of that round carries it in `extra`:

* `sm_clock_mhz`, `temp_c`, `power_w`: the SM clock, the GPU's temperature and its power draw (NVML
  averages the draw over about a second, so it trails a short round);
* `throttle`: NVML's clocks event reasons at that moment, by name (`sw_power_cap,sync_boost`;
  `none` when no reason holds the clocks down; `gpu_idle` between kernels);
* `throttled`: `true` when a thermal slowdown, a hardware slowdown or an external power brake held
  the clocks down. Such a sample measured a device that was slowing itself down for heat or a
  failing supply, not the code; `orchestrator.analysis.groups.clean_rows` leaves it out.

The board's own power cap (`sw_power_cap`) is recorded but does not flag a sample: it is how a
GPU runs any sustained compute-bound kernel (a dense bfloat16 GEMM reaches it within seconds), so
excluding it would exclude every large prefill, and ABBA rounds put both arms under it alike.

One NVML query set costs a few microseconds; it is made per round, not per call. On the CPU,
Metal and ROCm backends nothing is recorded (`extra()` is empty), and so it is where pynvml is
missing or NVML does not answer: a state that cannot be read never fails a job.

Other timed loops (a model job's samples) use the same reader: `reader = for_job(job)` once, then
`reader.extra()` right after each sample, merged into that sample's rows' `extra`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workers.contract import GpuPin, JobSpec

# NVML's clocks event reasons (nvml.h, `nvmlClocksEventReason*`), bit by bit.
REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
# The reasons that make a sample unclean: heat, or a hardware or external power emergency.
THROTTLING = frozenset({"hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"})


def decode_reasons(mask: int) -> tuple[str, ...]:
    """The names of the reasons set in NVML's bitmask, lowest bit first; an unknown bit by its value."""
    names = []
    bit = 1
    while bit <= mask:
        if mask & bit:
            names.append(REASONS.get(bit, f"0x{bit:x}"))
        bit <<= 1
    return tuple(names)


@dataclass(frozen=True)
class DeviceState:
    """What the device said at one moment (None: that query is not supported on this device)."""

    sm_clock_mhz: int | None
    temp_c: int | None
    power_w: float | None
    reasons: tuple[str, ...] | None

    @property
    def throttled(self) -> bool:
        """True when heat or a power emergency held the clocks down (module docstring)."""
        return bool(self.reasons and THROTTLING.intersection(self.reasons))

    def extra(self) -> dict[str, str]:
        """The state as a row's `extra` entries (the queries that answered)."""
        out: dict[str, str] = {}
        if self.sm_clock_mhz is not None:
            out["sm_clock_mhz"] = str(self.sm_clock_mhz)
        if self.temp_c is not None:
            out["temp_c"] = str(self.temp_c)
        if self.power_w is not None:
            out["power_w"] = f"{self.power_w:.1f}"
        if self.reasons is not None:
            out["throttle"] = ",".join(self.reasons) or "none"
            out["throttled"] = "true" if self.throttled else "false"
        return out


class DeviceStateReader:
    """Reads one GPU's state through NVML; reads nothing where the backend or the host cannot tell."""

    def __init__(self, backend: str, gpu: GpuPin | None = None) -> None:
        self._nvml: Any = None
        self._handle: Any = None
        if backend != "cuda":
            return  # CPU, Metal, ROCm: nothing is recorded
        try:
            import pynvml  # optional (nvidia-ml-py): without it nothing is recorded
        except ImportError:
            return
        try:
            pynvml.nvmlInit()
            self._handle = _handle(pynvml, gpu)
        except pynvml.NVMLError:
            return
        self._nvml = pynvml

    @property
    def available(self) -> bool:
        """True when this reader can tell the device's state."""
        return self._nvml is not None

    def read(self) -> DeviceState | None:
        """The device's state now (None where nothing can be read)."""
        nvml = self._nvml
        if nvml is None:
            return None
        h = self._handle
        power_mw = self._ask(lambda: nvml.nvmlDeviceGetPowerUsage(h))
        mask = self._ask(lambda: nvml.nvmlDeviceGetCurrentClocksEventReasons(h))
        return DeviceState(
            sm_clock_mhz=self._ask(lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)),
            temp_c=self._ask(lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
            power_w=None if power_mw is None else power_mw / 1000.0,
            reasons=None if mask is None else decode_reasons(int(mask)),
        )

    def extra(self) -> dict[str, str]:
        """The device's state now as a row's `extra` entries (empty where nothing can be read)."""
        state = self.read()
        return {} if state is None else state.extra()

    def _ask(self, query: Callable[[], Any]) -> Any:
        try:
            return query()
        except self._nvml.NVMLError:  # not supported on this board, or the driver stopped answering
            return None


def _handle(nvml: Any, gpu: GpuPin | None) -> Any:
    """The NVML handle of the job's GPU: its pin's UUID (exact whatever the order), else its pin's
    index (NVML's, as the pin's); unpinned, the first GPU `CUDA_VISIBLE_DEVICES` names by UUID, else
    NVML's first (a host with one GPU)."""
    if gpu is not None:
        if gpu.uuid:
            return nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
        return nvml.nvmlDeviceGetHandleByIndex(gpu.index)
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if first.startswith("GPU-"):
        return nvml.nvmlDeviceGetHandleByUUID(first)
    return nvml.nvmlDeviceGetHandleByIndex(0)


def for_job(job: JobSpec) -> DeviceStateReader:
    """The state reader of the device `job` runs on."""
    return DeviceStateReader(job.backend, job.gpu)
