"""`orchestrate`: a thin shell over the library. Each verb lives in `orchestrator/commands/`.

Errors of the `OrchestratorError` family are caught here, once, and printed as one line with the
exit code the error carries. Anything else is a bug and keeps its traceback. `-h` and `--help`
work everywhere, a bare `orchestrate` prints the help, `--version` says which build this is, help
text is printed as written (no markup: `[head]` stays `[head]`), and a mistyped choice gets a
suggestion.
"""

from __future__ import annotations

import difflib
import importlib
import re
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

import typer

from orchestrator.errors import OrchestratorError
from orchestrator.run.code_version import code_version

# Which module registers each verb (a test checks it against what the modules register): a run
# of one verb imports that module alone, not every command's libraries.
VERBS = {
    "run": "orchestrator.commands.run",
    "results": "orchestrator.commands.results",
    "runs": "orchestrator.commands.results",
    "query": "orchestrator.commands.query",
    "lock": "orchestrator.commands.lock",
    "compare": "orchestrator.commands.compare",
    "check": "orchestrator.commands.check",
    "report": "orchestrator.commands.report",
    "schedule": "orchestrator.commands.schedule",
    "history": "orchestrator.commands.history",
    "bisect": "orchestrator.commands.bisect",
    "cluster": "orchestrator.commands.cluster",
    "collect": "orchestrator.commands.collect",
    "plan": "orchestrator.commands.plan",
    "import": "orchestrator.commands.plan",
    "phases": "orchestrator.commands.phases",
    "compact": "orchestrator.commands.compact",
}
# One module per verb (or two verbs); each exposes `register(app)`. `--help` lists the verbs in this order.
COMMAND_MODULES = list(dict.fromkeys(VERBS.values()))
GLOBAL_OPTIONS = ("--version", "-h", "--help")


def version_text() -> str:
    """`orchestrate 0.1.0 (commit abc123...)`."""
    try:
        number = version("orchestrate")
    except PackageNotFoundError:
        number = "unknown"
    return f"orchestrate {number} (commit {code_version()})"


def _version(value: bool) -> None:
    if value:
        print(version_text())
        raise typer.Exit(0)


def main_options(
    show_version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="print the version and commit, and exit"
    ),
) -> None:
    """Run NVFP4 kernel sweeps across hosts and turn them into trustworthy comparisons."""


def verb_of(args: Sequence[str]) -> str | None:
    """The verb of a command line (its first word after the global options); None when it has none,
    or when `-h` comes before it (the help of `orchestrate` itself, which lists every verb)."""
    for arg in args:
        if arg in ("-h", "--help"):
            return None
        if arg not in GLOBAL_OPTIONS:
            return None if arg.startswith("-") else arg
    return None


def build_app(args: Sequence[str] | None = None) -> typer.Typer:
    """The CLI for a command line: only its verb's module where the verb is known, else every verb
    (a bare `orchestrate`, `--help`, or a mistyped verb, which typer answers with the closest)."""
    verb = verb_of(args) if args is not None else None
    if verb is None and args and args[0] == "--version":
        modules: list[str] = []  # `--version` is answered before any verb is looked at
    else:
        modules = [VERBS[verb]] if verb in VERBS else COMMAND_MODULES
    app = typer.Typer(
        name="orchestrate",
        help="Run NVFP4 kernel sweeps across hosts and turn them into trustworthy comparisons.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    app.callback()(main_options)
    for name in modules:
        importlib.import_module(name).register(app)
    return app


def __getattr__(name: str) -> typer.Typer:
    """`orchestrator.cli.app`: the whole CLI, every verb registered (built on first use)."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    global _whole
    if _whole is None:
        _whole = build_app()
    return _whole


_whole: typer.Typer | None = None

CHOICE_ERROR = re.compile(r"'(?P<value>[^']*)' is not one of (?P<choices>'[^']*'(?:, '[^']*')*)")


def with_suggestion(message: str) -> str:
    """A bad-choice message with the closest choice suggested: `... is not one of ... (did you mean 'table'?)`."""
    m = CHOICE_ERROR.search(message)
    if not m:
        return message
    choices = re.findall(r"'([^']*)'", m.group("choices"))
    close = difflib.get_close_matches(m.group("value").lower(), choices, n=1, cutoff=0.5)
    return message.replace("Value error, ", "") + (f" (did you mean {close[0]!r}?)" if close else "")


def main() -> None:
    """Console-script entry point."""
    try:
        app = build_app(sys.argv[1:])
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
        import click  # click: only to classify an error (typer vendors its own)

        if isinstance(exc, click.exceptions.Abort | typer.Abort):
            print("orchestrate: aborted", file=sys.stderr)
            sys.exit(130)
        # typer 0.29 vendors click (typer._click): its usage errors are TyperExceptions with show()
        show = getattr(exc, "show", None)
        if isinstance(exc, click.ClickException | typer.TyperException) and callable(show):
            if isinstance(getattr(exc, "message", None), str):
                setattr(exc, "message", with_suggestion(exc.message))  # noqa: B010 (click declares it Final)
            show()
            sys.exit(getattr(exc, "exit_code", 2) or 2)
        raise
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
