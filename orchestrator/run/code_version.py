"""The code version every row and job carries: this checkout's commit, and a distinct one per uncommitted edit.

Its own module, so that `orchestrate --version` asks git and nothing else (no sweep models).
"""

from __future__ import annotations

import hashlib
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def code_version(root: Path | None = None) -> str:
    """The commit of this checkout, or the version where there is no checkout.

    Uncommitted changes to the measured code (orchestrator/, workers/, kernels/) add `-dirty.`
    and a hash of their diff: two different edits of one commit are two versions (in the rows, in
    a job's key, and for a worker's fork server, which is restarted for a new version rather
    than forking jobs from the old code).
    """
    root = root or Path(__file__).resolve().parents[2]
    paths = ["--", "orchestrator", "workers", "kernels"]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        diff = subprocess.run(
            ["git", "-C", str(root), "diff", "HEAD", "--no-ext-diff", "--binary", *paths],
            capture_output=True,
            check=True,
        ).stdout
        new_files = subprocess.run(
            ["git", "-C", str(root), "ls-files", "--others", "--exclude-standard", "-z", *paths],
            capture_output=True,
            check=True,
        ).stdout.split(b"\0")
        digest = hashlib.sha256(diff)
        for name in sorted(f for f in new_files if f):
            digest.update(b"\0" + name + b"\0" + (root / name.decode()).read_bytes())
        if not diff and not any(new_files):
            return head
        return f"{head}-dirty.{digest.hexdigest()[:8]}"
    except (OSError, subprocess.CalledProcessError):
        try:
            return version("orchestrate")
        except PackageNotFoundError:
            return "unknown"
