"""Foreign GPU users, per backend: the idle gate before a job and the contention monitor during it.

One narrow interface, `GpuUserProbe` (`prime()`, `sample() -> ProbeSample`), with one real
implementation registered per backend (`backend_probe`; `probe_for` builds a job's):

* ROCm (`rocm`): `KfdProbe`, the KFD process list.
* CUDA (`cuda`): `NvmlProbe`, compute processes through NVML, else `NvidiaSmiProbe`.
* CPU and Metal (`cpu`): `CpuQuietProbe`, a CPU-quiet gate.

`watch` samples a probe: `wait_idle` before a job, `ContentionMonitor` during its measurement.
What counts as foreign is said in `base`.
"""

from workers.lock.probes.base import (
    PROBES,
    GpuUserProbe,
    IgnoringProbe,
    ProbeSample,
    ProbeUnavailableError,
    backend_probe,
    gate_knob,
    probe_for,
)
from workers.lock.probes.cpu import CpuQuietProbe
from workers.lock.probes.cuda import NvidiaSmiProbe, NvmlProbe, parse_compute_apps
from workers.lock.probes.rocm import KfdProbe
from workers.lock.probes.watch import ContentionMonitor, ContentionReport, wait_idle

__all__ = [
    "PROBES",
    "ContentionMonitor",
    "ContentionReport",
    "CpuQuietProbe",
    "GpuUserProbe",
    "IgnoringProbe",
    "KfdProbe",
    "NvidiaSmiProbe",
    "NvmlProbe",
    "ProbeSample",
    "ProbeUnavailableError",
    "backend_probe",
    "gate_knob",
    "parse_compute_apps",
    "probe_for",
    "wait_idle",
]
