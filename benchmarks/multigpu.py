"""A host with several GPUs through `orchestrate run`: throughput on 1 GPU and on all of them, the
medians per GPU, and a GPU lost mid-sweep (issue 21). The driver is `benchmarks/device_multigpu.sh`;
this module holds its parts:

    python -m benchmarks.multigpu sweeps DIR --gpus N [--per-gpu 2] [--one-gpu 2]
        writes the sweeps: `mg1-<s>` (on GPU 0 alone) and `mgN-<s>` (on all N), for s = qmm (the
        nvfp4-prefill qmm case at 4096 tokens, its six arms) and moe (the moe-gather case, its six
        arms), each the same job repeated under distinct case names (`<case>-r<i>`: one job
        each, identical work), `--one-gpu` jobs on one GPU and `--per-gpu` x N on all; and
        `mg-loss` (N + 1 qmm jobs) for the loss run;
    python -m benchmarks.multigpu lose LOCK PID
        waits until jobs hold two GPUs' locks, then kills the Ray worker process of the job on the
        lowest such GPU and the whole Ray node of the highest (a node the embedded head, PID or a
        descendant of it, started: GPU 0's node is the head's own); prints what it killed as JSON;
    python -m benchmarks.multigpu summary RESULTS --gpus N [--killed FILE] > summary.txt
        the throughput of each sweep pair, jobs per second of job time span (first job's start to
        the last one's end, so Ray's start is left out; every job's own overhead is in), its ratio
        against 0.9 x N; per arm and metric, each GPU's median with its 95 % interval and its ratio
        to GPU 0's (SAME, FASTER, SLOWER or AMBIGUOUS at 3 %, unpaired); and where the lost jobs
        finished.

Everything is read from the Parquet rows and their footers; a CPU number is never shown as a GPU
one (every table states device, backend and GPU UUIDs).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from orchestrator.analysis.stats import compare_samples, summarize
from orchestrator.specs.sweep import load_sweep
from orchestrator.store.fragments import ResultStore
from workers.contract import META_JOB_SECONDS, META_PHASES
from workers.contract.precision import seed_for

TARGET = 0.9  # of N x one GPU's throughput
METRICS = ("prefill_tok_s", "seconds")


# ------------------------------------------------------------------------------------- the sweeps


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def sweep_text(
    name: str, source: str, case: str, params: dict[str, Any], jobs: int, arms: list[str] | None = None
) -> str:
    """A sweep of `jobs` identical jobs of the built-in sweep `source`'s `case` at `params` (and `arms`)."""
    built = load_sweep(source)
    entry = next(c for c in built.cases if c.case == case)
    lines = [
        f'name = "{name}"',
        f'description = "{jobs} identical {case} jobs from {source} (benchmarks/multigpu.py)"',
        f"repetitions = {entry.repetitions or built.repetitions}",
        f"warmup = {entry.warmup if entry.warmup is not None else built.warmup}",
        f'baseline = "{built.baseline}"',
    ]
    point = {**{k: v for k, v in entry.params.items()}, **params}
    inline = ", ".join(f"{k} = {_toml_value(v)}" for k, v in point.items())
    for i in range(jobs):
        lines += ["", "[[cases]]", f'case = "{case}"', f'name = "{case}-r{i}"']
        own = [a for a in entry.arm_names() if a not in entry.arm_paths()]  # an A/A copy adds no GPU work
        lines += [f"arms = {_toml_value(arms or own)}", f"params = {{ {inline} }}"]
    return "\n".join(lines) + "\n"


SOURCES = {"qmm": ("nvfp4-prefill", "qmm", {"tokens": 4096}), "moe": ("moe-gather", "moe-gather", {})}
# `--tiny`: the same sweeps at CPU shapes, to try the script's logic on a machine without GPUs
# (its numbers are CPU numbers, and the rows say so).
TINY: dict[str, tuple[dict[str, Any], list[str]]] = {
    "qmm": ({"tokens": 64, "n": 512, "k": 512, "dtype": "float32"}, ["native", "affine"]),
    "moe": (
        {"experts": 8, "top_k": 2, "tokens": 64, "hidden": 256, "expert_width": 128, "dtype": "float32"},
        ["native-sorted", "affine-sorted"],
    ),
}


