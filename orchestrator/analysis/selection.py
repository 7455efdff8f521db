"""Which stored rows a comparison reads: the sweep (by stored name, built-in name or file), the
runs (the newest of each point, or all, or one), and the sides named on the command line.

`compare_stored` is `orchestrate compare`'s library call: these rows, compared by
`orchestrator.analysis.compare.compare_results`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from orchestrator.analysis import stats
from orchestrator.analysis.commits import match_side, with_commit_sides
from orchestrator.analysis.compare import SIDE_COLUMNS, CompareResult, compare_results
from orchestrator.errors import InputError
from orchestrator.specs.definition import differences, digest, shown, stored_spec
from orchestrator.specs.sweep import SweepSpec, builtin_sweeps, load_sweep
from orchestrator.store.dataset import read_rows
from orchestrator.store.definitions import StoredDefinition, newest_run, run_definition
from orchestrator.store.fragments import ResultStore


@dataclass(frozen=True)
class SweepChoice:
    """The sweep a command judges: its stored name, its spec (None when none is known) and, when
    the definition stored with the judged run and the file of that name disagree, one line saying
    which decided and what differs."""

    name: str | None
    spec: SweepSpec | None
    note: str = ""
    stored: bool = False  # the spec is the definition stored with the judged run


def _is_file(sweep: str) -> bool:
    return sweep.endswith(".toml") or "/" in sweep or Path(sweep).is_file()


def _file_on_disk(name: str) -> tuple[str, SweepSpec] | None:
    """The file a user means by `name`: `./NAME.toml` when it is that sweep, else the built-in one."""
    local = Path(f"{name}.toml")
    if local.is_file():
        try:
            spec = load_sweep(str(local))
        except InputError:
            spec = None  # not loadable: not what the user ran, so not what is compared
        if spec is not None and spec.name == name:
            return f"./{local}", spec
    if name in builtin_sweeps():
        return f"the built-in {name}", load_sweep(name)
    return None


def _stored(store: ResultStore, name: str, run: str | None) -> StoredDefinition | None:
    judged = run or newest_run(store, name)
    return run_definition(store, name, judged) if judged else None


def choose_sweep(store: ResultStore, sweep: str | None, run: str | None = None) -> SweepChoice:
    """The sweep a command judges: given a file, that file; given a name, the definition stored
    with the judged run (`run`, else the newest of that name), falling back to the built-in file
    for runs stored without one.

    Raises:
        InputError: a sweep file is bad, or no sweep is named and several are stored.
    """
    if sweep is not None and _is_file(sweep):
        spec = load_sweep(sweep)
        stored = _stored(store, spec.name, run)
        if stored is None or stored.digest == digest(spec):
            return SweepChoice(spec.name, spec)
        ran = stored_spec(stored.text)
        what = shown(differences(ran, spec)) if ran is not None else "a definition this orchestrate cannot read"
        return SweepChoice(
            spec.name,
            spec,
            f"judged by {sweep} as given, not by the sweep stored with run {stored.run_id} "
            f"(digest {stored.digest}, from {stored.source or 'unknown'}): they differ ({what})",
        )
    name = sweep
    if name is None:
        names = store.sweep_names()
        if len(names) > 1:
            raise InputError(f"results of several sweeps are stored ({', '.join(names)}); choose one with --sweep")
        name = names[0] if names else None
    if name is None:
        return SweepChoice(None, None)
    stored = _stored(store, name, run)
    ran = stored_spec(stored.text) if stored is not None else None
    disk = _file_on_disk(name)
    if stored is None or ran is None:  # stored before definitions were, or no longer valid: the file, as before
        note = ""
        if stored is not None and disk is not None:
            note = f"the sweep stored with run {stored.run_id} is not readable by this orchestrate; judged by {disk[0]}"
        return SweepChoice(name, disk[1] if disk else None, note)
    if disk is None or digest(disk[1]) == stored.digest:
        return SweepChoice(name, ran, stored=True)
    return SweepChoice(
        name,
        ran,
        f"judged by the sweep stored with run {stored.run_id} (digest {stored.digest}, from "
        f"{stored.source or 'unknown'}): it differs from {disk[0]} ({shown(differences(ran, disk[1]))})",
        stored=True,
    )


def resolve_sweep(store: ResultStore, sweep: str | None) -> tuple[str | None, SweepSpec | None]:
    """The stored name of a sweep given by name, built-in name or file, and its spec when there is
    one (`choose_sweep`, for the newest run).

    Raises:
        InputError: a sweep file is bad, or no sweep is named and several are stored.
    """
    choice = choose_sweep(store, sweep)
    return choice.name, choice.spec


def select_results(
    store: ResultStore,
    sweep: str | None,
    run: str | None,
    *,
    all_runs: bool = False,
    runs: Sequence[str] | None = None,
    say: Callable[[str], None] | None = None,
) -> tuple[pa.Table, SweepSpec | None]:
    """The rows a command works on (selected in DuckDB), and the sweep's spec when it can be found.

    Args:
        store: the result store.
        sweep: a stored sweep's name, a built-in sweep or a sweep file; None: the only stored sweep.
        run: only this run id.
        all_runs: pool every run's samples instead of keeping the newest run of each point.
        runs: only these run ids (every one must have rows).
        say: given `choose_sweep`'s line, when the stored definition and the file disagree.

    Raises:
        InputError: nothing is stored, several sweeps are and none was named, or a run has no rows.
    """
    choice = choose_sweep(store, sweep, run)
    name, spec = choice.name, choice.spec
    if choice.note and say is not None:
        say(choice.note)
    wanted = [run] if run else list(dict.fromkeys(runs)) if runs else None
    table = read_rows(store, sweep=name, runs=wanted, newest=wanted is None and not all_runs)
    if table.num_rows == 0:
        what = f" for sweep {name!r}" if name else ""
        what += f" and run {', '.join(wanted)}" if wanted else ""
        raise InputError(f"no results stored{what}", where=str(store.root))
    missing = sorted(set(wanted or []) - set(pc.unique(table["run_id"]).to_pylist()))
    if missing:
        raise InputError(f"run {', '.join(missing)}: no rows of sweep {name!r} (`orchestrate runs` lists them)")
    if choice.stored and spec is not None:
        table = _within(table, spec)
    return table, spec


def _within(table: pa.Table, spec: SweepSpec) -> pa.Table:
    """The rows of the cases and devices `spec` names: a built-in sweep and a user's edited copy of
    it share a name, and the one being judged must not show the other's devices or cases."""
    keep = pc.is_in(table["case_name"], value_set=pa.array([entry.label for entry in spec.cases]))
    if spec.devices:
        keep = pc.and_(keep, pc.is_in(table["device"], value_set=pa.array(spec.devices)))
    return table.filter(keep)


