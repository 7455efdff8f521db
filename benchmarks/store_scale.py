"""The result store at scale: a synthetic year and more of nightly sweeps, and the readers' times on it.

    .venv/bin/python -m benchmarks.store_scale --root /tmp/store-scale [--fragments 100000] [--rounds 3]
    .venv/bin/python -m benchmarks.store_scale --root /tmp/store-scale --readers-only   # time the readers again
    .venv/bin/python -m benchmarks.store_scale --root /tmp/store-scale --readers-only --vs-code /tmp/main-tree

Builds (once; `--rebuild` to start again) a store of `--fragments` job fragments, each of 25 rows
written through the real `ResultStore.write` (the rows of each night's first job per device by the
real row builder, the rest from them by replacing the columns that differ, and no fsync per file:
see `night`; about 2.5x faster than building every job's rows and syncing each file, same bytes):
three nightly sweeps of 100 jobs a night (qmm at 50
token counts on two device kinds) and one wide sweep of 1,000 jobs a night, in the proportion
75 : 25, dates going back from today. Then measures, each in a fresh process (wall time and peak
resident memory, the median of `--rounds` after one warm-up):

* `orchestrate compare` and `orchestrate check` on one nightly sweep's newest run (`--format json`),
* `orchestrate query "select count(*) from results"`,
* resume's question, "which of the 1,000 jobs of the wide sweep's latest night are complete",

before `orchestrate compact` (whose own time is reported) and after it. Before compaction, compare's
first call builds the point index from nothing (it is removed first, as on a store just written).
`--vs-code DIR` times another checkout's readers (`git archive main | tar -x -C DIR`) on the same
store, the two taking turns call by call, and prints the ratios: a change measured side by side on
a machine whose load moves. Targets (issue 19): compare and check at most 15 s before and 3 s after
compaction, the count at most 2 s after it, resume at most 1 s, each under 1 GB.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from unittest import mock

import numpy as np
import pyarrow as pa

from orchestrator.store.fragments import ResultStore
from workers.contract import META_JOB_KEY, HostFingerprint, JobContext, JobSpec, RowBuilder

NIGHTLY = ("nightly-a", "nightly-b", "nightly-c")
WIDE = "wide"
DEVICES = ("h200", "m1-ultra")
TOKENS = [16 * (i + 1) for i in range(50)]
SAMPLES = 12  # per arm: 2 x 12 samples + 1 peak-memory row = 25 rows a job
BIN = Path(sys.executable).parent


def sweep_toml(name: str, tokens: list[int], devices: tuple[str, ...]) -> str:
    """The sweep file whose jobs the synthetic rows stand for (with one criterion, for `check`)."""
    return (
        f'name = "{name}"\ndevices = {json.dumps(list(devices))}\nrepetitions = {SAMPLES}\nwarmup = 1\n'
        'baseline = "affine"\n\n[[cases]]\ncase = "qmm"\narms = ["native", "affine"]\n'
        f'params = {{ tokens = {json.dumps(tokens)}, n = 4096, k = 4096, dtype = "bfloat16" }}\n\n'
        '[[criteria]]\nname = "native within 3 % of affine"\nmetric = "prefill_tok_s"\narm = "native"\n'
        "min_ratio = 0.97\n"
    )


def _fingerprint(device: str) -> HostFingerprint:
    return HostFingerprint(
        hostname=f"{device}-1", os="Linux-6.8", machine="x86_64", cpu="Xeon", cpu_count=64,
        memory_bytes=2**40, gpu=device, gpu_driver="570", mlx_version="0.32.4", mlx_device="Device(gpu, 0)",
        backend="cuda", threads=64, fingerprint_id=f"fp-{device}",
    )  # fmt: skip


def job_point(j: int) -> tuple[str, dict[str, int | float | str | bool]]:
    """The device and parameters of job `j` of a night (distinct for j < 1,000)."""
    tokens = TOKENS[(j // len(DEVICES)) % len(TOKENS)]
    n = 4096 + 64 * (j // (len(DEVICES) * len(TOKENS)))
    return DEVICES[j % len(DEVICES)], {"tokens": tokens, "n": n, "k": 4096, "dtype": "bfloat16"}


def job_key(sweep: str, j: int, date: dt.date) -> str:
    """Job `j`'s key on one night (a new key each night, as a nightly `ref` makes)."""
    device, params = job_point(j)
    return hashlib.sha256(f"{sweep}/{device}/{sorted(params.items())}/{date}".encode()).hexdigest()[:16]


