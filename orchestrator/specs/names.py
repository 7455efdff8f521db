"""What the names and values users write may be: matched whole (`fullmatch`: a trailing newline
is no name), so a name is safe as a file name, a crontab tag, a Ray label or a shell word.

`Strict` is the base of every file model: unknown fields are errors, and `nan` and `inf` (TOML
floats) are no setting.
"""

from __future__ import annotations

import ipaddress
import re

from pydantic import BaseModel, ConfigDict

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Host names, users and paths go into remote shell commands (quoted, but refused up front too).
SAFE_RE = re.compile(r"[A-Za-z0-9_./~@:+-]+")
# Host names, device kinds and labels become Ray node labels: Ray refuses others at `ray start`.
RAY_LABEL_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")
BACKENDS = ("cpu", "cuda", "metal", "rocm")


def check_name(value: str, what: str) -> str:
    """A name (sweep, case, arm, device kind): letters, digits, `.`, `_`, `-`, from a letter or digit."""
    if not NAME_RE.fullmatch(value):
        raise ValueError(f"{what} {value!r} must be letters, digits, '.', '_' or '-' (starting with a letter or digit)")
    return value


def check_label(value: str, what: str) -> str:
    """A Ray node label key or value (host names, device kinds, labels), as `ray start` checks it."""
    if not RAY_LABEL_RE.fullmatch(value):
        raise ValueError(
            f"{what} {value!r} must be at most 63 letters, digits, '.', '_' or '-', starting and ending with a letter "
            "or digit (it is a Ray node label)"
        )
    return value


def check_ip(value: str | None, what: str) -> str | None:
    """An IP address (a node's), or None."""
    if value is not None:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(
                f"{what} {value!r} is not an IP address (Ray wants the node's IP, not a host name)"
            ) from None
    return value


def check_safe(value: str | None, what: str) -> str | None:
    """A host, user or path that goes into a remote command line: no shell metacharacter, or None."""
    if value is not None and not SAFE_RE.fullmatch(value):
        raise ValueError(f"{what} {value!r} contains shell metacharacters, spaces or control characters")
    return value


def check_env(env: dict[str, str]) -> dict[str, str]:
    """Environment variable names are `[A-Za-z_][A-Za-z0-9_]*`; no value holds a NUL byte."""
    for key, value in env.items():
        if not ENV_KEY_RE.fullmatch(key):
            raise ValueError(
                f"environment variable name {key!r} is not valid (letters, digits and '_', not starting with a digit)"
            )
        if "\0" in value:
            raise ValueError(f"environment variable {key}: the value holds a NUL byte")
    return env


class Strict(BaseModel):
    """A file model: unknown fields are errors, `nan` and `inf` are no setting."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # `nan` and `inf` are TOML floats, never a setting
