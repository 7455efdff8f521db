"""`collect_spooled`: fetch the rows workers spooled that never reached the head's store.

Every job's fragment stays in its host's spool (`workers.job.spool`) after the head stored it. A
fragment whose `part-<run>-<job>.parquet` is not in the store (the head was killed, the
connection dropped, the head's disk was full) is copied over SFTP and imported into the store;
fragments already there are left alone, so `collect` can run any number of times. A fragment of
a job that is already complete in the store (a later run measured it again) is left alone too:
importing it would count that job's samples twice.
"""

from __future__ import annotations

import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from orchestrator.cluster.lifecycle import spool_dir
from orchestrator.cluster.ssh import RemoteShell
from orchestrator.cluster.target import SshTarget
from orchestrator.errors import InfrastructureError, InputError
from orchestrator.specs.sweep import HostSpec, InventorySpec
from orchestrator.store.fragments import ResultStore
from orchestrator.store.incoming import import_fragment
from workers.job.spool import parse_fragment_name


@dataclass
class HostCollection:
    """What `collect` found and fetched on one host."""

    name: str
    spooled: int = 0
    fetched: list[Path] = field(default_factory=list)
    error: str | None = None


def stored_names(store: ResultStore) -> set[str]:
    """File names of every fragment already in the store."""
    return {f.path.name for f in store.fragments()}


def collect_spooled(inventory: InventorySpec, store: ResultStore) -> list[HostCollection]:
    """For each host: list its spool, fetch and import each fragment the store lacks."""
    store.ensure_writable()
    have = stored_names(store)
    complete = store.complete_job_keys()
    remote = [h for h in inventory.hosts if h.host is not None]
    if not remote:
        raise InfrastructureError("the inventory has no SSH hosts: an embedded run stores its rows itself")

    def fetch(host: HostSpec) -> tuple[HostCollection, list[tuple[str, bytes]]]:
        found = HostCollection(host.name)
        blobs: list[tuple[str, bytes]] = []
        try:
            with RemoteShell.connect(SshTarget.from_host(host)) as shell:
                home = shell.run(["sh", "-c", 'printf %s "$HOME"']).stdout
                paths = [p for p in shell.walk_files(spool_dir(host, home), ".parquet") if parse_fragment_name(p)]
                found.spooled = len(paths)
                with tempfile.TemporaryDirectory(prefix="orchestrate-collect-") as tmp:
                    for path in paths:
                        name = path.rsplit("/", 1)[-1]
                        parsed = parse_fragment_name(name)
                        if name in have or (parsed is not None and parsed[1] in complete):
                            continue
                        local = Path(tmp) / name
                        shell.get(path, local)
                        blobs.append((name, local.read_bytes()))
        except InfrastructureError as exc:
            found.error = exc.message
        return found, blobs

    with ThreadPoolExecutor(max_workers=min(8, len(remote))) as pool:
        results = list(pool.map(fetch, remote))
    out = []
    with tempfile.TemporaryDirectory(prefix="orchestrate-import-") as tmp:
        for found, blobs in results:
            for name, blob in blobs:
                local = Path(tmp) / name
                local.write_bytes(blob)
                try:
                    found.fetched.append(import_fragment(store, local))
                except InputError as exc:  # unreadable, or a value that would leave the store: refused
                    found.error = f"{name}: {exc.message}"
                except (OSError, pa.ArrowException) as exc:
                    found.error = f"{name}: not stored ({str(exc).splitlines()[0]})"
                have.add(name)
            out.append(found)
    return out
