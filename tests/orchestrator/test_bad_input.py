"""Bad sweep and inventory files: one line naming the file and field, exit 2, nothing written."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import child_env

GOOD_CASE = """
[[cases]]
case = "qmm"
arms = ["native", "affine"]
params = { tokens = [1, 4], n = 32, k = 64, dtype = "float32" }
"""


def _sweep(tmp: Path, body: str) -> Path:
    path = tmp / "s.toml"
    path.write_text(body)
    return path


CASES = {
    "unknown field": ('name = "x"\ncolour = "red"\n' + GOOD_CASE, "field colour: unknown field"),
    "wrong type": ('name = "x"\nrepetitions = "ten"\n' + GOOD_CASE, "field repetitions"),
    "empty axis": (
        'name = "x"\n[[cases]]\ncase = "qmm"\narms = ["native"]\nparams = { tokens = [], n = 32, k = 64 }\n',
        "params.tokens: empty axis",
    ),
    "unknown case": ('name = "x"\n[[cases]]\ncase = "gemm9"\narms = ["native"]\n', "unknown case 'gemm9'"),
    "unknown arm": (
        'name = "x"\n[[cases]]\ncase = "qmm"\narms = ["native", "turbo"]\nparams = { tokens = 1, n = 32, k = 64 }\n',
        "unknown arm 'turbo'",
    ),
    "unknown device kind": ('name = "x"\ndevices = ["tpu-v9"]\n' + GOOD_CASE, "device kind 'tpu-v9' has no host"),
    "malformed toml": ('name = "x\n', "malformed TOML"),
    "missing param": (
        'name = "x"\n[[cases]]\ncase = "qmm"\narms = ["native"]\nparams = { tokens = 1, n = 32 }\n',
        "params.k: required",
    ),
}


@pytest.mark.parametrize("label", sorted(CASES))
def test_bad_sweep_exits_2_and_writes_nothing(label: str, tmp_path: Path, orchestrate_bin: str) -> None:
    body, expected = CASES[label]
    sweep = _sweep(tmp_path, body)
    results = tmp_path / "out"
    proc = subprocess.run(
        [orchestrate_bin, "run", "--sweep", str(sweep), "--results", str(results)],
        capture_output=True, text=True, env=child_env(), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(sweep) in lines[0]
    assert expected in lines[0]
    assert not results.exists()


def test_missing_inventory_file(tmp_path: Path, orchestrate_bin: str) -> None:
    missing = tmp_path / "nope.toml"
    proc = subprocess.run(
        [orchestrate_bin, "run", "--inventory", str(missing), "--results", str(tmp_path / "out")],
        capture_output=True, text=True, env=child_env(), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"orchestrate: error: {missing}: inventory file not found"
    assert not (tmp_path / "out").exists()


def test_inventory_unknown_field_and_duplicate_host(tmp_path: Path, orchestrate_bin: str) -> None:
    inv = tmp_path / "inv.toml"
    inv.write_text('[[hosts]]\nname = "a"\ndevice = "cpu"\n[[hosts]]\nname = "a"\ndevice = "cpu"\n')
    proc = subprocess.run(
        [orchestrate_bin, "run", "--inventory", str(inv), "--results", str(tmp_path / "out")],
        capture_output=True, text=True, env=child_env(), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "host name 'a' is used twice" in proc.stderr and str(inv) in proc.stderr
    inv.write_text('[[hosts]]\nname = "a"\ndevice = "cpu"\ngpu_count = 2\n')
    proc = subprocess.run(
        [orchestrate_bin, "run", "--inventory", str(inv), "--results", str(tmp_path / "out")],
        capture_output=True, text=True, env=child_env(), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "field hosts.0.gpu_count: unknown field" in proc.stderr


def test_unwritable_results_dir(tmp_path: Path, orchestrate_bin: str) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = subprocess.run(
        [orchestrate_bin, "run", "--results", str(blocker / "results")],
        capture_output=True, text=True, env=child_env(), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "results directory is not writable" in proc.stderr
    assert blocker.read_text() == "not a directory"


def test_unknown_builtin_sweep(tmp_path: Path, orchestrate_bin: str) -> None:
    proc = subprocess.run(
        [orchestrate_bin, "run", "--sweep", "nope"], capture_output=True, text=True, env=child_env(), timeout=60
    )
    assert proc.returncode == 2
    assert "unknown sweep 'nope'" in proc.stderr and "smoke" in proc.stderr
