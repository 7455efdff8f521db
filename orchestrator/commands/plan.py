"""`orchestrate plan` and `orchestrate import`: run a sweep's jobs where no Ray node can reach.

`plan` writes each job of a sweep as a JobSpec JSON file for one device kind; on that host,
`python -m workers run JOB.json --out FILE.parquet` runs it with no Ray and no head; `import`
stores the Parquet files it wrote in this machine's results, where `compare` sees them beside
everything else.
"""

from __future__ import annotations

from pathlib import Path

import typer
from pydantic import ValidationError

from orchestrator.commands.options import Backend, results_option
from orchestrator.errors import InputError
from orchestrator.run.code_version import code_version
from orchestrator.run.plan import expand, new_run_id
from orchestrator.specs.sweep import InventorySpec, load_sweep, validation_message
from orchestrator.store.fragments import ResultStore
from orchestrator.store.incoming import check_fragment, import_fragment


def write_jobs(sweep_name: str, device: str, backend: str, out: Path, lock_path: str | None) -> list[Path]:
    """Write every job of the sweep on `device` as `<out>/<case>-<key>.json`."""
    sweep = load_sweep(sweep_name)
    host = {"name": device, "device": device, "backend": backend}
    if lock_path:
        host["lock"] = lock_path
    try:
        inventory = InventorySpec.model_validate({"hosts": [host]})
    except ValidationError as exc:  # --device, --backend or --lock (the host the jobs are for)
        message = validation_message(exc, InventorySpec).replace("field hosts.0.name", "--device")
        message = message.replace("field hosts.0.", "--")
        raise InputError(message) from None
    jobs = expand(sweep, inventory, [device], run_id=new_run_id(), version=code_version())
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create the jobs directory: {exc.strerror}", where=str(out)) from None
    paths = []
    for job in jobs:
        path = out / f"{job.case_name}-{job.job_key}.json"
        path.write_text(job.model_dump_json(indent=1))
        paths.append(path)
    return paths


def register(app: typer.Typer) -> None:
    @app.command("plan")
    def plan(
        sweep: str = typer.Option("smoke", "--sweep", "-s", help="built-in sweep name or sweep TOML path"),
        device: str = typer.Option(..., "--device", help="the device kind the jobs are for, e.g. h200"),
        backend: Backend = typer.Option(Backend.cuda, "--backend", case_sensitive=False, help="what that host runs"),
        out: Path = typer.Option(..., "--out", help="directory for the job files"),
        lock: str | None = typer.Option(None, "--lock", help="the GPU lock path on that host"),
    ) -> None:
        """Write a sweep's jobs as JSON files, to run with `python -m workers run` on a host."""
        paths = write_jobs(sweep, device, backend.value, out, lock)
        for path in paths:
            print(path)
        print(f"{len(paths)} jobs; on the host: python -m workers run JOB.json --out JOB.parquet")

    @app.command("import")
    def import_(
        files: list[Path] = typer.Argument(..., help="Parquet fragments written by `python -m workers run`"),
        results: Path = results_option(),
    ) -> None:
        """Store fragments from another host in the results (atomic; the same job twice is one file)."""
        store = ResultStore(results)
        store.ensure_writable()
        for f in files:
            if not f.is_file():
                raise InputError("no such file", where=str(f))
        for f in files:  # every fragment checked before any is stored: a bad one stores nothing
            check_fragment(store, f)
        for f in files:
            print(import_fragment(store, f))
