"""The device's state per timed round, through the real reader and a fake NVML (`fake_pynvml`)."""

from __future__ import annotations

import datetime as dt
import sys

import mlx.core as mx
import numpy as np
import pytest

from kernels.registry import ArmPath, Workload
from orchestrator.analysis.compare import compare_results
from orchestrator.analysis.samples import grouped_samples
from orchestrator.report.summary import left_out
from tests.workers.fake_pynvml import FakeGpu, FakeNvml
from tests.workers.tiny_job import tiny_job
from workers.contract import GpuPin, JobContext, JobSpec, RowBuilder
from workers.host.device_state import DeviceState, DeviceStateReader, decode_reasons
from workers.host.fingerprint import host_fingerprint
from workers.job.measure import measure_workload

SW_POWER_CAP, HW_SLOWDOWN, SYNC_BOOST, SW_THERMAL, HW_POWER_BRAKE = 0x4, 0x8, 0x10, 0x20, 0x80


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    fake = FakeNvml([FakeGpu("GPU-aaaa"), FakeGpu("GPU-bbbb", sm_clock_mhz=1410, temp_c=77, power_mw=699_250)])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return fake


def test_reasons_bitmask_decodes_by_name() -> None:
    assert decode_reasons(0) == ()
    assert decode_reasons(0x1) == ("gpu_idle",)
    assert decode_reasons(SW_POWER_CAP | SYNC_BOOST) == ("sw_power_cap", "sync_boost")
    assert decode_reasons(0x40 | HW_POWER_BRAKE | 0x100) == (
        "hw_thermal_slowdown",
        "hw_power_brake_slowdown",
        "display_clock_setting",
    )
    assert decode_reasons(0x400 | SW_THERMAL) == ("sw_thermal_slowdown", "0x400")  # a bit newer than this table


@pytest.mark.parametrize(
    ("mask", "throttled"),
    [
        (0, False),
        (SW_POWER_CAP, False),  # the board's steady regulation under sustained compute
        (SYNC_BOOST | 0x1, False),
        (SW_THERMAL, True),
        (0x40, True),
        (HW_SLOWDOWN, True),
        (HW_POWER_BRAKE | SW_POWER_CAP, True),
    ],
)
def test_thermal_and_power_emergencies_flag_a_sample(mask: int, throttled: bool) -> None:
    state = DeviceState(1500, 60, 400.0, decode_reasons(mask))
    assert state.throttled is throttled
    assert state.extra()["throttled"] == ("true" if throttled else "false")


def test_reader_follows_the_pin_and_reads_every_field(nvml: FakeNvml) -> None:
    nvml.gpus[1].masks = [SW_POWER_CAP | SW_THERMAL]
    state = DeviceStateReader("cuda", GpuPin(index=0, uuid="GPU-bbbb")).read()  # the UUID wins over the index
    assert state == DeviceState(1410, 77, 699.25, ("sw_power_cap", "sw_thermal_slowdown"))
    assert DeviceStateReader("cuda", GpuPin(index=1)).extra() == {
        "sm_clock_mhz": "1410",
        "temp_c": "77",
        "power_w": "699.2",
        "throttle": "sw_power_cap,sw_thermal_slowdown",
        "throttled": "true",
    }
    assert DeviceStateReader("cuda").extra()["sm_clock_mhz"] == "1980"  # unpinned, one GPU: NVML's first


