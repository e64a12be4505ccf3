"""Every relative link of the hand-written pages and the generated tables resolves."""

import re

import pytest

from tests.reliability_helpers import REPO

PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"),
                *(REPO / "results").rglob("*.md")])
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_names_a_file_of_the_repository(page):
    targets = [t for t in LINK.findall(page.read_text()) if "://" not in t
               and not t.startswith("mailto:")]
    missing = [t for t in targets if not (page.parent / t).resolve().exists()]
    assert not missing, f"{page.relative_to(REPO)} links files that do not exist: {missing}"
    assert all((page.parent / t).resolve().is_relative_to(REPO) for t in targets)
