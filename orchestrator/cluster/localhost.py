"""This machine's device kind and backend, for `device = "auto"`, without a GPU context here.

Asking MLX in the head's own process would open a device context (MLX initialises CUDA to
answer), and the GPU-user probes of every job would then see the head as a foreign user of the
GPU. So the head asks a short-lived process (`python -m workers device`), which answers and exits.
`orchestrate run` on the default inventory starts that process first thing (`probe_early`), so
that it runs beside the head's imports (0.4 s of the 2-core CPU machine's start) instead of after.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import subprocess
import sys

from orchestrator.errors import InfrastructureError

DEVICE_PROBE_TIMEOUT_S = 120.0
PROBE_ARGV = [sys.executable, "-m", "workers", "device"]
_early: subprocess.Popen[str] | None = None  # the probe `probe_early` started, until `local_device` reads it


def probe_early() -> None:
    """Start the device probe now, for a later `local_device` to read; one never read ends at exit."""
    global _early
    if _early is not None or local_device.cache_info().currsize:
        return
    with contextlib.suppress(OSError):  # `local_device` tries again and reports why
        _early = subprocess.Popen(PROBE_ARGV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        atexit.register(_end_early)


def _end_early() -> None:
    global _early
    proc, _early = _early, None
    if proc is not None:
        proc.kill()
        proc.communicate()


@functools.lru_cache(maxsize=1)
def local_device() -> tuple[str, str]:
    """(device kind, backend) of this machine as MLX runs here, e.g. ("h200", "cuda"), ("cpu", "cpu").

    Raises:
        InfrastructureError: MLX cannot start here (not installed, no backend, a broken driver).
    """
    global _early
    proc, _early = _early, None
    try:
        proc = proc or subprocess.Popen(PROBE_ARGV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