def write_sweeps(out: Path, gpus: int, per_gpu: int, one_gpu: int, *, tiny: bool = False) -> list[Path]:
    """The sweep files of the benchmark (module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    plan = [(f"mg1-{short}", short, one_gpu) for short in SOURCES] + [
        (f"mgN-{short}", short, per_gpu * gpus) for short in SOURCES
    ]
    plan.append(("mg-loss", "qmm", gpus + 1))
    written = []
    for name, short, jobs in plan:
        source, case, params = SOURCES[short]
        point, arms = ({**params, **TINY[short][0]}, TINY[short][1]) if tiny else (params, None)
        path = out / f"{name}.toml"
        path.write_text(sweep_text(name, source, case, point, jobs, arms))
        written.append(path)
    return written


# ------------------------------------------------------------------------------------- the loss


def _ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        chain.append(pid)
        with open(f"/proc/{pid}/stat", "rb") as f:
            pid = int(f.read().rsplit(b")", 1)[1].split()[1])
    return chain


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _holder(path: Path) -> dict[str, str]:
    return dict(ln.split("=", 1) for ln in path.read_text().splitlines() if "=" in ln)


def lose(lock: str, head: int, timeout: float = 600.0) -> dict[str, Any]:
    """Kill GPU a's job's Ray worker and GPU b's whole node (a < b, the two lowest and highest
    GPUs whose locks jobs hold at once, b > 0); what was killed, with the jobs' keys."""
    deadline = time.monotonic() + timeout
    while True:
        held = sorted(
            int(p.name.rsplit(".gpu", 1)[1].removesuffix(".holder"))
            for p in Path(lock).parent.glob(f"{Path(lock).name}.gpu*.holder")
        )
        if len(held) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if len(held) < 2:
        raise SystemExit(f"fewer than two GPUs busy within {timeout:g} s: {held}")
    worker_gpu, node_gpu = held[0], held[-1]
    worker_job = _holder(Path(f"{lock}.gpu{worker_gpu}.holder"))
    node_job = _holder(Path(f"{lock}.gpu{node_gpu}.holder"))
    worker = next(p for p in _ancestors(int(worker_job["pid"])) if _cmdline(p).startswith(b"ray::"))
    node = next(
        int(e)
        for e in os.listdir("/proc")
        if e.isdigit() and f"gpu-index={node_gpu},".encode() in _cmdline(int(e)).replace(b"\0", b" ") + b","
        and b"start" in _cmdline(int(e)).split(b"\0") and head in _ancestors(int(e))[1:]
    )  # fmt: skip
    os.kill(worker, signal.SIGKILL)
    os.killpg(node, signal.SIGKILL)
    return {
        "worker": {"gpu": worker_gpu, "pid": worker, "job_key": worker_job["cmd"].rsplit("/", 1)[-1]},
        "node": {"gpu": node_gpu, "pid": node, "job_key": node_job["cmd"].rsplit("/", 1)[-1]},
    }


# ------------------------------------------------------------------------------------- the summary


def _fragments(results: Path, sweep: str) -> list[tuple[pa.Table, dict[bytes, bytes]]]:
    store = ResultStore(results)
    out = []
    for frag in store.fragments():
        if frag.sweep == sweep:
            table = pq.read_table(frag.file)
            if frag.file != frag.path:  # a compacted file: this job's rows
                table = table.filter(pc.equal(table.column("job_key"), frag.job_key))
            for column in ("sweep", "date", "device"):  # schema 2 keeps the partition in the path
                if column not in table.column_names:
                    table = table.append_column(column, pa.array([getattr(frag, column)] * table.num_rows))
            out.append((table, dict(frag.meta or table.schema.metadata or {})))
    return out


def throughput(results: Path, sweep: str) -> dict[str, Any] | None:
    """Jobs per second of job time span, over the sweep's runs (each run's span on its own)."""
    spans: dict[str, list[tuple[float, float]]] = {}
    gpus: set[Any] = set()
    for table, meta in _fragments(results, sweep):
        if set(table.column("status").to_pylist()) != {"ok"}:
            continue
        start = table.column("started_at")[0].as_py().timestamp()
        phases = json.loads(meta.get(META_PHASES, b"{}"))
        seconds = float(meta.get(META_JOB_SECONDS, b"0")) - float(phases.get("fingerprint", 0.0))
        spans.setdefault(str(table.column("run_id")[0].as_py()), []).append((start, start + seconds))
        gpus.update(table.column("gpu_index").to_pylist())
    if not spans:
        return None
    jobs = sum(len(s) for s in spans.values())
    span = sum(max(e for _, e in s) - min(b for b, _ in s) for s in spans.values())
    return {"jobs": jobs, "runs": len(spans), "span_s": span, "jobs_per_s": jobs / span, "gpus": sorted(gpus)}


def per_gpu(results: Path, sweep: str) -> list[str]:
    """Per case point, arm and metric: each GPU's median, interval, and its ratio to the first GPU's."""
    tables = [t for t, _ in _fragments(results, sweep)]
    if not tables:
        return [f"{sweep}: no rows"]
    rows = pa.concat_tables(tables).to_pylist()
    groups: dict[tuple[str, str, str], dict[int, list[float]]] = {}
    for r in rows:
        if r["status"] != "ok" or r["contended"] or r["sample"] is None or r["sample"] < 0:
            continue
        if r["metric"] in METRICS and r["value"] is not None:
            point = " ".join(f"{k}={v}" for k, v in sorted(r["params"]))
            groups.setdefault((point, r["arm"], r["metric"]), {}).setdefault(r["gpu_index"], []).append(r["value"])
    lines = []
    for (point, arm, metric), by_gpu in sorted(groups.items()):
        first = min(by_gpu)
        for gpu in sorted(by_gpu):
            s = summarize(by_gpu[gpu], seed=seed_for(sweep, point, arm, metric, gpu))
            line = f"{point} {arm} {metric} gpu{gpu}: n={s.n} median {s.median:.6g} [{s.ci_low:.6g}, {s.ci_high:.6g}]"
            if gpu != first:
                c = compare_samples(by_gpu[gpu], by_gpu[first], metric=metric, seed=seed_for(sweep, point, arm, gpu))
                line += f" vs gpu{first}: {c.ratio.ratio:.4f} [{c.ratio.ci_low:.4f}, {c.ratio.ci_high:.4f}] {c.verdict}"
            lines.append(line)
    return lines


