"""`python -m workers run JOB.json --out FILE.parquet`: run one job with no Ray and no head.

Exit codes: 0 the job ran (its rows say whether it passed), 2 a bad job file or output path.
The Parquet file is written atomically (temp file, then rename): it is either whole or absent.

`python -m workers device` prints this machine's device kind and backend as MLX runs here, as
JSON (`{"device": "h200", "backend": "cuda"}`): the head asks it of a short-lived process, so that
the head itself never opens a GPU context (which the GPU-user probes would see during every job).

`python -m workers gpus BACKEND` prints this host's GPUs of that backend as JSON (`[{"index": 0,
"uuid": "GPU-...", "name": "NVIDIA H200"}, ...]`, from `nvidia-smi` or the KFD topology, no device
context; `workers.host.gpus`): `orchestrate cluster up` asks it of a host whose inventory entry has
`gpus`. Exit 3 when the backend's GPUs cannot be listed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import ValidationError

from workers.contract import META_JOB_STATUS, JobSpec
from workers.files import write_parquet_atomic
from workers.host.fingerprint import local_device
from workers.host.gpus import GpuListError, list_gpus
from workers.job.runner import run_job
from workers.proc.fork import die_with_parent


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m workers", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    run = sub.add_parser("run", help="run one job and write its rows as Parquet")
    run.add_argument("job", type=Path, help="the job, as JSON (workers.contract.JobSpec)")
    run.add_argument("--out", type=Path, required=True, help="the Parquet file to write")
    sub.add_parser("device", help="print this machine's device kind and backend as JSON")
    gpus = sub.add_parser("gpus", help="print this host's GPUs of a backend as JSON")
    gpus.add_argument("backend", choices=["cpu", "cuda", "metal", "rocm"])
    args = parser.parse_args(argv)
    if args.verb == "gpus":
        try:
            found = list_gpus(args.backend)
        except GpuListError as exc:
            print(f"workers: error: {exc}", file=sys.stderr)
            return 3
        print(json.dumps([g.model_dump(exclude_none=True) for g in found]))
        return 0
    if args.verb == "device":
        kind, backend = local_device()
        print(json.dumps({"device": kind, "backend": backend}))
        return 0
    die_with_parent()
    job = _read_job(args.job)
    if job is None:
        return 2
    if not args.out.parent.is_dir():
        print(f"workers: error: {args.out}: the output directory does not exist", file=sys.stderr)
        return 2

    table = run_job(job)
    write_parquet_atomic(table, args.out)
    status = (table.schema.metadata or {}).get(META_JOB_STATUS, b"?").decode()
    print(f"workers: {job.case_name} {job.job_key}: {table.num_rows} rows, job {status} -> {args.out}")
    return 0


def _read_job(path: Path) -> JobSpec | None:
    """The job file, or None after a one-line error naming the file (and the field)."""
    try:
        return JobSpec.model_validate_json(path.read_text())
    except OSError as exc:
        print(f"workers: error: {path}: cannot read job file: {exc.strerror}", file=sys.stderr)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "(the file)"
        print(f"workers: error: {path}: field {loc}: {err['msg']}", file=sys.stderr)
    return None


if __name__ == "__main__":
    sys.exit(main())
