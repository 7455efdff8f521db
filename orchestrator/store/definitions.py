"""The sweep definition a stored run ran, read from its fragments' footers.

`orchestrator.run.sweep` writes the definition (`orchestrator.specs.definition`) into the footer of
every fragment of a run; a compacted file keeps each job's footer keys in its index, and `import`
copies footers as they are, so the definition is found wherever the run's rows are. A run stored
before definitions were (or rows collected from a worker's spool) has none: the caller falls back
to the sweep file, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.store.footer import compact_index
from orchestrator.store.fragments import ResultStore
from workers.contract import META_SWEEP_DEFINITION, META_SWEEP_DIGEST, META_SWEEP_SOURCE
from workers.job.spool import parse_fragment_name


@dataclass(frozen=True)
class StoredDefinition:
    """The sweep one stored run ran: its run id, digest, source file and canonical JSON
    (`orchestrator.specs.definition.stored_spec` validates it again)."""

    run_id: str
    digest: str
    source: str
    text: str


# The same keys as a compacted file's index names them (footer keys less `orchestrate.`).
INDEX_KEYS = tuple(k.decode().removeprefix("orchestrate.") for k in (META_SWEEP_DEFINITION, META_SWEEP_DIGEST))


def newest_run(store: ResultStore, sweep: str) -> str | None:
    """The newest stored run of `sweep` (run ids sort by their start time), or None."""
    runs = store.run_ids(sweep)
    return max(runs) if runs else None


def run_definition(store: ResultStore, sweep: str, run_id: str) -> StoredDefinition | None:
    """The definition stored with run `run_id` of `sweep`: the first of its jobs that carries one."""
    for f in store.files(sweep):
        if f.compacted:
            meta = store.footer(f.path) or {}
            for job in compact_index(meta):
                if job.get("run_id") == run_id and all(job.get(k) for k in INDEX_KEYS):
                    return StoredDefinition(run_id, job[INDEX_KEYS[1]], job.get("sweep_source", ""), job[INDEX_KEYS[0]])
            continue
        parsed = parse_fragment_name(f.path.name)
        if parsed is None or parsed[0] != run_id:
            continue
        meta = store.footer(f.path) or {}
        if META_SWEEP_DEFINITION in meta and META_SWEEP_DIGEST in meta:
            return StoredDefinition(
                run_id,
                meta[META_SWEEP_DIGEST].decode(),
                meta.get(META_SWEEP_SOURCE, b"").decode(),
                meta[META_SWEEP_DEFINITION].decode(),
            )
    return None
