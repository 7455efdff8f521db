"""A head for test_own_processes: starts the embedded Ray instance as `orchestrate run` does, keeps
itself busy, and asks a Ray task to run every GPU-user probe with the candidates it names.

    python -m tests.workers.probe_head FOREIGN_PID FAKE_BIN_DIR

Prints one JSON line: the pids of our processes it knows and what each probe called foreign.
The KFD list and `nvidia-smi` are small honest fakes (no AMD or NVIDIA GPU here): a directory
with one entry per candidate pid, and a script that lists the candidates as compute apps.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import threading
import time


def probe_task(foreign: int, fake_bin: str) -> dict[str, object]:
    import subprocess

    from workers.lock.probes import CpuQuietProbe, KfdProbe, NvidiaSmiProbe

    raylet = int(os.environ["RAY_RAYLET_PID"])
    head = int(os.environ["ORCHESTRATE_HEAD_PID"])
    table = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True).stdout
    with open(f"/proc/{raylet}/cmdline", "rb") as f:  # this node's session (others may run beside it)
        session = re.search(rb"/session_[0-9_-]+", f.read()).group(0).decode()  # type: ignore[union-attr]
    daemons = [int(line.split()[0]) for line in table.splitlines() if session in line]
    ours = sorted({head, raylet, os.getpid(), *daemons})
    candidates = [*ours, foreign]
    kfd = tempfile.mkdtemp()
    for pid in candidates:
        os.mkdir(os.path.join(kfd, str(pid)))
    smi = os.path.join(fake_bin, "nvidia-smi")
    with open(smi, "w") as f:
        f.write("#!/bin/sh\n" + "".join(f"echo '{pid}, python, 100'\n" for pid in candidates))
    os.chmod(smi, 0o755)
    cpu = CpuQuietProbe(threshold=5.0, min_window=2.0)  # low: this shared machine may be busy
    cpu.prime()
    return {
        "ours": ours,
        "kfd": sorted(KfdProbe(kfd).sample().foreign),
        "nvidia_smi": sorted(NvidiaSmiProbe(smi).sample().foreign),
        "cpu": sorted(cpu.sample().foreign),
    }


def main() -> None:
    import ray

    from orchestrator.run.executor import RayExecutor
    from orchestrator.specs.sweep import load_inventory

    foreign, fake_bin = int(sys.argv[1]), sys.argv[2]
    stop = time.monotonic() + 120
    threading.Thread(target=lambda: [None for _ in iter(lambda: time.monotonic() > stop, True)], daemon=True).start()
    with RayExecutor(load_inventory(None)):
        result = ray.get(ray.remote(probe_task).options(num_cpus=0).remote(foreign, fake_bin))
    result["head"] = os.getpid()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
