"""The orchestrator's cost on this machine: the smoke sweep's wall time and the overhead per job,
side by side with an older tree in one run.

    .venv/bin/python -m benchmarks.overhead [--jobs 12] [--rounds 3] [--before DIR | --switch KEY=VALUE]
        [--max-attempts N]

Every figure is the real command, `orchestrate run` (no inventory: embedded Ray) in a subprocess of
its own, so Python's start, the device probe, Ray's start and shutdown and the report are in it.
With `--before DIR` (a checkout of the previous code, e.g. `git worktree add DIR 8f4eab1`) each
round runs the same commands from that tree too, with this venv, alternating, so the load of a
shared machine hits both; ratios after/before are the comparison to trust there. With `--switch
KEY=VALUE` (e.g. `ORCHESTRATE_FRESH_INTERPRETERS=1`) the "before" runs are this tree with that
variable set, alternating with runs without it in the same way: a mechanism measured off and on.

Per tree and round:

* smoke: the built-in `smoke` sweep, from the command's start to its last fragment stored (the
  newest fragment's mtime) and to the command's exit;
* the slope: sweeps of N and 2N trivial jobs (one-arm qmm, 64 x 64, 3 samples, no warm-up
  passes): (wall(2N) - wall(N) - (job time(2N) - job time(N))) / N, job time being the workers'
  whole in-process job time (footer `orchestrate.job_seconds`): what each further job adds;
* within the 2N run, free of the round-to-round spread of Ray's start: (last fragment stored -
  first fragment stored - the job time of jobs 2..2N) / (2N - 1); and the same with only each
  job's measured work subtracted (build, reference, warm-up, timed, lock and idle gate, peaks),
  which counts the job process's own imports and bookkeeping as overhead too.

All runs share one HOME (peaks probed once, by an untimed warm-up run per tree), one spool (the
smoke model's checkpoint generated once) and a private GPU lock file. Contended jobs are measured
again (`max_attempts`, 2 by default) and their job time counts both measurements; the rounds say
how many jobs saw a foreign user; `--max-attempts 1` measures each job once (flagged, not repeated).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from orchestrator.store.fragments import ResultStore
from workers.contract import META_JOB_SECONDS, META_PHASES

REPO = Path(__file__).resolve().parent.parent
WORK = ("build", "reference", "warmup", "timed", "lock_wait", "idle_gate", "peaks", "load")


def tiny_sweep(n_jobs: int) -> str:
    """A sweep of N jobs whose measured work is a few milliseconds each."""
    tokens = ", ".join(str(t) for t in range(1, n_jobs + 1))
    return (
        'name = "overhead"\nrepetitions = 3\nwarmup = 0\nbaseline = "native"\n\n[[cases]]\ncase = "qmm"\n'
        f'arms = ["native"]\nparams = {{ tokens = [{tokens}], n = 64, k = 64 }}\n'
    )


@dataclass
class Run:
    """One `orchestrate run`, read back from its results."""

    wall: float  # command start to exit
    to_rows: float  # command start to the newest fragment's mtime
    jobs: int
    job_seconds: float
    contended_jobs: int  # jobs that saw a foreign CPU user (measured again, or flagged)
    later_gap: float  # last stored - first stored
    later_job_seconds: float  # job time of every job stored after the first
    later_work: float  # measured work of those jobs

    def within_slope(self, work_only: bool = False) -> float:
        spent = self.later_work if work_only else self.later_job_seconds
        return (self.later_gap - spent) / max(self.jobs - 1, 1)


def run_command(tree: Path, sweep: str, env: dict[str, str], scratch: Path, switch: dict[str, str]) -> Run:
    results = Path(tempfile.mkdtemp(dir=scratch, prefix="results-"))
    argv = [sys.executable, "-m", "orchestrator.cli", "run", "--sweep", sweep, "--results", str(results)]
    t0 = time.time()
    whole = {**env, **switch, "PYTHONPATH": str(tree)}
    done = subprocess.run(argv, cwd=tree, env=whole, capture_output=True, text=True)
    wall = time.time() - t0
    if done.returncode not in (0, 1, 5):  # 1: a criterion failed, 5: contended jobs (not complete)
        raise SystemExit(f"{tree}: orchestrate run --sweep {sweep} exited {done.returncode}: {done.stderr[-2000:]}")
    stored = []
    for path in ResultStore(results).fragment_files():
        meta = pq.read_metadata(path).metadata or {}
        phases = json.loads(meta.get(META_PHASES, b"{}"))
        work = sum(float(phases.get(k, 0.0)) for k in WORK)
        flags = pq.read_table(path, columns=["lock_attempts", "contended"]).to_pylist()
        seen = any(f["contended"] or (f["lock_attempts"] or 1) > 1 for f in flags)
        stored.append((path.stat().st_mtime, float(meta[META_JOB_SECONDS]), work, seen))
    shutil.rmtree(results, ignore_errors=True)
    stored.sort()
    later = stored[1:]
    return Run(
        wall=wall,
        to_rows=stored[-1][0] - t0,
        jobs=len(stored),
        job_seconds=sum(s[1] for s in stored),
        contended_jobs=sum(1 for s in stored if s[3]),
        later_gap=stored[-1][0] - stored[0][0],
        later_job_seconds=sum(s[1] for s in later),
        later_work=sum(s[2] for s in later),
    )


def median(values: list[float]) -> float:
    return statistics.median(values)


def fmt(values: list[float], unit: str = "s", digits: int = 2) -> str:
    return f"{median(values):.{digits}f} {unit} ({', '.join(f'{v:.{digits}f}' for v in values)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=12, help="N: the slope compares sweeps of N and 2N jobs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", type=Path, help="another tree (e.g. a worktree of the previous main)")
    parser.add_argument("--switch", help="KEY=VALUE: the 'before' runs are this tree with this variable set")
    parser.add_argument("--max-attempts", type=int, help="measurements of a contended job (default: the host's, 2)")
    args = parser.parse_args()
    trees = {"after": REPO} | ({"before": args.before.resolve()} if args.before else {})
    switches: dict[str, dict[str, str]] = {"after": {}, "before": {}}
    if args.switch:
        if args.before or "=" not in args.switch:
            parser.error("--switch takes KEY=VALUE, and not with --before")
        key, _, value = args.switch.partition("=")
        trees["before"], switches["before"] = REPO, {key: value}
    scratch = Path(tempfile.mkdtemp(prefix="orchestrate-overhead-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "ORCHESTRATE_"))}
    env.update(HOME=str(scratch / "home"), ORCHESTRATE_SPOOL=str(scratch / "spool"), COLUMNS="200")
    lock = str(scratch / "gpu.lock")
    env["ORCHESTRATE_LOCK_PATH"] = lock
    if args.max_attempts:
        env["ORCHESTRATE_LOCK"] = json.dumps({"path": lock, "max_attempts": args.max_attempts})
    (scratch / "home").mkdir()
    sweeps = {n: scratch / f"tiny-{n}.toml" for n in (args.jobs, 2 * args.jobs)}
    for n, path in sweeps.items():
        path.write_text(tiny_sweep(n))
    print(f"machine: {platform.node()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for name, tree in trees.items():  # untimed: peaks probed, the model's checkpoint generated, files cached
        run_command(tree, "smoke", env, scratch, switches[name])
        print(f"warm-up run ({name}) done")
    runs: dict[str, dict[str, list[Run]]] = {name: {"smoke": [], "n": [], "2n": []} for name in trees}
    loads = []
    for rnd in range(args.rounds):
        for name, tree in trees.items():
            for key, sweep in (("smoke", "smoke"), ("n", str(sweeps[args.jobs])), ("2n", str(sweeps[2 * args.jobs]))):
                run = run_command(tree, sweep, env, scratch, switches[name])
                runs[name][key].append(run)
                print(
                    f"  round {rnd + 1} {name} {key}: wall {run.wall:.2f} s, rows {run.to_rows:.2f} s, "
                    f"{run.jobs} jobs ({run.contended_jobs} contended), job time {run.job_seconds:.2f} s",
                    flush=True,
                )
        loads.append(os.getloadavg()[0])
    print(f"load average (1 min) after each round: {', '.join(f'{x:.2f}' for x in loads)}")
    table: dict[str, dict[str, float]] = {}
    for name in trees:
        r = runs[name]
        pairs = zip(r["n"], r["2n"], strict=True)
        slope = [((d.wall - s.wall) - (d.job_seconds - s.job_seconds)) / args.jobs for s, d in pairs]
        within = [d.within_slope() for d in r["2n"]]
        strict = [d.within_slope(work_only=True) for d in r["2n"]]
        print(f"{name} ({trees[name]}{' with ' + args.switch if switches[name] else ''}):")
        print(f"  smoke sweep, command to the stored rows: {fmt([x.to_rows for x in r['smoke']])}")
        print(f"  smoke sweep, command to its exit:        {fmt([x.wall for x in r['smoke']])}")
        print(f"  smoke jobs contended, per round:         {[x.contended_jobs for x in r['smoke']]}")
        print(f"  slope per further job, N={args.jobs} -> {2 * args.jobs} (beyond job time): {fmt(slope, digits=3)}")
        print(f"  per further job within one run of {2 * args.jobs} (beyond job time):     {fmt(within, digits=3)}")
        print(f"  per further job within one run (beyond the measured work only):   {fmt(strict, digits=3)}")
        table[name] = {
            "smoke_rows": median([x.to_rows for x in r["smoke"]]),
            "smoke_exit": median([x.wall for x in r["smoke"]]),
            "slope": median(slope),
            "within": median(within),
            "strict": median(strict),
        }
    if "before" in table:
        print("after / before (medians):")
        for key, value in table["after"].items():
            print(f"  {key}: {value:.3f} / {table['before'][key]:.3f} = {value / table['before'][key]:.2f}")
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
