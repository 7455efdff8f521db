"""Result files: atomic, and readable by the team unless the umask says otherwise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