def run_id_of(sweep: str, date: dt.date) -> str:
    """The run id of one sweep's night (started at 02:00 UTC)."""
    started = dt.datetime.combine(date, dt.time(2, 0), tzinfo=dt.UTC)
    return f"{started.strftime('%Y%m%dT%H%M%SZ')}-{hashlib.sha256(sweep.encode()).hexdigest()[:4]}"


def job_samples(rng: np.random.Generator) -> list[float]:
    """One job's measured values in its rows' order: native's samples, affine's, then the peak memory."""
    values = []
    for centre in (1000.0, 1020.0):
        values += [float(v) for v in centre * (1 + 0.03 * rng.standard_normal(SAMPLES))]
    return [*values, 37.2e9]


def job_rows(sweep: str, j: int, date: dt.date, values: list[float]) -> pa.Table:
    """Job `j`'s rows made by the real row builder, as a worker makes them (`values` from `job_samples`)."""
    device, params = job_point(j)
    job = JobSpec(
        run_id=run_id_of(sweep, date), sweep=sweep, job_key=job_key(sweep, j, date), case="qmm", case_name="qmm",
        params=params, arms=["native", "affine"], device=device, backend="cuda", repetitions=SAMPLES, warmup=1,
        code_version="abc1234",
    )  # fmt: skip
    started = dt.datetime.combine(date, dt.time(2, 0), tzinfo=dt.UTC)
    rows = RowBuilder(job, _fingerprint(device), JobContext(started_at=started))
    for a, arm in enumerate(("native", "affine")):
        for s in range(SAMPLES):
            rows.add(arm, "prefill_tok_s", values[a * SAMPLES + s], "tok/s", sample=s)
    rows.add("native", "peak_memory_bytes", values[-1], "bytes")
    return rows.table("ok")


def templated(template: pa.Table, sweep: str, j: int, date: dt.date, values: list[float]) -> pa.Table:
    """`job_rows(sweep, j, date, values)` made from another job of the same night and device, by
    replacing the columns that differ (job key, parameters, values) and the footer's job key."""
    _, params = job_point(j)
    key, n = job_key(sweep, j, date), template.num_rows
    table = template
    for name, value in (("job_key", key), ("tokens", params["tokens"]), ("n", params["n"])):
        column = table.schema.get_field_index(name)
        table = table.set_column(column, table.field(column), pa.array([value] * n, table.field(column).type))
    column = table.schema.get_field_index("params")
    text = [(k, str(v)) for k, v in sorted(params.items())]
    table = table.set_column(column, table.field(column), pa.array([text] * n, table.field(column).type))
    column = table.schema.get_field_index("value")
    table = table.set_column(column, table.field(column), pa.array(values, pa.float64()))
    return table.replace_schema_metadata({**(template.schema.metadata or {}), META_JOB_KEY: key.encode()})


def night(args: tuple[str, str, int, int, str]) -> int:
    """Write one sweep's jobs of one night through `ResultStore.write`; returns how many it wrote.

    The first job of each device is built by the real row builder, the others from it
    (`templated`: the same rows, column for column, 20x faster); the fsync of each file is left out
    (the bytes written are the same: only their durability differs, and this store is thrown away).
    """
    root, sweep, n_jobs, day_offset, today = args
    with mock.patch("os.fsync"):  # see the docstring
        return _night(ResultStore(root), sweep, n_jobs, day_offset, today)


def _night(store: ResultStore, sweep: str, n_jobs: int, day_offset: int, today: str) -> int:
    date = dt.date.fromisoformat(today) - dt.timedelta(days=day_offset)
    rng = np.random.default_rng(day_offset)
    templates: dict[str, pa.Table] = {}
    for j in range(n_jobs):
        device, _ = job_point(j)
        values = job_samples(rng)
        if device not in templates:
            templates[device] = table = job_rows(sweep, j, date, values)
        else:
            table = templated(templates[device], sweep, j, date, values)
        key = job_key(sweep, j, date)
        store.write(table, sweep=sweep, date=date, device=device, run_id=run_id_of(sweep, date), job_key=key)
    return n_jobs


