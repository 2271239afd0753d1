"""docs/ are reference pages a reader navigates: every config field is on a page with its default and docstring as
the code has them (tests/docs/options.py), the index lists every page, and links between pages land."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "docs"))
import options  # noqa: E402

PAGES = sorted((REPO / "docs").glob("*.md"))
LINK = re.compile(r"\]\((?!https?:)([^)#\s]+\.md)?(?:#([^)\s]+))?\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_option_tables_are_what_the_code_says(page):
    for section, body in options.blocks(page.read_text(encoding="utf-8")):
        assert body == options.render(section), f"{page.name}'s {section} options differ: python tests/docs/options.py"


def test_every_config_section_has_a_page():
    documented = {section.split(".")[0] for page in PAGES for section, _ in options.blocks(page.read_text("utf-8"))}
    assert options.sections() <= documented, f"no options table for {sorted(options.sections() - documented)}"


def test_the_index_lists_every_page():
    index = (REPO / "docs" / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in PAGES if p.name != "README.md" and f"]({p.name})" not in index]
    assert not missing, f"docs/README.md does not list {missing}"


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than - and _ dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_anchor_follows_github():
    assert anchor("The data's life cycle (`pipeline.py`, `ds_bertopt.handoff`)") == (
        "the-datas-life-cycle-pipelinepy-ds_bertopthandoff"
    )


def test_links_between_pages_land():
    broken = []
    for doc in [REPO / "README.md", *PAGES]:
        for path, fragment in LINK.findall(doc.read_text(encoding="utf-8")):
            target = (doc.parent / path).resolve() if path else doc
            if not target.exists():
                broken.append(f"{doc.relative_to(REPO)} -> {path}")
            elif fragment:
                headings = re.findall(r"^#+ (.+)$", target.read_text(encoding="utf-8"), re.M)
                if fragment not in {anchor(h) for h in headings}:
                    broken.append(f"{doc.relative_to(REPO)} -> {path}#{fragment}")
    assert not broken, "links to a page or heading that is not there: " + "; ".join(broken)