def summary(results: Path, gpus: int, killed: Path | None) -> list[str]:
    """The summary file's lines (module docstring)."""
    lines = []
    every = [t for s in ("mgN-qmm", "mgN-moe", "mg1-qmm") for t, _ in _fragments(results, s)]
    if every:
        t = pa.concat_tables(every)
        pairs = zip(t.column("gpu_index").to_pylist(), t.column("gpu_uuid").to_pylist(), strict=True)
        uuids = sorted({(i, u) for i, u in pairs if i is not None}, key=lambda p: p[0])

        def values(column: str) -> list[str]:
            return sorted({str(v) for v in t.column(column).to_pylist()})

        lines.append(f"device {values('device')} backend {values('backend')} gpu {values('gpu')} host {values('host')}")
        lines.append("gpus: " + ", ".join(f"{i}={u}" for i, u in uuids))
    verdicts = []
    for short in SOURCES:
        one, many = throughput(results, f"mg1-{short}"), throughput(results, f"mgN-{short}")
        if one is None or many is None:
            side = "mg1" if one is None else "mgN"
            lines.append(f"throughput {short}: missing ({side}-{short} has no clean job): not judged")
            verdicts.append(False)
            continue
        ratio = many["jobs_per_s"] / one["jobs_per_s"]
        ok = ratio >= TARGET * gpus
        verdicts.append(ok)
        lines.append(
            f"throughput {short}: 1 GPU {one['jobs']} jobs in {one['span_s']:.1f} s ({one['jobs_per_s']:.4f}/s, gpus "
            f"{one['gpus']}); {gpus} GPUs {many['jobs']} jobs in {many['span_s']:.1f} s ({many['jobs_per_s']:.4f}/s, "
            f"gpus {many['gpus']}); ratio {ratio:.3f} vs {TARGET} x {gpus} = {TARGET * gpus:.2f}: "
            f"{'PASS' if ok else 'FAIL'}"
        )
    for short in SOURCES:
        lines.append(f"-- medians per GPU, mgN-{short}")
        lines += per_gpu(results, f"mgN-{short}")
    if killed is not None and killed.exists():
        lost = json.loads(killed.read_text())
        rows = pa.concat_tables([t for t, _ in _fragments(results, "mg-loss")] or [pa.table({})])
        for what, info in lost.items():
            mine = [r for r in rows.to_pylist() if r.get("job_key") == info["job_key"]] if rows.num_rows else []
            where = sorted({r["gpu_index"] for r in mine})
            status = sorted({r["status"] for r in mine})
            elsewhere = "finished elsewhere" if where and info["gpu"] not in where else "finished on the same GPU"
            lines.append(
                f"lost {what} of gpu{info['gpu']} (pid {info['pid']}): job {info['job_key']} status {status} "
                f"on gpu {where}: {elsewhere if mine else 'NOT STORED'}"
            )
    lines.append("throughput criterion: " + ("PASS" if verdicts and all(verdicts) else "FAIL or not judged"))
    return lines


def main(argv: list[str] | None = None) -> int:
    """Entry point (module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.multigpu", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    sw = sub.add_parser("sweeps")
    sw.add_argument("out", type=Path)
    sw.add_argument("--gpus", type=int, required=True)
    sw.add_argument("--per-gpu", type=int, default=2)
    sw.add_argument("--one-gpu", type=int, default=2)
    sw.add_argument("--tiny", action="store_true", help="CPU shapes: try the script where there is no GPU")
    lo = sub.add_parser("lose")
    lo.add_argument("lock")
    lo.add_argument("head", type=int)
    su = sub.add_parser("summary")
    su.add_argument("results", type=Path)
    su.add_argument("--gpus", type=int, required=True)
    su.add_argument("--killed", type=Path)
    args = parser.parse_args(argv)
    if args.verb == "sweeps":
        for path in write_sweeps(args.out, args.gpus, args.per_gpu, args.one_gpu, tiny=args.tiny):
            print(path)
    elif args.verb == "lose":
        print(json.dumps(lose(args.lock, args.head)))
    else:
        print("\n".join(summary(args.results, args.gpus, args.killed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
