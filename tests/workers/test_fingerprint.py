"""The host fingerprint and the local device kind, as MLX runs here."""

from __future__ import annotations

import mlx.core as mx
import pytest

from orchestrator.specs import InventorySpec, load_inventory
from workers.fingerprint import device_kind_slug, host_fingerprint, local_device


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("Apple M1 Ultra", "m1-ultra"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("AMD Radeon Graphics gfx1151", "gfx1151"),
        ("NVIDIA", "gpu"),
    ],
)
def test_device_kind_from_gpu_name(name: str, kind: str) -> None:
    assert device_kind_slug(name) == kind


def test_fingerprint_states_what_mlx_runs_on() -> None:
    fp = host_fingerprint()
    gpu_backend = mx.default_device() == mx.gpu
    assert (fp.backend != "cpu") == gpu_backend
    assert fp.mlx_version == mx.__version__  # type: ignore[attr-defined]
    assert fp.cpu_count >= 1 and fp.memory_bytes > 0 and fp.threads >= 1
    if fp.backend == "cpu":
        assert fp.gpu is None  # a CPU run never names a GPU
    assert len(fp.fingerprint_id) == 16 and fp.fingerprint_id == host_fingerprint().fingerprint_id


def test_local_inventory_resolves_auto_to_this_machine() -> None:
    kind, backend = local_device()
    host = load_inventory(None).hosts[0]
    assert (host.device, host.backend) == (kind, backend)
    if mx.default_device() != mx.gpu:
        assert (kind, backend) == ("cpu", "cpu")
    # a remote host cannot be detected from here: `auto` stays an error there
    with pytest.raises(ValueError, match="backend 'auto'"):
        InventorySpec.model_validate(
            {"hosts": [{"name": "r", "host": "r.lab.example", "device": "x", "backend": "auto"}]}
        )
