"""The head's Ray token and the fast check that a head is up (no Ray started here)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from orchestrator.errors import InfrastructureError
from orchestrator.head import enable_token_auth, ensure_token, require_head, token_path
from orchestrator.specs import InventorySpec


def test_token_is_made_once_with_mode_0600_where_ray_looks() -> None:
    path = token_path()
    assert path == Path(os.environ["HOME"]) / ".ray" / "auth_token"  # Ray's own default (temp HOME)
    assert ensure_token() == path
    token = path.read_text()
    assert len(token) == 64 and int(token, 16) > 0  # 256 random bits, hex
    assert path.stat().st_mode & 0o777 == 0o600
    assert ensure_token() == path and path.read_text() == token  # never replaced once made


def test_token_path_follows_ray_auth_token_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "elsewhere" / "tok"))
    assert token_path() == tmp_path / "elsewhere" / "tok"
    assert ensure_token().stat().st_mode & 0o777 == 0o600


def test_connecting_without_a_token_names_the_missing_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(InfrastructureError, match=r"no Ray token at .*auth_token: start the cluster"):
        enable_token_auth()
    assert "RAY_AUTH_MODE" not in os.environ


def test_require_head_fails_fast_when_nothing_listens() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    inv = InventorySpec.model_validate(
        {"head": {"address": "127.0.0.1", "ray_port": port}, "hosts": [{"name": "a", "host": "h", "device": "x"}]}
    )
    t0 = time.monotonic()
    with pytest.raises(InfrastructureError, match=rf"no Ray head answers at 127\.0\.0\.1:{port}"):
        require_head(inv)
    assert time.monotonic() - t0 < 2
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        up = inv.model_copy(update={"head": inv.head.model_copy(update={"ray_port": listener.getsockname()[1]})})
        require_head(up)  # something answers: no error
