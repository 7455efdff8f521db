"""One run of an external workload (a benchmark, a build, a job's worker process) in one call.

`run_tree` runs a command as a `workers.proc.tree.ProcessTree` and returns once the whole tree
is gone, with memory bounded whatever the workload prints: each stream is drained from a pipe
into a file, at most `max_output` bytes of it (a stream that prints more stops the tree), while
only its last `tail_bytes` are kept in memory for messages. A parser that needs the whole stdout
reads it from the file. The timeout, the output limit and the root's exit all end the whole tree,
so nothing of it outlives the call. `workload_env` is the environment a workload gets: this
host's, without Ray's variables.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from workers.proc.tree import POLL_S, ProcessTree, keeper_supported

DEFAULT_TAIL_BYTES = 16 * 1024
DEFAULT_MAX_OUTPUT = 64 * 2**20  # per stream; a workload that prints more is stopped
SCRUBBED_PREFIXES = ("RAY_",)


@dataclass(frozen=True)
class TreeResult:
    """What one `run_tree` did.

    Attributes:
        returncode: The root's exit status (negative: killed by that signal); None when the
            timeout ran out or the output limit was passed and the tree was stopped.
        seconds: The root's run time.
        timed_out: The timeout ran out.
        overflow: `stdout` or `stderr` when that stream passed `max_output` bytes (tree stopped).
        stdout_tail, stderr_tail: The last `tail_bytes` of each stream, decoded (for messages).
        stdout_path, stderr_path: The files holding each stream (its first `max_output` bytes);
            None for a stream that went to a temp file, now removed.
        leftovers: Pids of descendants still running when the root exited (they were ended).
    """

    returncode: int | None
    seconds: float
    timed_out: bool
    overflow: str | None
    stdout_tail: str
    stderr_tail: str
    stdout_path: Path | None
    stderr_path: Path | None
    leftovers: tuple[int, ...] = ()

    @property
    def ok(self) -> bool:
        """Exit 0, within the timeout and the output limit."""
        return self.returncode == 0

    def failure(self, timeout: float | None, max_output: int) -> str | None:
        """Why the run failed, in words (`exited with 3`, `timed out after 2 s`, ...), or None."""
        if self.timed_out:
            return f"timed out after {timeout:g} s"
        if self.overflow:
            return f"printed more than {max_output / 2**20:g} MiB on {self.overflow}; stopped"
        if self.returncode is not None and self.returncode < 0:
            name = signal.Signals(-self.returncode).name if -self.returncode in signal.valid_signals() else "?"
            return f"killed by signal {-self.returncode} ({name})"
        return None if self.returncode == 0 else f"exited with {self.returncode}"


class _Stream:
    """One output stream: a pipe drained into a file (its first `limit` bytes), its tail kept."""

    def __init__(self, path: Path | None, limit: int, tail_bytes: int, overflowed: threading.Event) -> None:
        if path is None:
            fd, name = tempfile.mkstemp(prefix="orchestrate-output-")
            self.path, self.temporary = Path(name), True
            self._file = os.fdopen(fd, "wb")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.path, self.temporary = path, False
            self._file = open(path, "wb")  # noqa: SIM115 (closed by the pump when the stream ends)
        self.read_fd, self.write_fd = os.pipe()
        self.total = 0
        self.tail = b""
        self._limit, self._tail_bytes, self._overflowed = limit, tail_bytes, overflowed
        self._thread = threading.Thread(target=self._pump, name=f"output {self.path.name}", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            while chunk := os.read(self.read_fd, 1 << 16):
                room = self._limit - self.total
                if room > 0:
                    self._file.write(chunk[:room])
                self.total += len(chunk)
                self.tail = (self.tail + chunk)[-self._tail_bytes :]
                if self.total > self._limit:
                    self._overflowed.set()
        finally:
            self._file.close()
            os.close(self.read_fd)

    def close_writer(self) -> None:
        """Drop this process's copy of the write end (the workload holds its own)."""
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1

    def finish(self) -> str:
        """Wait for the stream's end (every writer gone) and return its tail, decoded.

        Under a keeper every writer is gone once the tree is; elsewhere a descendant that escaped
        the tree may hold the pipe, so the wait is bounded.
        """
        self.close_writer()
        self._thread.join(None if keeper_supported() else 10.0)
        return self.tail.decode("utf-8", errors="replace")


