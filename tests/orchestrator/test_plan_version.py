"""The code version in every row and job: a commit, and a distinct version per uncommitted edit."""

from __future__ import annotations

import subprocess
from pathlib import Path

from orchestrator.run.code_version import code_version


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout.strip()


def test_each_uncommitted_edit_of_the_measured_code_is_its_own_version(tmp_path: Path) -> None:
    root = tmp_path / "checkout"
    for d in ("orchestrator", "workers", "kernels", "docs"):
        (root / d).mkdir(parents=True)
    (root / "kernels" / "gemv.py").write_text("BLOCK = 128\n")
    (root / "docs" / "notes.md").write_text("notes\n")
    _git(root, "init", "-q")
    _git(root, "-c", "user.email=t@t", "-c", "user.name=t", "add", ".")
    _git(root, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "c")
    head = _git(root, "rev-parse", "--short=12", "HEAD")
    assert code_version(root) == head

    (root / "docs" / "notes.md").write_text("other notes\n")  # not measured code
    assert code_version(root) == head
    (root / "kernels" / "gemv.py").write_text("BLOCK = 256\n")
    first = code_version(root)
    (root / "kernels" / "gemv.py").write_text("BLOCK = 512\n")
    second = code_version(root)
    assert first.startswith(f"{head}-dirty.") and second.startswith(f"{head}-dirty.") and first != second
    (root / "kernels" / "gemv.py").write_text("BLOCK = 256\n")
    assert code_version(root) == first  # the same edit, the same version

    (root / "kernels" / "gemv.py").write_text("BLOCK = 128\n")
    (root / "workers" / "new_probe.py").write_text("X = 1\n")  # a new, untracked module
    added = code_version(root)
    assert added.startswith(f"{head}-dirty.") and added not in (first, second)
    (root / "workers" / "new_probe.py").write_text("X = 2\n")
    assert code_version(root) != added
