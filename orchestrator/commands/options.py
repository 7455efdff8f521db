"""The options several commands share, declared once so that they read the same in every `--help`.

Lists are written one way everywhere: repeat the option or separate values with commas
(`--arms native,affine` is `--arms native --arms affine`).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path

import typer

from orchestrator.report.output import Format

RESULTS_ENV = "ORCHESTRATE_RESULTS"
DEFAULT_RESULTS = Path("results")


class By(StrEnum):
    """What `compare` puts side by side."""

    arm = "arm"
    run = "run"
    commit = "commit"
    device = "device"


class View(StrEnum):
    """`compare`'s two views."""

    arms = "arms"
    devices = "devices"


class Backend(StrEnum):
    """The backends a device kind runs on."""

    cpu = "cpu"
    cuda = "cuda"
    metal = "metal"
    rocm = "rocm"


def results_option() -> Path:
    """`--results DIR` (default ./results, or $ORCHESTRATE_RESULTS)."""
    return typer.Option(
        DEFAULT_RESULTS,
        "--results",
        "-r",
        envvar=RESULTS_ENV,
        show_envvar=True,
        metavar="DIR",
        help="results directory",
    )


def format_option(what: str = "the data") -> Format:
    """`--format table|md|csv|json`."""
    return typer.Option(
        Format.table,
        "--format",
        "-f",
        case_sensitive=False,
        help=f"how to print {what}: a table fitted to the terminal, Markdown, CSV or a JSON array of records",
    )


def output_option() -> Path | None:
    """`--output FILE`."""
    return typer.Option(
        None, "--output", "-o", dir_okay=False, metavar="FILE", help="write to FILE (whole or not at all), not stdout"
    )


def sweep_option(required: bool = False, default: str | None = None) -> str | None:
    """`--sweep NAME|FILE`."""
    return typer.Option(
        ... if required else default,
        "--sweep",
        "-s",
        metavar="NAME|FILE",
        help="a stored sweep's name, a built-in sweep or a sweep TOML (default: the only stored sweep)",
    )


def list_option(flag: str, what: str, short: str | None = None, metavar: str = "NAME") -> list[str] | None:
    """A list option: repeatable, each value may hold several, comma-separated."""
    flags = [flag, short] if short else [flag]
    return typer.Option(
        None, *flags, metavar=f"{metavar}[,{metavar}...]", help=f"{what} (repeat, or separate with commas)"
    )


def split_list(values: Sequence[str] | None) -> list[str] | None:
    """The values of a list option, commas split, blanks and repeats dropped (None when none given)."""
    if not values:
        return None
    out = [v.strip() for value in values for v in value.split(",") if v.strip()]
    return list(dict.fromkeys(out)) or None


def compact_after_option() -> int:
    """`--compact-after DAYS` of `run` and `schedule add`."""
    from orchestrator.store.compact import COMPACT_AFTER_DAYS  # its store index: kept out of the query verb's start

    return typer.Option(
        COMPACT_AFTER_DAYS,
        "--compact-after",
        min=0,
        metavar="DAYS",
        help="then compact the sweep's partitions dated DAYS or more days ago, as `orchestrate compact` does",
    )


def no_compact_option() -> bool:
    """`--no-compact` of `run` and `schedule add`."""
    return typer.Option(False, "--no-compact", help="leave the stored partitions as they are (no compaction)")
