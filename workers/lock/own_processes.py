"""Which processes on this host are the orchestrator's own, so that no probe calls them foreign.

The GPU-user probes (`workers.lock.probes`) flag every process that uses the device, or keeps a CPU
busy, and is not ours. Ours, on a host, are exactly:

* the job's own tree: the job's worker process (or the outer lock holder named by
  `ROCM_GPU_GUARD_LOCK_HELD`, when it is a real ancestor) and all its descendants;
* the Ray node the job runs on: the process that started the node's raylet (the embedded head,
  `orchestrate run` itself, or the `ray start --block` that `orchestrate cluster up` left running)
  and all its descendants: GCS, the dashboard and its agents, the log monitor, the raylet and its
  worker processes. The raylet is found through `RAY_RAYLET_PID`, which Ray sets in every worker
  it starts and which the job's process inherits. A raylet whose parent is an init process
  (pid 1, a daemonised `ray start`) roots the tree itself;
* every daemon of our Ray cluster on this host, the head's and other nodes' included: they are
  started with the cluster's session (`/tmp/ray/session_<date>_<pid>`, one name for every node of
  a cluster) in their command line, which the raylet's own command line names;
* the head, named by `ORCHESTRATE_HEAD` (`host:pid`, set by the head for its tasks) when this is
  its host, or by `ORCHESTRATE_HEAD_PID` (an embedded run's head) when it is an ancestor of the
  raylet.

Anything else is foreign, whatever its name: a process called `raylet` outside our node's tree and
session is still a foreign user.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from workers.proc.table import is_descendant, parent_pid, process_cmdline

RAYLET_ENV = "RAY_RAYLET_PID"
HEAD_ENV = "ORCHESTRATE_HEAD_PID"  # an embedded run's head (an ancestor of its raylet)
HEAD_AT_ENV = "ORCHESTRATE_HEAD"  # `hostname:pid` of the head, for its tasks on any host
_SESSION_RE = re.compile(r"/(session_\d{4}-\d{2}-\d{2}_[0-9_-]+)")

# pid -> (parent pid, CPU seconds, name): a process-table snapshot (`workers.proc.table.cpu_times`)
ProcessTable = Mapping[int, tuple[int, float, str]]


def _env_pid(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 1 else None


def _session(pid: int) -> str | None:
    """The Ray session name (`session_2026-12-01_09-13-42_606965_29842`) a process was started with."""
    match = _SESSION_RE.search("\0".join(process_cmdline(pid)))
    return match.group(1) if match else None


@dataclass(frozen=True)
class OwnProcesses:
    """The roots of our process trees on this host, and the node's Ray session directory.

    Attributes:
        roots: Processes whose descendants (and themselves) are ours.
        session: The Ray session name of the job's cluster, or None outside Ray.
    """

    roots: tuple[int, ...]
    session: str | None = None

    def contains(self, pid: int, table: ProcessTable | None = None) -> bool:
        """Whether `pid` is one of ours (a root, a descendant of a root, or a daemon of our Ray session)."""
        if pid == os.getpid() or pid in self.roots:
            return True
        if any(_descends(pid, root, table) for root in self.roots):
            return True
        return self.session is not None and _session(pid) == self.session


def _descends(pid: int, root: int, table: ProcessTable | None) -> bool:
    """Whether `root` is `pid` or one of its ancestors (from a snapshot when given, else live)."""
    if table is None:
        return is_descendant(pid, root)
    seen = 0
    while pid > 1 and seen < 512:
        if pid == root:
            return True
        entry = table.get(pid)
        if entry is None:
            return False
        pid = entry[0]
        seen += 1
    return pid == root


def own_processes(job_root: int) -> OwnProcesses:
    """Our process trees on this host for a job whose tree starts at `job_root` (module docstring)."""
    roots = [job_root, os.getpid()]
    session: str | None = None
    raylet = _env_pid(RAYLET_ENV)
    if raylet is not None and is_descendant(os.getpid(), raylet):
        session = _session(raylet)
        parent = parent_pid(raylet)
        # a node started by `ray start --block` or by an embedded head: its starter roots the tree
        roots.append(parent if parent is not None and parent > 1 and not _is_init(parent) else raylet)
        head = _env_pid(HEAD_ENV)
        if head is not None and is_descendant(raylet, head):
            roots.append(head)
    host, _, pid = os.environ.get(HEAD_AT_ENV, "").rpartition(":")
    if host == socket.gethostname() and pid.isdigit() and int(pid) > 1:
        roots.append(int(pid))
    return OwnProcesses(tuple(dict.fromkeys(roots)), session)


def _is_init(pid: int) -> bool:
    """pid 1, or a process that adopts orphans as init does (systemd --user, tini, a container's init)."""
    if pid == 1:
        return True
    argv = process_cmdline(pid)
    return bool(argv) and os.path.basename(argv[0]) in ("systemd", "init", "tini", "dumb-init", "launchd")
