"""A conventional CLI: -h, --version, help on a bare `orchestrate`, enum choices with suggestions,
help text printed as written, one --format and --output on every data-printing command, and the
quick-look commands (results, runs, history) on a real store."""

from __future__ import annotations

import csv
import datetime as dt
import importlib
import io
import json
import re
import subprocess
import sys
from enum import Enum
from pathlib import Path

import click
import pytest
import typer

from orchestrator.cli import COMMAND_MODULES, VERBS, app
from tests.conftest import child_env
from tests.orchestrator.test_dataset import DAY, write_job

DATA_COMMANDS = ["results", "runs", "query", "compare", "history", "check"]


def orchestrate(
    bin_: str, *args: str, columns: str = "120", cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [bin_, *args], capture_output=True, text=True, env=child_env(COLUMNS=columns), timeout=120, cwd=cwd
    )


def all_commands() -> list[tuple[list[str], click.Command]]:
    """Every command and subcommand of the CLI, with its path of names."""
    root = typer.main.get_command(app)
    out: list[tuple[list[str], click.Command]] = []

    def walk(path: list[str], cmd: click.Command) -> None:
        out.append((path, cmd))
        for name, sub in getattr(cmd, "commands", {}).items():
            walk([*path, name], sub)

    walk([], root)
    return out


def choices_of(param: object) -> list[str]:
    """The choices of an option declared with an Enum (what typer shows and checks)."""
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    return [e.value for e in annotation] if isinstance(annotation, type) and issubclass(annotation, Enum) else []


def test_help_version_and_a_bare_orchestrate(orchestrate_bin: str) -> None:
    bare = orchestrate(orchestrate_bin)
    assert bare.returncode in (0, 2) and "Usage: orchestrate [OPTIONS] COMMAND" in bare.stdout + bare.stderr
    assert "compare" in bare.stdout + bare.stderr and "compact" in bare.stdout + bare.stderr
    short = orchestrate(orchestrate_bin, "-h")
    assert short.returncode == 0 and short.stdout == orchestrate(orchestrate_bin, "--help").stdout
    assert orchestrate(orchestrate_bin, "-h", "compare").stdout == short.stdout  # its own help: every verb
    version = orchestrate(orchestrate_bin, "--version")
    assert version.returncode == 0 and re.fullmatch(r"orchestrate \d+\.\d+\.\d+ \(commit \S+\)\n", version.stdout)


def test_the_verb_map_names_what_each_module_registers() -> None:
    """`VERBS` (what a run of one verb imports) against what each command module really registers."""
    registered: dict[str, str] = {}
    for module in COMMAND_MODULES:
        alone = typer.Typer()
        importlib.import_module(module).register(alone)
        names = [c.name for c in alone.registered_commands] + [g.name for g in alone.registered_groups]
        assert names and all(isinstance(n, str) for n in names), module
        for name in names:
            assert name not in registered, f"{name} registered by {registered.get(name)} and {module}"
            registered[str(name)] = module
    assert registered == VERBS
    assert set(typer.main.get_command(app).commands) == set(VERBS)  # type: ignore[attr-defined]


# Run a command line through `main` and print, at exit, the modules the process imported.
IMPORTS = """
import atexit, json, sys
atexit.register(lambda: print("\\nIMPORTED " + json.dumps(sorted(sys.modules)), file=sys.stderr))
from orchestrator.cli import main
sys.argv = ["orchestrate", *sys.argv[1:]]
main()
"""


