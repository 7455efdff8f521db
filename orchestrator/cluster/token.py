"""The cluster's Ray token on the head: made before Ray can, checked, replaced, used.

Ray's token authentication (`RAY_AUTH_MODE=token`) admits only processes that present the token,
so whoever can read the token file can run code as the benchmark user on every node. The head's
token is Ray's own file (`$RAY_AUTH_TOKEN_PATH`, else `~/.ray/auth_token`): made here, mode 0600
from its first byte, with 256 random bits, never printed or logged. A token file that other users
can read is treated as leaked and replaced (with a warning); a symbolic link, a non-regular file
or another user's file is refused. `use_token` forces token authentication for this process and
its children whatever `RAY_AUTH_MODE` said (the embedded instance uses it too), and `cluster up
--rotate-token` replaces the token (`rotate_token`).
"""

from __future__ import annotations

import os
import secrets
import stat
import sys
from pathlib import Path

from orchestrator.errors import InfrastructureError
from workers.files import write_atomic


def token_path() -> Path:
    """Where the head keeps Ray's token: `$RAY_AUTH_TOKEN_PATH`, else `~/.ray/auth_token`."""
    raw = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return Path(raw).expanduser() if raw else Path.home() / ".ray" / "auth_token"


def _say(message: str) -> None:
    print(f"orchestrate: {message}", file=sys.stderr, flush=True)


def token_problem(path: Path | None = None) -> str | None:
    """Why the token file (default: the head's) cannot be trusted, or None (also when it is missing)."""
    path = path or token_path()
    try:
        info = path.lstat()
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    if info.st_uid != os.geteuid():
        return f"belongs to uid {info.st_uid}, not to this user"
    if info.st_mode & 0o077:
        return f"is readable by other users (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def _write_token(path: Path) -> None:
    """A fresh token (256 random bits) at `path`, mode 0600 from its first byte, replacing atomically."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_atomic(path, lambda fh: fh.write(secrets.token_hex(32).encode()), mode=0o600)


def ensure_token() -> Path:
    """The head's token file: made (mode 0600, 256 random bits) before Ray could make its own.

    A token file other users can read is treated as leaked: it is replaced with a fresh one
    (mode 0600) and a warning says so (a Ray head started with the old token must be restarted).
    A symbolic link, a non-regular file or another user's file is refused.

    Raises:
        InfrastructureError: the token path cannot be used.
    """
    path = token_path()
    problem = token_problem(path)
    if problem is None and path.exists():
        return path
    if problem is not None and "readable by other users" not in problem:
        raise InfrastructureError(f"Ray token {path} {problem}; refusing to use it (remove it to get a new one)")
    _write_token(path)
    if problem is not None:
        _say(
            f"warning: Ray token {path} {problem}: treated as leaked and replaced with a new one (mode 0600); "
            "a Ray head started with the old token must be restarted (`orchestrate cluster down`, then `up`)"
        )
    return path


def rotate_token() -> Path:
    """Replace the head's token with a fresh one (mode 0600); hosts get it on the next `cluster up`."""
    path = token_path()
    problem = token_problem(path)
    if problem is not None and "readable by other users" not in problem:
        raise InfrastructureError(f"Ray token {path} {problem}; refusing to replace it")
    _write_token(path)
    return path


def use_token(path: Path) -> None:
    """Make this process (and its children) use Ray's token authentication with the token at `path`,
    whatever `RAY_AUTH_MODE` the environment held."""
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)
    os.environ.pop("RAY_AUTH_TOKEN", None)  # a literal token would win over the file we checked
    try:  # Ray caches the token per process; a test or a second inventory may point elsewhere.
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]  # Ray: only here

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):
        pass


def enable_token_auth() -> None:
    """Use the head's token (made by `orchestrate cluster up`) to reach the cluster.

    Raises:
        InfrastructureError: no token, or one that cannot be trusted (readable by others: the
            cluster's token may be known; `cluster down` and `cluster up` replace it).
    """
    path = token_path()
    if not path.exists():
        raise InfrastructureError(f"no Ray token at {path}: start the cluster with `orchestrate cluster up`")
    problem = token_problem(path)
    if problem is not None:
        raise InfrastructureError(
            f"Ray token {path} {problem}: treat the cluster's token as leaked; "
            "run `orchestrate cluster down`, then `orchestrate cluster up` (which replaces it)"
        )
    use_token(path)