def run_tree(
    argv: Sequence[str],
    *,
    timeout: float | None = None,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    stdout: Path | None = None,
    stderr: Path | Literal["stdout"] | None = None,
    pass_fds: Sequence[int] = (),
    max_output: int = DEFAULT_MAX_OUTPUT,
    tail_bytes: int = DEFAULT_TAIL_BYTES,
    grace: float = 0.0,
) -> TreeResult:
    """Run `argv` as a process tree and return once the whole tree is gone.

    Args:
        argv: The command.
        timeout: Seconds before the tree is killed; None: no limit.
        cwd, env: Working directory and environment (`env` None: this process's; see
            `workload_env` for a workload's).
        stdout, stderr: The files the streams go to (None: a temp file, removed after the
            call; `stderr="stdout"`: one file for both, as `2>&1`).
        pass_fds: Descriptors the workload inherits (the GPU lock's: `held_lock_fds()`).
        max_output: Bytes per stream before the tree is stopped (`overflow`).
        tail_bytes: How much of each stream's end the result carries.
        grace: Seconds between SIGTERM and SIGKILL when ending the tree (0: SIGKILL at once).

    Raises:
        OSError: The command cannot be started (FileNotFoundError, PermissionError, ...).
    """
    overflowed = threading.Event()
    streams = [_Stream(stdout, max_output, tail_bytes, overflowed)]
    if stderr != "stdout":
        streams.append(_Stream(stderr, max_output, tail_bytes, overflowed))
    out, err = streams[0], streams[-1]
    try:
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        timed_out = False
        tree = ProcessTree(
            argv,
            cwd=cwd,
            env=env,
            pass_fds=pass_fds,
            stdin=subprocess.DEVNULL,
            stdout=out.write_fd,
            stderr=err.write_fd,
        )
        with tree:
            for stream in streams:
                stream.close_writer()
            while tree.wait(_step(deadline)) is None:
                timed_out = deadline is not None and time.monotonic() >= deadline
                if overflowed.is_set() or timed_out:
                    break
            left = tree.end(grace)
        seconds = tree.seconds if tree.seconds is not None and not timed_out else time.monotonic() - start
        tails = [stream.finish() for stream in streams]
        overflow = next((n for n, s in zip(("stdout", "stderr"), streams, strict=False) if s.total > max_output), None)
        returncode = None if (timed_out or overflow) else tree.poll()
        return TreeResult(
            returncode=returncode,
            seconds=seconds,
            timed_out=timed_out,
            overflow=overflow,
            stdout_tail=tails[0],
            stderr_tail=tails[1] if len(tails) > 1 else "",
            stdout_path=None if out.temporary else out.path,
            stderr_path=None if err.temporary else err.path,
            leftovers=tuple(p for p in left if p != tree.pid) if returncode is not None else (),
        )
    finally:
        for stream in streams:
            stream.close_writer()
            if stream.temporary:
                stream.finish()
                stream.path.unlink(missing_ok=True)


def _step(deadline: float | None) -> float:
    step = POLL_S * 4
    return step if deadline is None else max(0.0, min(step, deadline - time.monotonic()))


def workload_env(base: Mapping[str, str] | None = None, overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a workload (a benchmark, a build) runs with: `base` (default: this
    process's) without Ray's variables, then `overrides` (the arm's env) on top.

    Ray's variables (`RAY_*`: the token's path `RAY_AUTH_TOKEN_PATH`, a literal `RAY_AUTH_TOKEN`,
    the cluster address, the job and node ids, the TLS key paths) are what would let third-party
    code join the cluster as us; none reaches the workload. Everything else (PATH, HOME, CUDA and
    ROCm settings, the host's `env` from the inventory, `ROCM_GPU_GUARD_LOCK_HELD`) does.
    """
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith(SCRUBBED_PREFIXES)}
    env.update(overrides or {})
    return env