def build(root: Path, fragments: int, workers: int) -> float:
    """Write the synthetic store; returns the seconds it took."""
    today = dt.datetime.now(dt.UTC).date().isoformat()
    wide_nights = max(1, fragments // 4 // 1000)
    nightly_nights = max(1, (fragments - wide_nights * 1000) // (100 * len(NIGHTLY)))
    tasks = [(str(root), s, 100, d, today) for d in range(nightly_nights) for s in NIGHTLY]
    tasks += [(str(root), WIDE, 1000, d, today) for d in range(wide_nights)]
    t0 = time.perf_counter()
    ResultStore(root).ensure_writable()
    with ProcessPoolExecutor(max_workers=workers) as pool:
        total = sum(pool.map(night, tasks, chunksize=4))
    seconds = time.perf_counter() - t0
    print(f"built {total} fragments in {seconds:.0f} s ({workers} processes)", flush=True)
    return seconds


RESUME = """
import resource, sys, time
from benchmarks.store_scale import latest_wide_keys
from orchestrator.store.fragments import ResultStore
keys = latest_wide_keys(sys.argv[1])
t0, c0 = time.perf_counter(), time.process_time()
done = ResultStore(sys.argv[1]).complete_job_keys("wide")
n = sum(k in done for k in keys)
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
assert n == len(keys) == 1000, n
print(wall, cpu, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""
REPO = Path(__file__).resolve().parents[1]


def latest_wide_keys(root: str) -> list[str]:
    """The job keys of the wide sweep's newest night (what a resumed run of it plans)."""
    today = dt.datetime.now(dt.UTC).date()
    return [job_key(WIDE, j, today) for j in range(1000)]


def timed(cmd: list[str], code: Path = REPO) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds (user + system) and peak resident MiB of one command in a fresh process,
    run with the `orchestrator` of the checkout `code` (its directory first on the path, and the cwd)."""
    wrapper = (
        "import resource, subprocess, sys, time; t = time.perf_counter(); "
        "r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True); "
        "w = time.perf_counter() - t; u = resource.getrusage(resource.RUSAGE_CHILDREN); "
        "print(w, u.ru_utime + u.ru_stime, u.ru_maxrss / 1024) if r.returncode in (0, 1, 4) "
        "else sys.exit('failed: ' + r.stderr[-2000:])"
    )
    env = {**os.environ, "PYTHONPATH": str(code)}
    out = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, env=env, cwd=code)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)}: {out.stderr.strip()}")
    wall, cpu, rss = out.stdout.split()
    return float(wall), float(cpu), float(rss)


def resumed(root: Path, code: Path = REPO) -> tuple[float, float, float]:
    """Resume's question, timed inside the process (the lookup, not the interpreter's start)."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    out = subprocess.run([sys.executable, "-c", RESUME, str(root)], capture_output=True, text=True, check=True,
                         env=env, cwd=code)  # fmt: skip
    wall, cpu, rss = out.stdout.split()
    return float(wall), float(cpu), float(rss)


def drop_index(root: Path) -> None:
    """Remove the point index beside the store: the next read builds it from nothing, as on a fresh store."""
    shutil.rmtree(ResultStore(root).side / "index", ignore_errors=True)


def measure(
    name: str,
    run: Callable[[Path], tuple[float, float, float]],
    rounds: int,
    codes: dict[str, Path],
    *,
    fresh_index: Path | None = None,
) -> list[dict[str, float | str]]:
    """Per checkout: one first call (cold page cache; with `fresh_index`, the point index built from
    nothing), then `rounds` timed calls, the checkouts taking turns (A B A B ...), and their medians."""
    firsts = {}
    for label, code in reversed(codes.items()):  # the first checkout's first call last: its index is kept
        if fresh_index is not None:
            drop_index(fresh_index)
        firsts[label] = (run(code), os.getloadavg()[0])
    runs: dict[str, list[tuple[float, float, float]]] = {label: [] for label in codes}
    for _ in range(rounds):
        for label, code in codes.items():
            runs[label].append(run(code))
    out = []
    for label in codes:
        first, load = firsts[label]
        rest = runs[label] or [first]
        result: dict[str, float | str] = {
            "what": name,
            "code": label,
            "first_s": first[0],
            "first_cpu_s": first[1],
            "median_s": statistics.median(w for w, _, _ in rest),
            "median_cpu_s": statistics.median(c for _, c, _ in rest),
            "max_s": max(w for w, _, _ in rest),
            "peak_mib": max(m for _, _, m in [first, *rest]),
            "load_average": load,
        }
        line = f"  {name:<34} {label:<6} first {first[0]:6.2f} s ({first[1]:6.2f} s CPU)"
        line += (
            f"  median {result['median_s']:6.2f} s ({result['median_cpu_s']:6.2f} s CPU)  max {result['max_s']:6.2f} s"
        )
        print(f"{line}  peak {result['peak_mib']:5.0f} MiB  load {load:.1f}", flush=True)
        out.append(result)
    if len(out) == 2 and runs[next(iter(codes))]:
        new, old = out
        print(f"  {'':<34} {'ratio':<6} first {float(new['first_s']) / float(old['first_s']):6.2f}      "
              f"median {float(new['median_s']) / float(old['median_s']):6.2f} (CPU "
              f"{float(new['median_cpu_s']) / float(old['median_cpu_s']):.2f})", flush=True)  # fmt: skip
    return out


