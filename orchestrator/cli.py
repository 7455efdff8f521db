"""`orchestrate`: a thin shell over the library. Each verb lives in `orchestrator/commands/`.

Errors of the `OrchestratorError` family are caught here, once, and printed as one line with the
exit code the error carries. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import importlib
import sys

import typer

from orchestrator.errors import OrchestratorError

app = typer.Typer(
    name="orchestrate",
    help="Run NVFP4 kernel sweeps across hosts and turn them into trustworthy comparisons.",
    no_args_is_help=False,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# One module per verb; each exposes `register(app)`.
COMMAND_MODULES = [
    "orchestrator.commands.run",
    "orchestrator.commands.results",
    "orchestrator.commands.lock",
    "orchestrator.commands.compare",
    "orchestrator.commands.check",
    "orchestrator.commands.report",
    "orchestrator.commands.schedule",
    "orchestrator.commands.history",
    "orchestrator.commands.cluster",
    "orchestrator.commands.collect",
    "orchestrator.commands.plan",
    "orchestrator.commands.phases",
]

for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def main() -> None:
    """Console-script entry point."""
    try:
        code = app(standalone_mode=False)
    except OrchestratorError as exc:
        print(f"orchestrate: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except SystemExit:
        raise
    except KeyboardInterrupt:  # before `run` took the signals over (or another command)
        print("orchestrate: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # click's usage errors
        import click

        if isinstance(exc, click.exceptions.Abort | typer.Abort):
            print("orchestrate: aborted", file=sys.stderr)
            sys.exit(130)
        # typer 0.29 vendors click (typer._click): its usage errors are TyperExceptions with show()
        show = getattr(exc, "show", None)
        if isinstance(exc, click.ClickException | typer.TyperException) and callable(show):
            show()
            sys.exit(2)
        raise
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
