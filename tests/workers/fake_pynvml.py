"""A fake `pynvml` (test-only): the few NVML calls `workers.host.device_state` makes, answering from
values the test sets, so the real reading and decoding code runs on a machine without a GPU.

Install an instance as the module: `monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(...))`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NVML_CLOCK_SM = 1  # NVML's values (nvml.h): a wrong constant passed through would be caught
NVML_TEMPERATURE_GPU = 0


class FakeNvmlError(Exception):
    """Stands for `pynvml.NVMLError`."""


@dataclass
class FakeGpu:
    """One fake GPU: its answers; `masks` are the clocks event reasons, one per query (the last repeats)."""

    uuid: str
    sm_clock_mhz: int = 1980
    temp_c: int = 41
    power_mw: int = 312_500
    masks: list[int] = field(default_factory=lambda: [0])
    unsupported: set[str] = field(default_factory=set)  # queries that raise, as on boards without them
    reason_queries: int = 0


class FakeNvml:
    """The fake module: `nvmlInit`, handles by index or UUID, and the state queries."""

    NVML_CLOCK_SM = NVML_CLOCK_SM
    NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU
    NVMLError = FakeNvmlError

    def __init__(self, gpus: list[FakeGpu], *, init_fails: bool = False) -> None:
        self.gpus = gpus
        self.init_fails = init_fails

    def nvmlInit(self) -> None:
        if self.init_fails:
            raise FakeNvmlError("Driver Not Loaded")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        if not 0 <= index < len(self.gpus):
            raise FakeNvmlError("Invalid Argument")
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeGpu:
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return gpu
        raise FakeNvmlError("Not Found")

    def _check(self, gpu: FakeGpu, query: str) -> None:
        if query in gpu.unsupported:
            raise FakeNvmlError("Not Supported")

    def nvmlDeviceGetClockInfo(self, gpu: FakeGpu, kind: int) -> int:
        self._check(gpu, "clock")
        if kind != NVML_CLOCK_SM:
            raise FakeNvmlError("Invalid Argument")
        return gpu.sm_clock_mhz

    def nvmlDeviceGetTemperature(self, gpu: FakeGpu, sensor: int) -> int:
        self._check(gpu, "temperature")
        if sensor != NVML_TEMPERATURE_GPU:
            raise FakeNvmlError("Invalid Argument")
        return gpu.temp_c

    def nvmlDeviceGetPowerUsage(self, gpu: FakeGpu) -> int:
        self._check(gpu, "power")
        return gpu.power_mw

    def nvmlDeviceGetCurrentClocksEventReasons(self, gpu: FakeGpu) -> int:
        self._check(gpu, "reasons")
        mask = gpu.masks[min(gpu.reason_queries, len(gpu.masks) - 1)]
        gpu.reason_queries += 1
        return mask
