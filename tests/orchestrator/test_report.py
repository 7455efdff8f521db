"""`orchestrate report --html`: a self-contained file, checked in a real headless Chromium (no
console errors, every plot decoded with a real size), and its content checked against the data."""

from __future__ import annotations

import base64
import datetime as dt
import re
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from orchestrator.report import build_report, write_report
from orchestrator.specs import SweepSpec
from orchestrator.store import ResultStore
from tests.conftest import child_env
from tests.orchestrator.chromium_page import DevToolsPage, chromium_binary
from tests.orchestrator.synthetic_rows import concat, job_table, noisy

TOKENS = (1, 512, 4096)
DEVICES = {"cpu": (4.0, 0.006, 1.0), "h200": (4000.0, 800.0, 900.0)}  # peak GB/s, peak TFLOP/s, speed


def two_device_rows(*, skip_h200_4096: bool = False) -> pa.Table:
    rng = np.random.default_rng(0)
    tables = []
    for device, (peak_gb, peak_tf, speed) in DEVICES.items():
        for tokens in TOKENS:
            if skip_h200_4096 and device == "h200" and tokens == 4096:
                continue
            values = {}
            for arm, f in (("native", 1.0), ("affine", 0.9)):
                m = {
                    "seconds": noisy(rng, 1e-3 * tokens**0.5 / f / speed, 0.02, 8),
                    "gb_per_s": noisy(rng, 0.5 * peak_gb * f, 0.02, 8),  # native at 50 % of the copy peak
                    "tflop_per_s": noisy(rng, 0.2 * peak_tf * f, 0.02, 8),
                    "peak_memory_bytes": [2e6 / f],
                    "rel_error": [4e-3],
                }
                m["decode_tok_s" if tokens == 1 else "prefill_tok_s"] = noisy(rng, 1000 * f * speed, 0.02, 8)
                values[arm] = m
            params = {"tokens": tokens, "n": 64, "k": 64}
            tables.append(job_table(values, params=params, device=device, peaks=(peak_gb, peak_tf), sweep="rep"))
    return concat(tables)


def spec() -> SweepSpec:
    return SweepSpec.model_validate(
        {
            "name": "rep",
            "baseline": "affine",
            "cases": [
                {"case": "qmm", "arms": ["native", "affine"], "params": {"tokens": list(TOKENS), "n": 64, "k": 64}}
            ],
            "criteria": [
                {
                    "name": "native prefill within 3 % of affine",
                    "metric": "prefill_tok_s",
                    "arm": "native",
                    "where": "tokens >= 4096",
                    "min_ratio": 0.97,
                },
                {"name": "native decode at least 2x affine", "metric": "decode_tok_s", "arm": "native", "min_ratio": 2},
                {
                    "name": "native peak memory below affine",
                    "metric": "peak_memory_bytes",
                    "arm": "native",
                    "max_ratio": 1,
                },
            ],
        }
    )


def test_report_is_self_contained_and_states_the_answers() -> None:
    doc = build_report(two_device_rows(skip_h200_4096=True), spec=spec())
    assert "<script" not in doc
    assert not re.search(r"""(src|href)=["'](?!data:)""", doc)  # nothing outside the file
    uris = re.findall(r'src="data:image/svg\+xml;base64,([^"]+)"', doc)
    assert len(uris) == 2 * 2 + 1  # per device: metrics and gap; then the share-of-peak figure
    for uri in uris:
        svg = base64.b64decode(uri).decode()
        assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    # Criteria: prefill passes on cpu but h200 4096 is missing -> AMBIGUOUS naming it; decode
    # 1.11x FAILs its 2x; memory (0.9 everywhere measured) is AMBIGUOUS for the same missing point.
    assert '<tr class="AMBIGUOUS"><td>AMBIGUOUS</td><td>native prefill within 3 % of affine' in doc
    assert "MISSING   h200 qmm tokens=4096: not run" in doc
    assert '<tr class="FAIL"><td>FAIL</td><td>native decode at least 2x affine' in doc
    assert '<tr class="AMBIGUOUS"><td>AMBIGUOUS</td><td>native peak memory below affine' in doc
    # Hosts: both fingerprints, with the peaks measured on them.
    assert "cpu-host" in doc and "h200-host" in doc and "4000.00" in doc
    # The comparison table: native +11.1 % prefill over affine (1/0.9).
    assert re.search(r"\+1[01]\.\d% \[", doc)


