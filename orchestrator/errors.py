"""The one error family for what a user can fix, and the exit codes of `orchestrate`.

Every `OrchestratorError` is caught once, at the CLI boundary, and printed as one line. A
traceback means a bug in this package, never a bad file or an unreachable host.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_CRITERION_FAILED = 1
EXIT_USAGE = 2
EXIT_INFRASTRUCTURE = 3
EXIT_AMBIGUOUS = 4
EXIT_CONTENDED = 5  # jobs saw a foreign GPU user: their points are not measured yet (rerun)
EXIT_LOCK_TIMEOUT = 75  # as the seeds' rocm_gpu_guard.sh (EX_TEMPFAIL)


class OrchestratorError(Exception):
    """A problem the user can fix: bad input, an unreachable host, a lock that stayed busy."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, *, where: str | None = None) -> None:
        self.message = message
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


class InputError(OrchestratorError):
    """A file, argument or field that is wrong. Exit 2; nothing was started or written."""

    exit_code = EXIT_USAGE


class InfrastructureError(OrchestratorError):
    """A host, cluster or store that cannot do its part. Exit 3."""

    exit_code = EXIT_INFRASTRUCTURE


class LockTimeoutError(OrchestratorError):
    """The GPU lock stayed busy past its maximum wait. Exit 75."""

    exit_code = EXIT_LOCK_TIMEOUT
