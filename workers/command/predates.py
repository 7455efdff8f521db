"""Failures an older commit of the engine explains: an option or a target the commit does not have yet.

A sweep written against today's engine names options (`rocm_gpu_guard.sh --hold`,
`bench_decode.sh --prompt-tokens`) and cargo targets (`--test rocm_nvfp4_quant`) that an older
`ref` predates. Such a command fails with the script's or cargo's own complaint, which says
nothing about the commit; `explain` turns it into one line that names the commit, what it lacks,
and what to change. A table of patterns, each a complaint and the message it becomes: the first
that matches (and whose option or target the commit indeed lacks) wins.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Finder = Callable[[re.Match[str], str, Path, str], str | None]


@dataclass(frozen=True)
class Predating:
    """One kind of complaint: its pattern and how to explain a match (None: it is something else)."""

    pattern: re.Pattern[str]
    explain: Finder


def _script_given(command: str, option: str) -> str | None:
    """The script in `command` that was given `option` (`scripts/rocm_gpu_guard.sh` for `--hold`)."""
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    script = None
    for word in words:
        if word.endswith(".sh"):
            script = word
        elif word in ("--", "|", "||", "&&", ";"):  # what follows is another command's
            script = None
        elif word == option and script is not None:
            return script
    return None


def _unknown_option(m: re.Match[str], command: str, checkout: Path, commit: str) -> str | None:
    option = m.group("option")
    script = _script_given(command, option)
    if script is None:
        return None
    path = checkout / script.removeprefix("./")
    if path.is_file() and option in path.read_text(errors="replace"):
        return None  # the script knows the option: the failure is something else
    shown = script.removeprefix("./")
    return (
        f"{shown} at {commit[:8]} does not know {option} (this commit predates it): "
        f"pick a newer ref or drop {option} from the sweep's build/gate/run"
    )


def _no_target(m: re.Match[str], command: str, checkout: Path, commit: str) -> str | None:
    kind, name = m.group("kind"), m.group("name")
    return (
        f"cargo target `--{kind} {name}` does not exist at {commit[:8]} (this commit predates it): "
        f"pick a newer ref or drop `--{kind} {name}` from the sweep's build/gate/run"
    )


TABLE = (
    # the engine's shell scripts: `rocm_gpu_guard: unknown option --hold`, `Unknown option: --x`
    Predating(re.compile(r"unknown option:?\s+['`\"]?(?P<option>--?[A-Za-z][\w-]*)", re.I), _unknown_option),
    # cargo: error: no test target named `rocm_nvfp4_quant` (also bin, example, bench)
    Predating(
        re.compile(r"error: no (?P<kind>test|bin|example|bench) target named [`'\"]?(?P<name>[\w.-]+)"), _no_target
    ),
)


def explain(output: str, command: str, checkout: Path, commit: str) -> str | None:
    """One line naming the commit and the option or target it lacks, or None when no pattern explains the failure.

    Args:
        output: the failed command's output (stderr's tail, or both streams).
        command: the command as run.
        checkout: the built checkout of `commit` (where the scripts are).
        commit: the commit the command ran at.
    """
    for entry in TABLE:
        for m in entry.pattern.finditer(output):
            line = entry.explain(m, command, checkout, commit)
            if line is not None:
                return line
    return None
