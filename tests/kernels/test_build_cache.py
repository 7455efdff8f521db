"""The per-user disk cache of compiled kernels: hits, misses, and where it refuses to be used."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kernels.cuda import build_cache


class Builds:
    """A build that counts its calls and returns bytes naming the call."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> bytes:
        self.calls += 1
        return f"cubin {self.calls}".encode()


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "kernels"
    monkeypatch.setenv(build_cache.CACHE_ENV, str(path))
    return path


def test_a_second_process_reads_what_the_first_built(root: Path) -> None:
    build = Builds()
    assert build_cache.cached("gemm sm_90a v1", build) == b"cubin 1"
    assert build_cache.cached("gemm sm_90a v1", build) == b"cubin 1"  # from disk: not built again
    assert build.calls == 1
    assert build_cache.cached("gemm sm_90a v2", build) == b"cubin 2"  # another source: built
    assert oct(root.stat().st_mode & 0o777) == "0o700"
    assert sorted(p.name for p in root.iterdir()) == sorted(
        build_cache.entry_name(k) for k in ("gemm sm_90a v1", "gemm sm_90a v2")
    )


def test_a_directory_others_can_write_is_not_trusted(root: Path) -> None:
    root.mkdir(mode=0o700)
    os.chmod(root, 0o777)
    build = Builds()
    build_cache.cached("k", build)
    build_cache.cached("k", build)
    assert build.calls == 2
    assert not list(root.iterdir())


def test_a_symlinked_cache_directory_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    monkeypatch.setenv(build_cache.CACHE_ENV, str(tmp_path / "link"))
    build = Builds()
    build_cache.cached("k", build)
    build_cache.cached("k", build)
    assert build.calls == 2
    assert not list(real.iterdir())


def test_an_entry_that_is_a_symlink_is_not_followed(root: Path, tmp_path: Path) -> None:
    root.mkdir(mode=0o700)
    planted = tmp_path / "planted.bin"
    planted.write_bytes(b"someone else's code")
    (root / build_cache.entry_name("k")).symlink_to(planted)
    build = Builds()
    assert build_cache.cached("k", build) == b"cubin 1"
    assert planted.read_bytes() == b"someone else's code"  # the link was replaced, not written through
    assert not (root / build_cache.entry_name("k")).is_symlink()
    assert build_cache.cached("k", build) == b"cubin 1" and build.calls == 1


def test_an_empty_entry_is_rebuilt(root: Path) -> None:
    root.mkdir(mode=0o700)
    (root / build_cache.entry_name("k")).write_bytes(b"")
    build = Builds()
    assert build_cache.cached("k", build) == b"cubin 1"


def test_off_means_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(build_cache.CACHE_ENV, "off")
    build = Builds()
    build_cache.cached("k", build)
    build_cache.cached("k", build)
    assert build.calls == 2 and build_cache.cache_root() is None
