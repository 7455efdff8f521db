"""What a host has, seen over SSH: OS, home, Python and Ray versions, lock holder, last job.

Ray refuses a node whose Python (to the patch level) or Ray version differs from the head's, so
`version_problems` compares both exactly and `cluster up` reports every host's problems at once.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from orchestrator.cluster.ssh import RemoteShell, shell_path
from orchestrator.cluster.target import SshTarget
from orchestrator.errors import InfrastructureError
from orchestrator.specs.sweep import HostSpec
from workers.job.spool import parse_fragment_name

# One quick look that imports nothing heavy: find_spec and package metadata only.
_VERSIONS = (
    "import platform, importlib.util as u, importlib.metadata as m; "
    "print(platform.python_version()); "
    "print(m.version('ray') if u.find_spec('ray') else '-'); "
    "print('yes' if u.find_spec('workers') and u.find_spec('kernels') else 'no')"
)


@dataclass
class HostProbe:
    """The answers of one host (None where it could not be asked)."""

    name: str
    reachable: bool
    error: str | None = None
    os: str = "?"
    home: str = "~"
    python: str | None = None
    ray: str | None = None
    workers: bool | None = None


def probe(shell: RemoteShell, host: HostSpec) -> HostProbe:
    """Ask a connected host for its OS, home and the versions its Python sees."""
    found = HostProbe(host.name, reachable=True)
    sysinfo = shell.run(["sh", "-c", 'uname -s; printf %s "$HOME"'], timeout=host.connect_timeout + 20)
    lines = sysinfo.stdout.splitlines()
    found.os = lines[0].strip() if lines else "?"
    found.home = lines[1].strip() if len(lines) > 1 else "~"
    versions = shell.run([host.python, "-c", _VERSIONS], timeout=host.connect_timeout + 60)
    if versions.exit_code == 127 or not versions.stdout.strip():
        found.error = f"Python {host.python} not found or not working: {versions.last_error_line()}"
        return found
    out = versions.stdout.split()
    found.python = out[0]
    found.ray = None if len(out) < 2 or out[1] == "-" else out[1]
    found.workers = len(out) > 2 and out[2] == "yes"
    return found


def probe_host(host: HostSpec) -> HostProbe:
    """Connect to a host and probe it; an unreachable host is a probe with its reason."""
    try:
        with RemoteShell.connect(SshTarget.from_host(host)) as shell:
            return probe(shell, host)
    except InfrastructureError as exc:
        return HostProbe(host.name, reachable=False, error=exc.message)


def version_problems(found: HostProbe, head_python: str, head_ray: str) -> list[str]:
    """Why this host's Ray node could not join a head with these versions (empty: it can)."""
    if not found.reachable or found.python is None:
        return [found.error or "unreachable"]
    problems = []
    if found.python != head_python:
        problems.append(f"Python {found.python} != head {head_python}")
    if found.ray is None:
        problems.append(f"Ray not installed (head has {head_ray})")
    elif found.ray != head_ray:
        problems.append(f"Ray {found.ray} != head {head_ray}")
    if found.workers is False:
        problems.append(
            "orchestrate's worker packages (workers, kernels) are not installed for that Python "
            "(`cluster up --install` installs them)"
        )
    return problems


def lock_holder(shell: RemoteShell, host: HostSpec) -> str:
    """Who holds the host's GPU lock, from `<lock>.holder` (`free` when there is none); on a host
    with `gpus`, who holds each GPU's (`gpu1: pid 123 (job: ...)`; `free` when none is held)."""
    if host.gpus is None:
        return _holder(shell, host.lock + ".holder")
    listed = shell.run_script(f"ls -1 {shell_path(host.lock)}.gpu*.holder 2>/dev/null").stdout.split()
    held = []
    for path in sorted(listed, key=lambda p: (len(p), p)):
        index = path.removeprefix(host.lock + ".gpu").removesuffix(".holder")
        if index.isdigit():
            held.append(f"gpu{index}: {_holder(shell, path)}")
    return "; ".join(held) or "free"


def _holder(shell: RemoteShell, path: str) -> str:
    res = shell.run_script(f"cat {shell_path(path)} 2>/dev/null")
    if not res.ok or not res.stdout.strip():
        return "free"
    fields = dict(line.split("=", 1) for line in res.stdout.splitlines() if "=" in line)
    pid = fields.get("pid", "?")
    if pid.isdigit() and not shell.run(["kill", "-0", pid]).ok:
        return f"free (stale holder file: pid {pid} is gone)"
    return f"pid {pid} ({fields.get('mode', '?')}: {fields.get('cmd', '?')})"


def last_job(shell: RemoteShell, spool: str) -> str:
    """The newest fragment in the host's spool: `<job key> <UTC time>` (or `-`)."""
    newest: tuple[float, str] | None = None
    for _, entry in shell.walk(spool):
        parsed = parse_fragment_name(entry.filename)
        if parsed and entry.st_mtime is not None and (newest is None or entry.st_mtime > newest[0]):
            newest = (float(entry.st_mtime), parsed[1])
    if newest is None:
        return "-"
    when = dt.datetime.fromtimestamp(newest[0], dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    return f"{newest[1]} {when}"
