"""The README's quickstart and tour, run as written: every command block, in order, in one fresh
directory, on this checkout. A block whose first line is `# not run by tests/docs: <why>` is
skipped (that line shows in the README, so a reader sees which blocks are not checked).

One thing differs from a user's shell: `orchestrate run` without `--inventory` gets a copy of the
embedded default whose CPU-quiet gate ignores other processes, since this test shares a busy
machine with other tests and the gate would rightly call them contention (exit 5).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SKIP_MARK = "# not run by tests/docs:"
FENCE = re.compile(r"^```(sh|python)\n(.*?)^```", re.S | re.M)

QUIET_DEFAULT = """\
[[hosts]]
name = "local"
device = "auto"
backend = "auto"
gpus = "all"
cpu_busy_threshold = 1e9
"""

SHIM = """\
import sys
sys.path.insert(0, {repo!r})
from orchestrator.cli import main
args = sys.argv[1:]
if args[:1] == ["run"] and "--inventory" not in args and "-i" not in args:
    args += ["--inventory", {inventory!r}]
sys.argv = [sys.argv[0], *args]
sys.exit(main())
"""


def tour_blocks(readme: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block from `## Quickstart` up to the section after the tour."""
    start = readme.index("## Quickstart")
    end = readme.index("\n## ", readme.index("## A five-minute tour") + 1)
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(readme[start:end])]


def test_the_tour_parses_into_runnable_blocks() -> None:
    blocks = tour_blocks((REPO / "README.md").read_text())
    skipped = [code for _, code in blocks if code.startswith(SKIP_MARK)]
    run = [code for _, code in blocks if not code.startswith(SKIP_MARK)]
    assert len(skipped) == 1 and "make run" in skipped[0]
    assert len(run) >= 4
    assert run[0].strip() == "orchestrate run"


@pytest.mark.slow
def test_every_tour_block_runs(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    inventory = tmp_path / "quiet-default.toml"
    inventory.write_text(QUIET_DEFAULT)
    shim = bin_dir / "orchestrate"
    shim.write_text(f"#!{sys.executable}\n" + SHIM.format(repo=str(REPO), inventory=str(inventory)))
    shim.chmod(0o755)
    work = tmp_path / "tour"
    work.mkdir()
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = str(REPO)
    env["ORCHESTRATE_RESULTS"] = str(work / "results")  # the README's ./results
    env["COLUMNS"] = "120"

    outputs = []
    for language, code in tour_blocks((REPO / "README.md").read_text()):
        if code.startswith(SKIP_MARK):
            continue
        argv = ["bash", "-euo", "pipefail", "-c", code] if language == "sh" else [sys.executable, "-c", code]
        done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=600)
        failed = f"README block failed (exit {done.returncode}):\n{code}\n{done.stdout}{done.stderr}"
        assert done.returncode == 0, failed
        outputs.append(done.stdout)

    # what the tour promises a reader, checked on what it left behind
    run_out, _, my_sweep_out, parquet_out = outputs
    assert "qmm on cpu, baseline affine" in run_out
    assert "### qmm on cpu, baseline affine" in (work / "smoke.md").read_text()
    assert (work / "smoke.html").read_text().startswith("<!DOCTYPE html>")
    assert re.search(r"^PASS +native prefill at least half as fast as affine", my_sweep_out, re.M)
    for case in ("qmm", "moe-gather", "mlp", "model"):
        assert case in parquet_out
    assert sorted(p.name for p in (work / "results").glob("sweep=*")) == ["sweep=my-sweep", "sweep=smoke"]
