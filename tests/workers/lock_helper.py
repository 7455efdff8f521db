"""A real process that takes the GPU lock, for the lock tests (run as a script, never collected).

python lock_helper.py contend LOCK N OUT COUNTER MAX_WAIT
    Take the lock N times; inside, record (enter_ns, exit_ns) and increment COUNTER's number by
    a read-modify-write that loses updates unless the lock excludes everyone else.
python lock_helper.py hold LOCK MAX_WAIT
    Take the lock, print `held nested=<bool> wait=<s>` and sleep until killed.
python lock_helper.py once LOCK MAX_WAIT
    Take the lock once, print `held nested=<bool>`, release; exit 75 on a wait timeout.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from workers.lock.gpu import GpuLock, LockBusyError


def contend(lock: str, n: int, out: str, counter: str, max_wait: float) -> None:
    spans = []
    for i in range(n):
        with GpuLock(lock, max_wait=max_wait, mode="test", cmd=f"contender {i}"):
            enter = time.monotonic_ns()
            path = Path(counter)
            value = int(path.read_text() or "0")
            time.sleep(0.0005)  # widen the window a broken lock would let another process into
            path.write_text(str(value + 1))
            spans.append((enter, time.monotonic_ns()))
    Path(out).write_text(json.dumps(spans))


def main(argv: list[str]) -> int:
    mode = argv[0]
    if mode == "contend":
        contend(argv[1], int(argv[2]), argv[3], argv[4], float(argv[5]))
        return 0
    try:
        lock = GpuLock(argv[1], max_wait=float(argv[2]), mode="test", cmd=f"lock_helper {mode}").acquire()
    except LockBusyError as exc:
        print(f"busy: {exc}", flush=True)
        return 75
    print(f"held nested={lock.nested} wait={lock.wait_s:.3f}", flush=True)
    if mode == "hold":
        while True:
            time.sleep(60)
    lock.release()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
