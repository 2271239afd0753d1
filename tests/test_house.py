"""The house rules a newcomer relies on: a README that is a product page, reference-sized docs, small bench files."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_BYTES = 12 * 1024
DOC_BYTES = 15 * 1024
BENCH_LINES = 600


def test_readme_is_a_product_page():
    size = (REPO / "README.md").stat().st_size
    assert size <= README_BYTES, f"README.md is {size} B, over {README_BYTES}: move run history to bench/report"


@pytest.mark.parametrize("doc", sorted((REPO / "docs").rglob("*.md")), ids=lambda p: str(p.relative_to(REPO)))
def test_every_doc_is_reference_sized(doc):
    size = doc.stat().st_size
    assert size <= DOC_BYTES, f"{doc.relative_to(REPO)} is {size} B, over {DOC_BYTES}"


@pytest.mark.parametrize("module", sorted((REPO / "bench").rglob("*.py")), ids=lambda p: str(p.relative_to(REPO)))
def test_no_bench_file_over_600_lines(module):
    lines = len(module.read_text(encoding="utf-8").splitlines())
    assert lines <= BENCH_LINES, f"{module.relative_to(REPO)} has {lines} lines, over {BENCH_LINES}"
