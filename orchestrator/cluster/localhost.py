"""This machine's device kind and backend, for `device = "auto"`, without a GPU context here.

Asking MLX in the head's own process would open a device context (MLX initialises CUDA to
answer), and the GPU-user probes of every job would then see the head as a foreign user of the
GPU. So the head asks a short-lived process (`python -m workers device`), which answers and exits.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

from orchestrator.errors import InfrastructureError

DEVICE_PROBE_TIMEOUT_S = 120.0
PROBE_ARGV = [sys.executable, "-m", "workers", "device"]


@functools.lru_cache(maxsize=1)
def local_device() -> tuple[str, str]:
    """(device kind, backend) of this machine as MLX runs here, e.g. ("h200", "cuda"), ("cpu", "cpu").

    Raises:
        InfrastructureError: MLX cannot start here (not installed, no backend, a broken driver).
    """
    try:
        proc = subprocess.Popen(PROBE_ARGV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=DEVICE_PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InfrastructureError(f"cannot ask MLX which device this machine has: {exc}") from None
    done = subprocess.CompletedProcess(PROBE_ARGV, proc.returncode, out, err)
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
        return str(answer["device"]), str(answer["backend"])
    except (IndexError, KeyError, ValueError):
        why = (done.stderr or done.stdout).strip().splitlines()
        raise InfrastructureError(
            f"MLX cannot tell which device this machine has (`python -m workers device` exited {done.returncode}: "
            f"{why[-1] if why else 'no output'}); is MLX installed with a backend? (`make run` installs it)"
        ) from None
