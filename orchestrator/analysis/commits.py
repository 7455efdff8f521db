"""Commit comparisons in stored rows: which side of `--ref BASE --ref HEAD` a row is, and its label.

A command case with several refs writes each row with its commit (`commit`), the ref as given
(`extra['ref']`) and the ref's position (`extra['ref_index']` of `extra['refs']`; 0 is BASE, the
last is HEAD). The views that compare arms judge HEAD alone (`head_rows`), so BASE's samples never
pool with HEAD's; `orchestrate compare --by commit` puts the sides next to each other, labelled
`ref@commit` (`with_commit_sides`), BASE as the baseline (`base_side`).
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

COMMIT_SIDE = "commit_side"  # the column `with_commit_sides` adds


def extra_value(table: pa.Table, key: str) -> pa.Array:
    """`extra[key]` of every row (null where absent)."""
    if table.num_rows == 0:
        return pa.array([], pa.string())
    return pc.map_lookup(table["extra"], pa.scalar(key, pa.string()), "first")


def head_rows(table: pa.Table) -> pa.Table:
    """The rows without the BASE side(s) of commit comparisons: HEAD's rows and every other row."""
    if table.num_rows == 0:
        return table
    index = pc.cast(extra_value(table, "ref_index"), pa.int64())
    count = pc.cast(extra_value(table, "refs"), pa.int64())
    keep = pc.or_kleene(pc.is_null(index), pc.equal(index, pc.subtract(count, 1)))
    return table.filter(pc.fill_null(keep, True))


def commit_label(ref: str | None, commit: str) -> str:
    """`main@1a2b3c4d5e6f`: the ref as given and the commit it resolved to."""
    return f"{ref}@{commit[:12]}" if ref else commit[:12]


def with_commit_sides(table: pa.Table) -> pa.Table:
    """The table with `commit_side`: `ref@commit` of the engine's commit, else the code version.

    The code a kernel case measures is this checkout's (`code_version`); a command case's is the
    external commit it built.
    """
    refs = extra_value(table, "ref").to_pylist()
    commits = table["commit"].to_pylist()
    versions = table["code_version"].to_pylist()
    labels = [
        commit_label(ref, commit) if commit else str(version)
        for ref, commit, version in zip(refs, commits, versions, strict=True)
    ]
    return table.append_column(COMMIT_SIDE, pa.array(labels, pa.string()))


def base_side(table: pa.Table) -> str | None:
    """The BASE side's label in a table with `commit_side` (ref_index 0 of the newest run), or None."""
    if table.num_rows == 0 or COMMIT_SIDE not in table.column_names:
        return None
    base = table.filter(pc.fill_null(pc.equal(extra_value(table, "ref_index"), "0"), False))
    if base.num_rows == 0:
        return None
    newest = max(base["run_id"].to_pylist())
    labels = base.filter(pc.equal(base["run_id"], newest))[COMMIT_SIDE].to_pylist()
    return str(labels[0])


def match_side(table: pa.Table, name: str) -> str:
    """The `commit_side` label `name` means: itself, a ref (`main`) or a commit prefix (`1a2b3c`)."""
    labels = sorted(set(table[COMMIT_SIDE].to_pylist())) if COMMIT_SIDE in table.column_names else []
    if name in labels:
        return name
    hits = [
        label
        for label in labels
        if label.split("@")[0] == name or (len(name) >= 4 and label.split("@")[-1].startswith(name[:12]))
    ]
    return hits[0] if len(hits) == 1 else name


def compared_refs(table: pa.Table) -> int:
    """How many commits the table's commit comparisons put side by side (1: none)."""
    if table.num_rows == 0:
        return 1
    counts = [int(c) for c in extra_value(table, "refs").to_pylist() if c]
    return max(counts, default=1)