def imported_by(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    out = subprocess.run([sys.executable, "-c", IMPORTS, *args], capture_output=True, text=True, env=child_env(),
                         timeout=120)  # fmt: skip
    marker = out.stderr.rindex("IMPORTED ")
    return out, set(json.loads(out.stderr[marker + len("IMPORTED ") :]))


def test_a_verb_imports_its_own_module_and_what_it_needs_alone(store_root: Path) -> None:
    count, modules = imported_by("query", "select count(*) as n from results", "-r", str(store_root))
    assert count.returncode == 0 and count.stdout.split()[-3:] == ["48", "(1", "rows)"], count.stdout + count.stderr
    commands = {m for m in modules if m.startswith("orchestrator.commands.")}
    assert commands == {"orchestrator.commands.query", "orchestrator.commands.options"}
    # the count needs DuckDB and an Arrow table: not the comparison's statistics, pandas or Ray
    heavy = {"pandas", "pyarrow.compute", "pyarrow.dataset", "rich.progress", "ray", "scipy", "tabulate"}
    assert not modules & (
        heavy | {"orchestrator.analysis.stats", "orchestrator.specs.sweep", "orchestrator.store.index"}
    )
    compared, modules = imported_by("compare", "-r", str(store_root), "--by", "run", "-f", "json")
    assert compared.returncode == 0 and json.loads(compared.stdout), compared.stderr
    # (pandas may come: pyarrow imports it to ask whether a Python value it converts is a pandas object)
    assert not modules & {"pyarrow.dataset", "rich.progress", "ray", "orchestrator.commands.run"}
    version, modules = imported_by("--version")
    assert version.returncode == 0 and version.stdout.startswith("orchestrate ")
    assert not {m for m in modules if m.startswith("orchestrator.commands.")}
    helped, modules = imported_by("--help")
    assert helped.returncode == 0 and {f"orchestrator.commands.{v}" for v in ("run", "compact", "query")} <= modules
    assert all(f"\n  {verb} " in helped.stdout or f"\n  {verb}\n" in helped.stdout for verb in VERBS), helped.stdout


def test_a_mistyped_verb_is_refused_with_the_closest_one(orchestrate_bin: str) -> None:
    for typo, meant in (("comapre", "compare"), ("qurey", "query"), ("schedul", "schedule")):
        out = orchestrate(orchestrate_bin, typo)
        assert out.returncode == 2 and f"No such command '{typo}'. Did you mean '{meant}'?" in out.stderr, out.stderr


def test_every_help_is_printed_as_written() -> None:
    """Each command's help text and each option's help appear whole in its `-h` (no markup eaten:
    `[head]` stays), every command takes -h, and choices are listed."""
    from typer.testing import CliRunner

    runner = CliRunner()
    for path, cmd in all_commands():
        out = runner.invoke(app, [*path, "-h"])
        assert out.exit_code == 0, (path, out.output)
        text = " ".join(out.output.split())
        for param in cmd.params:
            help_text = getattr(param, "help", None)
            if help_text:
                assert " ".join(help_text.split()) in text, (path, help_text)
            if choices_of(param):
                assert "|".join(choices_of(param)) in text, (path, param.name)
    up = runner.invoke(app, ["cluster", "up", "-h"])
    assert "[head] address" in " ".join(up.output.split())


@pytest.mark.parametrize(
    ("args", "suggestion"),
    [
        (["compare", "--format", "tabel"], "did you mean 'table'?"),
        (["compare", "--by", "comit"], "did you mean 'commit'?"),
        (["compare", "--view", "device"], "did you mean 'devices'?"),
        (["plan", "--device", "h200", "--out", "x", "--backend", "cudda"], "did you mean 'cuda'?"),
        (["query", "select 1", "-f", "jsn"], "did you mean 'json'?"),
    ],
)
def test_a_mistyped_choice_is_refused_with_a_suggestion(orchestrate_bin: str, args: list[str], suggestion: str) -> None:
    out = orchestrate(orchestrate_bin, *args)
    assert out.returncode == 2 and suggestion in out.stderr and "is not one of" in out.stderr


def test_every_data_command_offers_format_and_output() -> None:
    commands = {" ".join(path): cmd for path, cmd in all_commands()}
    for name in DATA_COMMANDS:
        opts = {o for p in commands[name].params for o in getattr(p, "opts", [])}
        assert {"--format", "--output", "--results"} <= opts, name
        fmt = next(p for p in commands[name].params if "--format" in getattr(p, "opts", []))
        assert choices_of(fmt) == ["table", "md", "csv", "json"], name
    results_opts = [p for path, cmd in all_commands() for p in cmd.params if "--results" in getattr(p, "opts", [])]
    assert results_opts and all(p.envvar == "ORCHESTRATE_RESULTS" and p.show_envvar for p in results_opts[:1])


@pytest.fixture
def store_root(tmp_path: Path) -> Path:
    """Two nights of a sweep: point tokens=1 faster on the second."""
    from orchestrator.store.fragments import ResultStore

    store = ResultStore(tmp_path / "results")
    for d, run in enumerate(("20261130T020000Z-aaaa", "20261201T020000Z-bbbb")):
        for i in range(3):
            write_job(store, i, day=DAY + dt.timedelta(days=d), run_id=run, samples=4)
    return store.root


def test_results_is_a_compact_table_with_units_and_machine_formats(store_root: Path, orchestrate_bin: str) -> None:
    out = orchestrate(orchestrate_bin, "results", "-r", str(store_root), columns="100")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert lines[0].startswith("sweep nightly: 24 rows, each point's newest run (cpu qmm)")
    row = next(line for line in lines if "tokens=2" in line and "native" in line)
    assert re.search(r"tokens=2 +native +time +2\.000 s +0\.0% +4 +0\.667x affine", row), row
    assert any(re.search(r"tokens=2 +affine +time +3\.000 s .* baseline$", line) for line in lines), out.stdout
    assert [line.split()[1] for line in lines if line.startswith("tokens=1")] == ["affine", "native"]  # baseline first
    doc = json.loads(orchestrate(orchestrate_bin, "results", "-r", str(store_root), "-f", "json").stdout)
    native = next(r for r in doc if r["arm"] == "native" and json.loads(r["params"])["tokens"] == 2)
    assert native["median"] == 2.0 and native["unit"] == "seconds" and native["ratio"] == pytest.approx(2 / 3)
    assert native["baseline"] == "affine" and native["n"] == 4
    rows = list(
        csv.DictReader(io.StringIO(orchestrate(orchestrate_bin, "results", "-r", str(store_root), "-f", "csv").stdout))
    )
    assert len(rows) == 6 and rows[0]["device"] == "cpu"
    md = orchestrate(orchestrate_bin, "results", "-r", str(store_root), "-f", "md").stdout
    assert md.startswith("### sweep nightly: 24 rows") and re.search(
        r"\| tokens=2 +\| native +\| time +\| +2\.000 s \|", md
    )


def test_runs_lists_the_stored_runs(store_root: Path, orchestrate_bin: str, tmp_path: Path) -> None:
    target = tmp_path / "runs.json"
    out = orchestrate(orchestrate_bin, "runs", "-r", str(store_root), "-f", "json", "-o", str(target))
    assert out.returncode == 0 and out.stdout == ""
    runs = json.loads(target.read_text())
    assert [r["run_id"] for r in runs] == ["20261130T020000Z-aaaa", "20261201T020000Z-bbbb"]
    assert runs[0]["jobs"] == 3 and runs[0]["failed_jobs"] == 0 and runs[0]["rows"] == 24
    assert runs[0]["dates"] == ["2026-11-30"] and runs[0]["devices"] == ["cpu"] and runs[0]["sweep"] == "nightly"
    table = orchestrate(orchestrate_bin, "runs", "-r", str(store_root))
    assert "20261201T020000Z-bbbb" in table.stdout and "(2 rows)" in table.stdout


def test_history_draws_a_png_only_when_asked(store_root: Path, orchestrate_bin: str, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    out = orchestrate(orchestrate_bin, "history", "qmm", "-r", str(store_root), cwd=work)
    assert out.returncode == 0, out.stderr
    assert "history of qmm: seconds" in out.stdout and list(work.iterdir()) == []
    png = work / "trend.png"
    drawn = orchestrate(orchestrate_bin, "history", "qmm", "-r", str(store_root), "--png", str(png), cwd=work)
    assert drawn.returncode == 0 and png.read_bytes()[:4] == b"\x89PNG"
    records = json.loads(orchestrate(orchestrate_bin, "history", "qmm", "-r", str(store_root), "-f", "json").stdout)
    assert len(records) == (6 + 3) * 2 and {r["run_id"] for r in records} == {
        "20261130T020000Z-aaaa",
        "20261201T020000Z-bbbb",
    }
    own = [r for r in records if "/" not in r["arm"]]
    assert len(own) == 12 and all(r["unit"] == "seconds" and r["n"] == 4 for r in own)
    ratios = [r for r in records if "/" in r["arm"]]  # each arm to the baseline, per ABBA block of 2 samples
    assert {r["arm"] for r in ratios} == {"native/affine"} and all(r["unit"] == "x" and r["n"] == 2 for r in ratios)
