"""The spool layout shared by the worker (writes) and `orchestrate collect` (reads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.job.spool import fragment_name, parse_fragment_name, spool_root


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
