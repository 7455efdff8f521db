"""The host fingerprint and the local device kind, as MLX runs here."""

from __future__ import annotations

import platform

import mlx.core as mx
import pytest

from orchestrator.specs.sweep import InventorySpec, load_inventory
from workers.host.fingerprint import device_kind_slug, host_fingerprint, local_device


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


def test_driver_os_release_hostname_and_mlx_are_in_the_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new GPU driver, kernel, host or MLX is another fingerprint (peaks are probed again, the
    history reports the change), not the same one silently."""
    from workers.host import fingerprint as fpmod

    facts = fpmod._static_facts()

    def on_h200(driver: str = "580.65.06") -> None:
        monkeypatch.setattr(fpmod, "detect_backend", lambda: "cuda")
        monkeypatch.setattr(fpmod, "_static_facts", lambda: (facts[0], facts[1], "NVIDIA H200", driver))

    on_h200()
    base = host_fingerprint()
    assert (base.gpu, base.gpu_driver) == ("NVIDIA H200", "580.65.06")
    assert base.os.startswith(f"{platform.system()} {platform.release()}")
    assert host_fingerprint().fingerprint_id == base.fingerprint_id  # nothing else moves it
    on_h200("590.12")
    changed = {"driver": host_fingerprint()}
    on_h200()
    monkeypatch.setattr(fpmod.platform, "release", lambda: "9.9.9-test")
    changed["kernel"] = host_fingerprint()
    monkeypatch.undo()
    on_h200()
    monkeypatch.setattr(fpmod.socket, "gethostname", lambda: "another-host")
    changed["host"] = host_fingerprint()
    monkeypatch.undo()
    on_h200()
    monkeypatch.setattr(mx, "__version__", "0.99.0", raising=False)
    changed["mlx"] = host_fingerprint()
    for what, fp in changed.items():
        assert fp.fingerprint_id != base.fingerprint_id, what
        assert fp.gpu_driver is not None  # each differs from the base in that one field only
    assert len({fp.fingerprint_id for fp in changed.values()}) == 4
    assert changed["kernel"].os.startswith(f"{platform.system()} 9.9.9-test")
    assert changed["host"].hostname == "another-host" and changed["mlx"].mlx_version == "0.99.0"
