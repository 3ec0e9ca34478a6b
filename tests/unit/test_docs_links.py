"""README stays a front door (short, every detail a link away) and no link in README or docs/ points nowhere."""

import re

import pytest

from psserver.codegen import REPO_ROOT

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_readme_fits_in_a_head_under_250_lines():
    assert len((REPO_ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_relative_link_of_the_page_names_a_file_that_exists(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    targets = [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]
    missing = [t for t in targets if not (page.parent / t).exists()]
    assert not missing, f"{page.name} links to {missing}"


def test_every_docs_page_is_reachable_from_the_readme():
    readme = (REPO_ROOT / "README.md").read_text()
    unlinked = [p.name for p in (REPO_ROOT / "docs").glob("*.md") if f"docs/{p.name}" not in readme]
    assert not unlinked, f"docs pages README does not link: {unlinked}"
