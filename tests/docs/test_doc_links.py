"""Every relative link of README.md, BENCHMARKS.md and docs/ resolves: the file exists, and a
`#anchor` names a heading of that file as GitHub spells it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCED = re.compile(r"^```.*?^```", re.S | re.M)
HEADING = re.compile(r"^#{1,6} +(.+?) *$", re.M)


def documents() -> list[Path]:
    return [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").rglob("*.md"))]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCED.sub("", path.read_text())):
        base = anchor(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCED.sub("", path.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not ours to check
            continue
        file_part, _, fragment = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target}: no {shown(resolved)}")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target}: no heading #{fragment} in {shown(resolved)}")
    return broken


def test_anchor_spelling_matches_github() -> None:
    assert anchor("Precision: how long a point is sampled") == "precision-how-long-a-point-is-sampled"
    assert anchor("A host Ray cannot reach: plan, run, import") == "a-host-ray-cannot-reach-plan-run-import"
    assert anchor("`benchmarks/device_e2e.sh`: the built-in sweeps end to end") == (
        "benchmarksdevice_e2esh-the-built-in-sweeps-end-to-end"
    )


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n")
    page.write_text("[ok](other.md#a-section) [gone](missing.md) [bad](other.md#nowhere) [web](https://x.org)\n")
    assert broken_links(page) == [
        f"missing.md: no {tmp_path / 'missing.md'}",
        "other.md#nowhere: no heading #nowhere in " + str(tmp_path / "other.md"),
    ]


def test_every_relative_link_resolves() -> None:
    broken = {str(p.relative_to(REPO)): b for p in documents() if (b := broken_links(p))}
    assert broken == {}
