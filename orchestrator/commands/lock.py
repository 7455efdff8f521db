"""`orchestrate lock status|hold`: the host's guarded GPU lock from a shell.

`status` prints `free`, `held` (pid, mode, since, command) or `stale` (a holder file whose process
is gone); it exits 0 when the lock is free and 1 when something holds it, like the shell guard's
`--status`. `hold -- CMD ...` runs any command under the lock, like `rocm_gpu_guard.sh --hold`:
it exits with the command's code (128+N when a signal N killed it), 75 when `--max-wait` ran
out, 127/126 when the command cannot be started, and 130/143 on SIGINT/SIGTERM after ending the
command's whole process tree. The command runs as a `workers.proc.tree.ProcessTree` (its own
process group, every descendant followed, also those that call `setsid`), with
`ROCM_GPU_GUARD_LOCK_HELD` set so guards and holds inside it nest, and it inherits the lock's
descriptor as under `flock(1)`: the lock stays taken until the last process of the command's tree
is gone, also when this process is killed (on Linux the tree's keeper then ends the tree). What
the command leaves running when it exits is ended too (SIGTERM, then SIGKILL after the grace).

On a host with several GPUs (`gpus` in the inventory), `--gpu N` holds one GPU only, as a job
pinned to it does (`workers.lock.slot`: the host's lock shared, `<lock>.gpu<N>` exclusively);
without it, `hold` takes the whole host. `status` shows each GPU's lock beside the host's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import sys
import time
from dataclasses import asdict
from types import FrameType

import typer

from orchestrator.errors import InputError, LockTimeoutError
from workers.lock.file import LockStatus, lock_status
from workers.lock.gpu import DEFAULT_LOCK_PATH, GpuLock, LockBusyError, LockPathError
from workers.lock.slot import SlotLock, gpu_lock_path
from workers.proc.tree import ProcessTree

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# The node's lock (set by `cluster up`), then the shell guard's, so both tools find one lock.
LOCK_ENVVARS = ["ORCHESTRATE_LOCK_PATH", "ROCM_GPU_GUARD_LOCK"]
LOCK_HELP = "Lock file (share the shell guard's file to share its lock)."
GPU_HELP = "One GPU of a host with several (its index): that GPU's lock, not the whole host's."
GRACE_S = 5.0  # how long the command's group gets to exit after a forwarded signal before SIGKILL


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _say(message: str) -> None:
    print(f"orchestrate: {message}", file=sys.stderr, flush=True)


def _give_terminal(tree: ProcessTree) -> int | None:
    """Make the command's group the terminal's foreground (as a shell does), if we are in front."""
    try:
        fd = sys.stdin.fileno()
        if not os.isatty(fd) or os.tcgetpgrp(fd) != os.getpgrp():
            return None
        os.tcsetpgrp(fd, tree.pgid)
    except (OSError, ValueError):
        return None
    tree.signal(signal.SIGCONT)  # in case it read the terminal before it was its own
    return fd


def _take_terminal_back(fd: int | None) -> None:
    if fd is None:
        return
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(fd, os.getpgrp())
    except OSError:
        pass
    finally:
        signal.signal(signal.SIGTTOU, previous)


def _wait_tree(tree: ProcessTree, signals: list[int], grace: float) -> int:
    """Wait for the command; after a forwarded signal give its tree `grace` seconds, then end it."""
    deadline: float | None = None
    while True:
        code = tree.wait(0.1)
        if code is not None:
            return code
        if signals and deadline is None:
            deadline = time.monotonic() + grace
        if deadline is not None and time.monotonic() > deadline:
            tree.end()
            return tree.wait(0) or -signal.SIGKILL


def run_held(argv: list[str], lock: GpuLock | SlotLock, *, grace: float = GRACE_S) -> int:
    """Run `argv` under `lock` and return the exit code `orchestrate lock hold` exits with.

    Args:
        argv: The command and its arguments.
        lock: A lock not yet acquired; it is taken here and released when the command's tree is gone.
        grace: Seconds between forwarding SIGINT/SIGTERM/SIGHUP to the command's tree and SIGKILL
            (and the grace a process the command left behind gets).

    Raises:
        LockTimeoutError: `max_wait` ran out (exit 75).
        InputError: The lock path cannot be used.
    """
    signals: list[int] = []
    tree: ProcessTree | None = None
    waiting = True

    def on_signal(signum: int, frame: FrameType | None) -> None:
        signals.append(signum)
        if tree is not None:
            tree.signal(signum)
        elif waiting:
            raise _Interrupted(signum)

    previous = {s: signal.signal(s, on_signal) for s in FORWARDED}
    try:
        try:
            lock.acquire()
        except LockBusyError as exc:
            raise LockTimeoutError(str(exc)) from exc
        except LockPathError as exc:
            raise InputError(str(exc)) from exc
        waiting = False
        if signals:
            return 128 + signals[0]
        if lock.nested:
            _say(f"GPU lock {lock.path} held by an outer holder (pid {os.environ.get('ROCM_GPU_GUARD_LOCK_HELD')})")
        inherit = lock.inherited_fds()
        started = ProcessTree(argv, env=lock.child_env(), pass_fds=inherit, session=False)
        try:
            tree = started.start()
        except FileNotFoundError:
            _say(f"lock hold: {argv[0]}: command not found")
            return 127
        except PermissionError:
            _say(f"lock hold: {argv[0]}: permission denied")
            return 126
        if signals:  # arrived while the command was being started
            tree.signal(signals[0])
        terminal = _give_terminal(tree)
        try:
            code = _wait_tree(tree, signals, grace)
        finally:
            _take_terminal_back(terminal)
            left = [p for p in tree.end(grace) if p != tree.pid]  # what the command left running
        if signals:
            _say(f"caught {signal.Signals(signals[0]).name}; ended the command's process tree")
            return 128 + signals[0]
        if left:
            _say(f"ended {len(left)} process(es) the command left running (pid {', '.join(map(str, left))})")
        return code if code >= 0 else 128 - code
    except _Interrupted as stop:  # only raised while waiting for the lock: no command was started
        _say(f"caught {signal.Signals(stop.signum).name} while waiting for GPU lock {lock.path}")
        return 128 + stop.signum
    finally:
        lock.release()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _gpu_locks(lock: str) -> list[str]:
    """The per-GPU lock files beside `lock` (`LOCK.gpu<i>`), by index."""
    folder, name = os.path.split(lock)
    found = []
    with contextlib.suppress(OSError):
        for entry in os.listdir(folder or "."):
            rest = entry.removeprefix(f"{name}.gpu")
            if rest != entry and rest.isdigit():
                found.append((int(rest), os.path.join(folder, entry)))
    return [path for _, path in sorted(found)]


def _announce_wait(status: LockStatus) -> None:
    _say(f"waiting for GPU lock {status.path}: {status.describe()}")


def register(app: typer.Typer) -> None:
    """Add `orchestrate lock status|hold`."""
    lock_app = typer.Typer(help="The host's guarded GPU lock (one GPU job at a time).", no_args_is_help=True)

    @lock_app.command("status")
    def status(
        lock: str = typer.Option(DEFAULT_LOCK_PATH, "--lock", envvar=LOCK_ENVVARS, help=LOCK_HELP),
        as_json: bool = typer.Option(False, "--json", help="Print the status as one JSON object."),
        gpu: int | None = typer.Option(None, "--gpu", min=0, help=GPU_HELP),
    ) -> None:
        """Say whether the lock is free, held (by whom, since when, doing what) or stale; exit 1 if busy.

        Each GPU's lock of a host with several (`LOCK.gpu<i>`) is shown beside it; `--gpu N` shows
        (and exits by) that GPU's alone.
        """
        try:
            if gpu is not None:
                states = [lock_status(gpu_lock_path(lock, gpu))]
            else:
                states = [lock_status(lock), *(lock_status(p) for p in _gpu_locks(lock))]
        except LockPathError as exc:
            raise InputError(str(exc)) from exc
        if as_json:
            print(json.dumps(asdict(states[0]) if len(states) == 1 else [asdict(s) for s in states]))
        else:
            print("\n".join(s.describe() for s in states))
        raise typer.Exit(1 if states[0].busy else 0)

    @lock_app.command("hold")
    def hold(
        command: list[str] = typer.Argument(..., help="The command to run under the lock (after --)."),
        lock: str = typer.Option(DEFAULT_LOCK_PATH, "--lock", envvar=LOCK_ENVVARS, help=LOCK_HELP),
        max_wait: float = typer.Option(0.0, "--max-wait", min=0, help="Seconds to wait for the lock; 0: no limit."),
        gpu: int | None = typer.Option(None, "--gpu", min=0, help=GPU_HELP),
    ) -> None:
        """Run CMD under the lock; exit with its code, 75 if the wait ran out, 130/143 on SIGINT/SIGTERM."""
        text = shlex.join(command)
        gpu_lock: GpuLock | SlotLock = (
            GpuLock(lock, max_wait=max_wait, mode="hold", cmd=text, on_wait=_announce_wait, export_env=False)
            if gpu is None
            else SlotLock(lock, gpu, max_wait=max_wait, mode="hold", cmd=text, on_wait=_announce_wait, export_env=False)
        )
        raise typer.Exit(run_held(command, gpu_lock))

    app.add_typer(lock_app, name="lock")
