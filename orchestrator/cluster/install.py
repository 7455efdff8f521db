"""`cluster up --install`: put orchestrate's worker packages on a host that lacks them.

The head ships the source of the commit it runs (`git archive HEAD`, so what the host installs is
exactly the `code_version` its rows will carry) over SFTP into the host's work dir and runs
`python -m pip install` there with the host's own Python. The project's pinned dependencies
(Ray, MLX, pyarrow, pydantic, ...) come with it from the host's package index, so a host whose Ray
differs from the head's is brought to the same pin. A Python version that differs cannot be fixed
this way: Ray needs the same interpreter version, so that host is reported, not changed.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from orchestrator.cluster.hostprobe import HostProbe
from orchestrator.cluster.ssh import RemoteShell
from orchestrator.cluster.target import SshTarget
from orchestrator.errors import InfrastructureError
from orchestrator.specs.sweep import HostSpec

REPO = Path(__file__).resolve().parents[2]
ARCHIVE = "orchestrate-src.tar.gz"
PIP_TIMEOUT = 1800.0  # a first install of MLX and Ray from an index takes minutes


def source_archive(out_dir: Path) -> Path:
    """`git archive` of the checkout's HEAD as a pip-installable tarball in `out_dir`."""
    if not (REPO / ".git").exists() or not (REPO / "pyproject.toml").exists():
        raise InfrastructureError(f"--install needs the head to run from a git checkout of orchestrate (not {REPO})")
    out = out_dir / ARCHIVE
    proc = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar.gz", "--prefix=orchestrate/", "-o", str(out), "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise InfrastructureError(f"git archive of {REPO} failed: {proc.stderr.strip()}")
    return out


def installable(found: HostProbe, head_python: str) -> bool:
    """True when installing packages can fix this host (reachable, same Python as the head)."""
    return found.reachable and found.python == head_python


# The MLX backend extra (pyproject.toml) a host's inventory backend needs. ROCm has no MLX wheel
# on PyPI: such a host keeps the MLX it has (its own build), which pip finds already satisfied.
BACKEND_EXTRAS = {"cpu": "cpu", "cuda": "cuda", "metal": "metal", "rocm": ""}


def install_spec(remote_archive: str, backend: str) -> str:
    """What pip installs on a host: the archive with the MLX backend extra of its backend."""
    extra = BACKEND_EXTRAS.get(backend, "")
    return f"{remote_archive}[{extra}]" if extra else remote_archive


def install_worker_packages(host: HostSpec, found: HostProbe, archive: Path) -> None:
    """Copy the source archive to the host and pip-install it (with its backend's MLX) with the host's Python."""
    workdir = host.workdir if not host.workdir.startswith("~") else found.home + host.workdir[1:]
    remote = f"{workdir}/{ARCHIVE}"
    with RemoteShell.connect(SshTarget.from_host(host)) as shell:
        shell.mkdir_p(workdir)
        shell.put(archive, remote, mode=0o600)
        spec = install_spec(remote, host.backend)
        res = shell.run([host.python, "-m", "pip", "install", "--quiet", spec], timeout=PIP_TIMEOUT)
    if not res.ok:
        raise InfrastructureError(f"host {host.name!r}: pip install of orchestrate failed: {res.last_error_line()}")
