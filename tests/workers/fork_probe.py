"""A test-only entry for a fork server's child: reports what the child inherited, and can leave
state behind (an env variable, an MLX array, a phase, a module global) for the next child to see.

    main(["look" | "dirty" | "fingerprint" [pinned] | "job" JOB.json, OUT.json])

`start_server` starts a real fork server that runs this module for one of its entries.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from workers.contract import META_JOB_STATUS
from workers.proc.spawn import ForkServer

_kept: list[Any] = []  # a "dirty" child's MLX array stays alive here until it exits


def _look() -> dict[str, Any]:
    import mlx.core as mx

    from workers.job import phases

    return {
        "env": os.environ.get("LEAK_MARK"),
        "active": mx.get_active_memory(),
        "peak": mx.get_peak_memory(),
        "phases": dict(phases.current().seconds),
        "kept": len(_kept),
        "pid": os.getpid(),
    }


def start_server(env: dict[str, str], entry: str) -> ForkServer:
    """A real fork server (preloading MLX) whose entry `entry` runs this module; `env` its environment."""
    import subprocess
    import tempfile

    from tests.conftest import REPO

    path = os.path.join(tempfile.mkdtemp(prefix="orchestrate-fork-test-"), "socket")  # short: AF_UNIX limit
    code = (
        "import sys; from workers.proc import forkserver; "
        f"forkserver.ENTRIES[{entry!r}] = 'tests.workers.fork_probe'; sys.exit(forkserver.main(sys.argv[1:]))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, path, "mlx"], cwd=REPO, env=env, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert line.startswith("ready"), line
    return ForkServer(path, proc, line.split(" ", 3)[-1].strip())


def main(argv: list[str]) -> int:
    what, out = argv[0], argv[1]
    if what == "dirty":
        import mlx.core as mx

        from workers.job import phases

        os.environ["LEAK_MARK"] = "1"
        array = mx.ones((256, 256)) @ mx.ones((256, 256))
        mx.eval(array)
        _kept.append(array)
        phases.current().add("leak", 1.0)
    if what == "job":  # run a job (JSON at argv[2]) in this child; report the modules it imported anew
        from workers.contract import JobSpec
        from workers.job.runner import run_job

        before = set(sys.modules)
        table = run_job(JobSpec.model_validate_json(Path(argv[2]).read_text()))
        status = (table.schema.metadata or {}).get(META_JOB_STATUS, b"").decode()
        report = {"status": status, "imported": sorted(set(sys.modules) - before)}
    elif what == "fingerprint":
        from workers.contract import GpuPin
        from workers.host.fingerprint import static_fingerprint

        pin = GpuPin(index=1, uuid="GPU-1") if len(argv) > 2 else None
        fp = static_fingerprint("cuda", pin=pin)
        report: dict[str, Any] = {"gpu": fp.gpu, "driver": fp.gpu_driver, "threads": fp.threads}
    else:
        report = _look()
    with open(out, "w") as fh:
        json.dump(report, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