def test_unpinned_job_follows_cuda_visible_devices(nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb")
    assert DeviceStateReader("cuda").extra()["temp_c"] == "77"


def test_nothing_is_read_where_the_backend_or_nvml_cannot_tell(nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    for backend in ("cpu", "metal", "rocm"):
        reader = DeviceStateReader(backend)
        assert not reader.available and reader.read() is None and reader.extra() == {}
    assert DeviceStateReader("cuda", GpuPin(index=0, uuid="GPU-none")).extra() == {}  # not on this host
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([FakeGpu("GPU-aaaa")], init_fails=True))
    assert DeviceStateReader("cuda").extra() == {}
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: importing it raises ImportError
    assert DeviceStateReader("cuda").extra() == {}


def test_an_unsupported_query_leaves_only_its_field_out(nvml: FakeNvml) -> None:
    nvml.gpus[0].unsupported = {"power", "reasons"}
    assert DeviceStateReader("cuda").extra() == {"sm_clock_mhz": "1980", "temp_c": "41"}


def _job(backend: str, reps: int) -> JobSpec:
    return tiny_job(["affine", "native"], reps, device="h100", backend=backend, options={"baseline": "affine"})


def _workload() -> Workload:
    w = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    wm = mx.array(w)
    return Workload(
        arms={
            "affine": ArmPath(lambda x: x @ wm.T, 1e-4, "matmul"),
            "native": ArmPath(lambda x: (x @ wm.T) * 1.0, 1e-4, "matmul*1"),
        },
        make_inputs=lambda rng: (mx.array(rng.standard_normal((4, 16)).astype(np.float32)),),
        reference=lambda arm, x: np.array(x, dtype=np.float64) @ w.astype(np.float64).T,
        flops=2 * 4 * 8 * 16,
        bytes_moved=4 * (8 * 16 + 4 * 16 + 4 * 8),
        tokens=4,
    )


def test_each_round_records_the_state_and_throttled_rounds_are_not_clean(nvml: FakeNvml) -> None:
    """Six rounds; rounds 1 and 4 under a thermal slowdown and a power brake, round 2 at the power
    cap: every timed row of a round carries the state read right after it (one query per round),
    and compare counts only the four clean rounds of each arm."""
    nvml.gpus[0].masks = [0, SW_THERMAL, SW_POWER_CAP, 0, HW_POWER_BRAKE, 0x1]
    job = _job("cuda", reps=6)
    rows = RowBuilder(job, host_fingerprint(), JobContext(started_at=dt.datetime.now(dt.UTC)))
    assert measure_workload(job, _workload(), rows, np.random.default_rng(1)) == "ok"
    assert nvml.gpus[0].reason_queries == 6
    table = rows.table("ok")
    timed = [r for r in table.to_pylist() if r["sample"] >= 0]
    assert {r["metric"] for r in timed} >= {"seconds", "prefill_tok_s", "tflop_per_s"}
    by_round = {}
    for r in timed:
        extra = dict(r["extra"])
        assert (extra["sm_clock_mhz"], extra["temp_c"], extra["power_w"]) == ("1980", "41", "312.5")
        by_round.setdefault(r["sample"], set()).add((extra["throttle"], extra["throttled"]))
    assert by_round == {
        0: {("none", "false")},
        1: {("sw_thermal_slowdown", "true")},
        2: {("sw_power_cap", "false")},
        3: {("none", "false")},
        4: {("hw_power_brake_slowdown", "true")},
        5: {("gpu_idle", "false")},
    }
    groups = grouped_samples(table, ["arm", "metric"])
    kept = {arm: sorted(int(s) for s in group.samples) for (arm, metric), group in groups if metric == "seconds"}
    assert kept == {"affine": [0, 2, 3, 5], "native": [0, 2, 3, 5]}
    result = compare_results(table, baseline="affine", metrics=["seconds"])
    (row,) = result.rows
    assert len(row.samples[("seconds", "native")].values) == 4
    assert len(row.samples[("seconds", "affine")].values) == 4
    per_round = len([r for r in timed if r["sample"] == 1])
    assert left_out(table) == f"left out: {2 * per_round} throttled (the GPU slowed itself for heat or power)"


def test_cpu_job_records_no_state(nvml: FakeNvml) -> None:
    job = _job("cpu", reps=2)
    rows = RowBuilder(job, host_fingerprint(), JobContext(started_at=dt.datetime.now(dt.UTC)))
    measure_workload(job, _workload(), rows, np.random.default_rng(1))
    timed = [dict(r["extra"]) for r in rows.table("ok").to_pylist() if r["sample"] >= 0]
    assert timed and not any("sm_clock_mhz" in e or "throttled" in e for e in timed)
    assert nvml.gpus[0].reason_queries == 0
