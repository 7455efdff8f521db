"""The decode host-cost benchmark on this machine's MLX, at its tiny size."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import decode_host


def test_it_times_every_kind_of_op_and_every_arms_windows(tmp_path: Path) -> None:
    assert decode_host.main(["--out", str(tmp_path), "--tiny", "--windows", "2"]) == 0
    got = json.loads((tmp_path / "decode_host.json").read_text())
    assert got["device"] == "Device(cpu, 0)" and got["window_tokens"] == 128
    kinds = {"multiply", "affine quantized_matmul", "native quantized_matmul"}
    assert set(got["launch"]) == kinds | {"custom GEMV", "custom GEMV, plain cubin"}
    for cost in got["launch"].values():
        # the whole chain's time holds its building and its hand-over to the device
        assert cost["build_us"] > 0 and cost["build_us"] + cost["encode_us"] <= cost["total_us"] * 1.01
    assert set(got["decode"]) == {"affine", "native", "custom"}
    for arm in got["decode"].values():
        # in every window, building is part of the host's time, which is part of the wall time: so
        # are their medians (to the rounding of the output)
        assert 0 < arm["build_ms"] <= arm["host_ms"] <= arm["step_ms"] + 1e-4
        assert 0.8 < arm["tok_s"] * arm["step_ms"] / 1e3 < 1.25  # a rate is tokens over time (medians of 2)