def readers(
    root: Path, sweep_file: Path, rounds: int, *, compacted: bool, codes: dict[str, Path]
) -> list[dict[str, float | str]]:
    """Time the readers on the store as it is (the count over 100,000 uncompacted files only once).

    Before compaction, compare's first call of each checkout builds the point index from nothing.
    """
    orch = str(BIN / "orchestrate")
    common = ["--results", str(root)]

    def command(*args: str) -> Callable[[Path], tuple[float, float, float]]:
        return lambda code: timed([orch, *args, *common], code)

    return [
        *measure(
            "compare (newest run, json)",
            command("compare", "-s", str(sweep_file), "-f", "json"),
            rounds,
            codes,
            fresh_index=None if compacted else root,
        ),
        *measure("check (newest run)", command("check", "--sweep", str(sweep_file)), rounds, codes),
        *measure("query count(*)", command("query", "select count(*) from results"), rounds if compacted else 0, codes),
        *measure("resume: 1,000-job sweep complete?", lambda code: resumed(root, code), rounds, codes),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="where the synthetic store goes")
    parser.add_argument("--fragments", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2, help="processes writing fragments")
    parser.add_argument("--rebuild", action="store_true", help="delete and build the store again")
    parser.add_argument("--out", type=Path, help="write the numbers as JSON here")
    parser.add_argument(
        "--readers-only", action="store_true", help="only time the readers on the store as it is (again, e.g. quieter)"
    )
    parser.add_argument(
        "--vs-code",
        type=Path,
        help="another checkout (`git archive main | tar -x -C DIR`): its readers timed beside this one's, in turns",
    )
    args = parser.parse_args()
    codes = {"this": REPO, **({"other": args.vs_code.resolve()} if args.vs_code else {})}
    print(f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}")
    results = args.root / "store"
    if args.rebuild:
        shutil.rmtree(args.root, ignore_errors=True)
    args.root.mkdir(parents=True, exist_ok=True)
    sweep_file = args.root / "nightly-a.toml"
    sweep_file.write_text(sweep_toml("nightly-a", TOKENS, DEVICES))
    report: dict[str, object] = {"fragments": args.fragments}
    if not results.is_dir():
        report["build_s"] = build(results, args.fragments, args.workers)
    if args.readers_only:
        compacted = any(results.rglob("compact-*.parquet"))
        print("after compaction:" if compacted else "before compaction:")
        report["after" if compacted else "before"] = readers(
            results, sweep_file, args.rounds, compacted=compacted, codes=codes
        )
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))
        return
    if any(results.rglob("compact-*.parquet")):
        raise SystemExit(f"{results} is already compacted: --rebuild to measure before compaction again")
    print("before compaction:")
    report["before"] = readers(results, sweep_file, args.rounds, compacted=False, codes=codes)
    wall, cpu, peak = timed([str(BIN / "orchestrate"), "compact", "--results", str(results)])
    report["compact"] = {"wall_s": wall, "cpu_s": cpu, "peak_mib": peak, "load_average": os.getloadavg()[0]}
    files = sum(1 for _ in results.rglob("*.parquet"))
    print(f"orchestrate compact: {wall:.0f} s ({cpu:.0f} s CPU), peak {peak:.0f} MiB, {files} files now", flush=True)
    print("after compaction:")
    report["after"] = readers(results, sweep_file, args.rounds, compacted=True, codes=codes)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
