"""The spool layout shared by the worker (writes) and `orchestrate collect` (reads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.job.spool import fragment_name, parse_fragment_name, spool_root, spooled_fragments


def test_fragment_names_round_trip_with_dashes_in_the_run_id() -> None:
    name = fragment_name("20261130T104512Z-3fa9", "0123456789abcdef")
    assert name == "part-20261130T104512Z-3fa9-0123456789abcdef.parquet"
    assert parse_fragment_name(name) == ("20261130T104512Z-3fa9", "0123456789abcdef")
    assert parse_fragment_name(f"/x/y/{name}") == ("20261130T104512Z-3fa9", "0123456789abcdef")
    for other in ("0123.json", f".{name}.abc.tmp", "part-.parquet", "part-nodash.parquet"):
        assert parse_fragment_name(other) is None, other


def test_spool_root_prefers_the_nodes_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ORCHESTRATE_SPOOL", str(tmp_path / "node"))
    assert spool_root("/job/dir") == tmp_path / "node"
    monkeypatch.delenv("ORCHESTRATE_SPOOL")
    assert spool_root("/job/dir") == Path("/job/dir")
    assert spool_root(None) == Path.home() / ".orchestrate" / "spool"


def test_spooled_fragments_skips_temp_files_and_job_files(tmp_path: Path) -> None:
    run = tmp_path / "sweep" / "r-1"
    run.mkdir(parents=True)
    keep = run / fragment_name("r-1", "aaaa")
    keep.write_bytes(b"")
    (run / "aaaa.json").write_text("{}")
    (run / f".{keep.name}.x1.tmp").write_bytes(b"")
    assert spooled_fragments(tmp_path) == [keep]
    assert spooled_fragments(tmp_path / "missing") == []
