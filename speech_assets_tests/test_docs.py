"""Every relative link in README.md and docs/*.md leads somewhere: the file exists and, for a
`#anchor`, the target file has a heading whose GitHub anchor is that anchor."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def github_anchor(heading: str) -> str:
    """GitHub's slug of a heading: the rendered text lower-cased, every character that is not a
    letter, digit, `_`, `-` or space dropped, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = text.replace("`", "")
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub gives the headings of a markdown file (repeats get -1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_anchor(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(path: Path) -> list[str]:
    links = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            target = match.group(1)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
                links.append(target)
    return links


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{anchor} in {resolved.name}")
    return broken


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("From a laptop to a cluster", "from-a-laptop-to-a-cluster"),
        ("The shared data dir, and locks on NFS", "the-shared-data-dir-and-locks-on-nfs"),
        ("Is the encoder any good?", "is-the-encoder-any-good"),
        ("Differential privacy: what ε covers", "differential-privacy-what-ε-covers"),
        ("k-means (`bench/kmeans.py`)", "k-means-benchkmeanspy"),
        ("Settings: one file for every run", "settings-one-file-for-every-run"),
        ("The probe stage (`bench/probe_stage.py`, issue 36)", "the-probe-stage-benchprobe_stagepy-issue-36"),
    ],
)
def test_github_anchor(heading: str, anchor: str) -> None:
    assert github_anchor(heading) == anchor


def test_the_checker_finds_a_broken_file_and_a_broken_anchor(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Title\n## A section\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md) [ok](other.md#a-section) [ok](other.md#a-section-1) [ok](#here)\n"
        "## Here\n[gone](missing.md) [bad](other.md#nowhere) `[code](not-a-link.md)` [web](https://example.org)\n"
        "```\n[fenced](also-not-a-link.md)\n```\n"
    )
    assert [entry.split(":")[0] for entry in broken_links(page)] == ["missing.md", "other.md#nowhere"]


@pytest.mark.parametrize("path", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_relative_link_resolves(path: Path) -> None:
    assert broken_links(path) == []
