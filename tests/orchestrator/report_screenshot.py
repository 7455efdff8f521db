"""Make `docs/report.png`: the first screen of an HTML report, as a real headless Chromium shows it.

    python -m tests.orchestrator.report_screenshot docs/report.png
        # from a fixed set of H200 numbers (`h200_benchmarks`: one value per point and arm)
    python -m tests.orchestrator.report_screenshot docs/report.png --results results --sweep nvfp4-prefill
        # from stored rows, e.g. an H200 run's fragments after `orchestrate import`

The window is 1400 x 900 CSS pixels at scale 1 (a laptop's browser window); the HTML is kept
beside the PNG's temporary directory only while the browser reads it.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from orchestrator.analysis.selection import select_results
from orchestrator.report.html import build_report, write_report
from orchestrator.store.dataset import read_rows
from orchestrator.store.fragments import ResultStore
from tests.orchestrator.chromium_page import DevToolsPage

WINDOW = (1400, 900)


def screenshot(document: str, out: Path, *, window: tuple[int, int] = WINDOW) -> list[str]:
    """Open `document` in headless Chromium at `window`, save the first screen to `out`; the page's errors."""
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:  # Chromium's helpers may still write
        page_file = write_report(Path(tmp) / "report.html", document)
        with DevToolsPage(Path(tmp) / "chromium") as page:
            page.set_window(*window)
            seen = page.open(page_file)
            page.screenshot(out)
    return seen.errors


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--results", type=Path, help="a results directory (default: BENCHMARKS.md's H200 numbers)")
    parser.add_argument("--sweep", help="the stored sweep to report on (with --results)")
    args = parser.parse_args(argv)
    if args.results is not None:
        store = ResultStore(args.results)
        table, spec = select_results(store, args.sweep, None)
        history = read_rows(store, sweep=table["sweep"][0].as_py())
    else:
        from tests.orchestrator.h200_benchmarks import h200_rows

        table, spec = h200_rows()
        history = None
    errors = screenshot(build_report(table, spec=spec, history=history), args.out)
    for error in errors:
        print(f"page error: {error}")
    print(f"wrote {args.out}")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