def resolve_side(name: str, available: Sequence[str], what: str) -> str:
    """A side named exactly, or by a unique prefix (a short commit or run id).

    Raises:
        InputError: no side, or several, start with `name`.
    """
    if name in available:
        return name
    matches = [a for a in available if a.startswith(name)]
    if len(matches) == 1:
        return matches[0]
    listing = ", ".join(sorted(available)[:12]) + (" ..." if len(available) > 12 else "")
    if matches:
        raise InputError(f"{what} {name!r} is ambiguous: {', '.join(sorted(matches))}")
    raise InputError(f"{what} {name!r}: none stored (there are: {listing})")


def compare_stored(
    store: ResultStore,
    *,
    sweep: str | None = None,
    run: str | None = None,
    by: str = "arm",
    baseline: str | None = None,
    contenders: Sequence[str] | None = None,
    arms: Sequence[str] | None = None,
    metrics: Sequence[str] | None = None,
    threshold: float = stats.THRESHOLD,
    all_runs: bool = False,
    say: Callable[[str], None] | None = None,
) -> tuple[CompareResult, pa.Table, SweepSpec | None]:
    """`orchestrate compare`: select the rows (only the named runs when comparing runs) and compare them.

    Args:
        store: the result store.
        sweep: see `select_results`.
        run: only this run (not with `by="run"`).
        by: what is compared: `arm`, `run`, `commit` or `device`.
        baseline: the side the others are compared with (a run or commit may be a unique prefix).
        contenders: only these sides against the baseline (None: every other side).
        arms, metrics, threshold: see `compare_results`.
        all_runs: pool every run's samples (implied by `by` run or commit).
        say: see `select_results`.

    Returns:
        The comparison, the rows it was made of, and the sweep's spec when known.

    Raises:
        InputError: bad names, no rows, or only one side: nothing to compare.
    """
    named = [n for n in (baseline, *(contenders or [])) if n]
    runs = None
    if by == "run" and named:
        stored = sorted(store.run_ids(resolve_sweep(store, sweep)[0]))
        runs = [resolve_side(n, stored, "run") for n in named]
    table, spec = select_results(store, sweep, run, all_runs=all_runs or by in ("run", "commit"), runs=runs, say=say)
    sided = with_commit_sides(table) if by == "commit" else table
    column = SIDE_COLUMNS.get(by, by)
    available = pc.unique(sided[column]).to_pylist() if column in sided.column_names else []

    def side_named(name: str) -> str:  # a commit side also by its ref (`main`) or a commit prefix
        return resolve_side(match_side(sided, name) if by == "commit" else name, available, by)

    if by in ("commit", "device", "run") and named:
        baseline = side_named(baseline) if baseline else None
        contenders = [side_named(c) for c in contenders or []]
    preferred = baseline or (spec.baseline if spec is not None and by == "arm" else None)
    if baseline is None and arms and preferred not in arms:
        preferred = None  # the sweep's baseline is left out: `affine` or the first of --arms
    sides = [*([preferred] if preferred and contenders else []), *(contenders or [])] or None
    order = [a for case in spec.cases for a in case.arm_names()] if spec is not None and by == "arm" else None
    result = compare_results(
        table, by=by, baseline=preferred, threshold=threshold, arms=arms, metrics=metrics, order=order, sides=sides
    )
    if len(result.sides) < 2:
        only = result.sides[0] if result.sides else "none"
        hint = {
            "run": "; run the sweep again, or list the runs with `orchestrate runs`",
            "commit": "; the rows were all measured at one commit",
            "device": "; the rows were all measured on one device kind",
        }.get(by, "; `orchestrate results` shows the numbers")
        raise InputError(f"only one {by} in the selected rows ({only}): nothing to compare{hint}")
    return result, table, spec
