"""The user documents: a README a newcomer can read, measurements in docs/benchmarks.md, and no
internal process (issue numbers, work-round labels) in any of them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# "issue 14", "stop 22", "round 3 of the review": the project's own bookkeeping. Other projects'
# issues are cited as "issue #123" and stay allowed.
INTERNAL = re.compile(r"\b(issue|stop|work[- ]round)s? \d+\b", re.IGNORECASE)


def test_the_readme_is_short_and_links_the_measurements():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert "docs/benchmarks.md" in text
    for command in ("make demo", "make test"):
        assert command in text


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: p.name)
def test_no_internal_process_in_user_docs(path):
    hits = [(n, line.strip()) for n, line in enumerate(path.read_text().splitlines(), 1)
            if INTERNAL.search(line)]
    assert not hits, f"{path.name}: {hits}"


def test_every_relative_link_of_the_user_docs_resolves():
    broken = []
    for path in USER_DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" in target:
                continue
            if not (path.parent / target).exists():
                broken.append((path.name, target))
    assert not broken
