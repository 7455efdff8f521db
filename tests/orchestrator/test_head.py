"""The head's Ray token and the fast check that a head is up and ours (no Ray started here)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from orchestrator.cluster.head import HEAD_PID, require_head, stop_head
from orchestrator.cluster.token import enable_token_auth, ensure_token, rotate_token, token_path
from orchestrator.errors import InfrastructureError
from orchestrator.specs.sweep import InventorySpec
from workers.proc.table import pid_alive


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
        # Something answers, but it is this test, not the head `cluster up` started: no token goes to it.
        with pytest.raises(InfrastructureError, match=rf"taken by pid {os.getpid()} \(.*\), not by the Ray head"):
            require_head(up)


def test_a_token_readable_by_others_is_replaced_and_never_used_to_connect(capsys: pytest.CaptureFixture[str]) -> None:
    path = token_path()
    path.parent.mkdir(parents=True)
    path.write_text("f" * 64)
    path.chmod(0o644)  # as Ray's own `ray.init` makes it
    with pytest.raises(InfrastructureError, match=r"readable by other users \(mode 0644\): treat the cluster's token"):
        enable_token_auth()
    assert ensure_token() == path
    assert path.read_text() != "f" * 64 and len(path.read_text()) == 64  # a new token, not the exposed one
    assert path.stat().st_mode & 0o777 == 0o600
    err = capsys.readouterr().err
    assert "readable by other users (mode 0644): treated as leaked and replaced" in err
    assert path.read_text() not in err and "f" * 64 not in err  # never printed
    before = path.read_text()
    assert rotate_token() == path and path.read_text() != before and path.stat().st_mode & 0o777 == 0o600


def test_a_token_that_is_a_symlink_or_not_ours_is_refused(tmp_path: Path) -> None:
    path = token_path()
    path.parent.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("x" * 64)
    elsewhere.chmod(0o600)
    path.symlink_to(elsewhere)
    with pytest.raises(InfrastructureError, match="is a symbolic link; refusing to use it"):
        ensure_token()
    assert elsewhere.read_text() == "x" * 64  # not followed, not replaced
    path.unlink()
    path.write_text("y" * 64)
    path.chmod(0o600)
    os.chown(path, 12345, 12345)
    with pytest.raises(InfrastructureError, match="belongs to uid 12345"):
        enable_token_auth()


def test_a_stale_head_pid_file_never_kills_the_process_that_reused_the_pid(tmp_path: Path) -> None:
    workdir = tmp_path / "head"
    workdir.mkdir()
    head = {"address": "127.0.0.1", "workdir": str(workdir)}
    inv = InventorySpec.model_validate({"head": head, "hosts": [{"name": "a", "host": "h", "device": "x"}]})
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        (workdir / HEAD_PID).write_text(f"{bystander.pid}\n")  # the head died; its pid went to `sleep`
        assert stop_head(inv) == "stale pid file"
        time.sleep(0.2)
        assert bystander.poll() is None  # left alone
        assert not (workdir / HEAD_PID).exists()
        assert stop_head(inv) == "not running"
    finally:
        bystander.kill()
        bystander.wait()


def test_stop_head_ends_the_heads_tree_and_group_sigterm_first(tmp_path: Path) -> None:
    workdir = tmp_path / "head"
    workdir.mkdir()
    head_spec = {"address": "127.0.0.1", "workdir": str(workdir)}
    inv = InventorySpec.model_validate({"head": head_spec, "hosts": [{"name": "a", "host": "h", "device": "x"}]})
    log, pids = tmp_path / "log", tmp_path / "pids"
    # A stand-in for `ray start --head --block`: it exits on SIGTERM, one child ignores it, and an
    # orphan left its tree (not its process group).
    script = (
        f"trap 'echo term >> {log}; exit 0' TERM; (sleep 61 & echo $! >> {pids}); "
        f"(trap '' TERM; sleep 62) & echo $! >> {pids}; wait"
    )
    port, temp = str(inv.head.ray_port), str(workdir / "ray")
    argv = ["bash", "-c", script, "start", "--head", "--port", port, "--temp-dir", temp]
    head = subprocess.Popen(argv, start_new_session=True)
    try:
        (workdir / HEAD_PID).write_text(f"{head.pid}\n")
        deadline = time.monotonic() + 10
        while len(pids.read_text().split() if pids.exists() else []) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        left = [int(p) for p in pids.read_text().split()]
        assert stop_head(inv, grace=1.0) == "stopped"
        assert log.read_text() == "term\n"
        assert head.wait(5) == 0
        assert not [p for p in left if pid_alive(p)]
        assert not (workdir / HEAD_PID).exists()
    finally:
        head.kill()
        head.wait()