@pytest.mark.slow
@pytest.mark.skipif(chromium_binary() is None, reason="chromium is not installed (tests/setup-system.sh)")
def test_report_loads_in_chromium_without_errors_and_shows_every_plot(tmp_path: Path) -> None:
    path = write_report(tmp_path / "out" / "report.html", build_report(two_device_rows(), spec=spec()))
    with DevToolsPage(tmp_path / "chromium") as page:
        seen = page.open(path)
    assert seen.errors == []
    assert len(seen.images) == 5
    for img in seen.images:
        assert img["complete"] and img["w"] > 200 and img["h"] > 100, img
    alts = [img["alt"] for img in seen.images]
    assert alts[:2] == ["cpu qmm: metrics per arm", "cpu qmm: gap to affine"]
    assert alts[-1] == "qmm: share of each device's measured peak"
    assert "Acceptance criteria" in seen.text and "native decode at least 2x affine" in seen.text


@pytest.mark.slow
@pytest.mark.skipif(chromium_binary() is None, reason="chromium is not installed (tests/setup-system.sh)")
def test_the_browser_check_catches_broken_pages(tmp_path: Path) -> None:
    """The harness really sees errors: a broken image, a missing file and a script error."""
    page_file = tmp_path / "broken.html"
    page_file.write_text(
        '<html><body><img alt="bad" src="data:image/png;base64,AAAA"><img alt="gone" src="missing.png">'
        '<script>console.error("boom"); notDefined();</script></body></html>'
    )
    with DevToolsPage(tmp_path / "chromium") as page:
        seen = page.open(page_file)
    assert [img["w"] for img in seen.images] == [0, 0]
    assert "boom" in seen.errors
    assert any("Uncaught" in e or "notDefined" in e for e in seen.errors)
    assert any("ERR_FILE_NOT_FOUND" in e or "Failed to load resource" in e for e in seen.errors)


@pytest.mark.slow
def test_cli_writes_the_report_from_a_real_store(tmp_path: Path, orchestrate_bin: str) -> None:
    table = two_device_rows()
    store = ResultStore(tmp_path / "results")
    for i, key in enumerate(sorted(set(table["job_key"].to_pylist()))):
        part = table.filter(pa.compute.equal(table["job_key"], key))
        device = part["device"][0].as_py()
        store.write(part, sweep="rep", date=dt.date(2026, 11, 30), device=device, run_id="run1", job_key=f"j{i}")
    out_file = tmp_path / "report.html"
    done = subprocess.run(
        [orchestrate_bin, "report", "--html", str(out_file), "--results", str(tmp_path / "results")],
        capture_output=True, text=True, env=child_env(), timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Report written to" in done.stdout
    doc = out_file.read_text()
    assert doc.count('<img class="plot"') == 5 and "Device h200" in doc


def test_a_sweep_without_clean_rows_still_reports_why() -> None:
    table = concat(
        [
            job_table({"native": {"seconds": [1.0, 1.1]}, "affine": {"seconds": [1.2]}}, params=point, contended=True)
            for point in ({"tokens": 1, "n": 64, "k": 64}, {"tokens": 4096, "n": 64, "k": 64})
        ]
    )
    doc = build_report(table, spec=spec())
    assert "No clean samples" in doc and "<img" not in doc
    assert "MISSING   cpu qmm tokens=4096: native contended; affine contended" in doc
    assert '<tr class="AMBIGUOUS"><td>AMBIGUOUS</td><td>native prefill within 3 % of affine' in doc
