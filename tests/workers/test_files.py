"""The one atomic writer: whole files or none, no temporary files left, and result files readable by
the team unless the umask says otherwise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import BinaryIO

import pytest

from workers.files import atomic_file, write_atomic

PROBE = (
    "import os, sys, pyarrow as pa; from pathlib import Path; os.umask(int(sys.argv[2], 8)); "
    "from workers.files import write_parquet_atomic as w; "
    "print(oct(w(pa.table({'x': [1]}), Path(sys.argv[1])).stat().st_mode & 0o777))"
)


@pytest.mark.parametrize(("umask", "mode"), [("022", "0o644"), ("002", "0o664"), ("077", "0o600")])
def test_a_written_fragment_takes_the_mode_the_umask_gives_a_new_file(tmp_path: Path, umask: str, mode: str) -> None:
    # mkstemp alone makes 0600, which hid the results from a team's analytics user.
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path / "part.parquet"), umask], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == mode


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "peaks" / "peaks.json"
    write_atomic(path, "old")

    def half_then_fail(fh: BinaryIO) -> None:
        fh.write(b"new, half writ")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, half_then_fail)
    assert path.read_text() == "old"
    assert sorted(p.name for p in path.parent.iterdir()) == ["peaks.json"]


CRASH = (
    "import os, sys; from pathlib import Path; from workers.files import write_atomic; "
    "write_atomic(Path(sys.argv[1]), lambda fh: (fh.write(b'new, half'), fh.flush(), os.kill(os.getpid(), 9)))"
)


def test_a_writer_killed_mid_write_leaves_the_old_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "crontab"
    write_atomic(path, b"old\n")
    done = subprocess.run([sys.executable, "-c", CRASH, str(path)], capture_output=True, check=False)
    assert done.returncode == -9
    assert path.read_bytes() == b"old\n"


def test_two_writers_of_one_path_never_share_a_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "index" / "index.parquet"
    with atomic_file(path) as first, atomic_file(path) as second:  # both open at once
        assert first.name != second.name
        first.write(b"first, and longer")
        second.write(b"second")
    assert path.read_bytes() == b"first, and longer"  # the last rename wins, whole
    assert sorted(p.name for p in path.parent.iterdir()) == ["index.parquet"]


def test_text_bytes_and_a_mode(tmp_path: Path) -> None:
    key = write_atomic(tmp_path / "sub" / "key", b"\x00secret", mode=0o600, durable=False)
    assert key.read_bytes() == b"\x00secret" and key.stat().st_mode & 0o777 == 0o600
    with atomic_file(tmp_path / "report.csv", text=True) as fh:
        fh.write("a,b\r\nü,2\n")  # written as given, in UTF-8
    assert (tmp_path / "report.csv").read_bytes() == "a,b\r\nü,2\n".encode()
