"""The house rules a newcomer relies on: a README that is a product page, reference-sized docs, small bench files, no
block of code written twice in the package."""

from __future__ import annotations

import re
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


CLI_LINES = 400


@pytest.mark.parametrize("module", sorted((REPO / "ds_bertopt" / "cli").glob("*.py")), ids=lambda p: p.name)
def test_no_cli_module_over_400_lines(module):
    """A command parses and prints; what it computes lives in the package (ds_bertopt.data.peers, .scale, ...)."""
    lines = len(module.read_text(encoding="utf-8").splitlines())
    assert lines <= CLI_LINES, f"{module.relative_to(REPO)} has {lines} lines, over {CLI_LINES}"


REPEATED_BLOCK = 10


def repeated_blocks(files: dict[str, str], size: int = REPEATED_BLOCK) -> list[tuple[str, str]]:
    """Places where ``size`` consecutive non-blank lines (whitespace stripped) already appeared earlier, in the same
    file or another: each rule should live in one place, so a second copy of a block is a finding."""
    first_seen: dict[tuple[str, ...], str] = {}
    found = []
    for name, text in files.items():
        lines = [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
        for start in range(len(lines) - size + 1):
            block = tuple(line for _, line in lines[start : start + size])
            where = f"{name}:{lines[start][0]}"
            if block not in first_seen:
                first_seen[block] = where
            elif not first_seen[block].startswith(f"{name}:") or _apart(first_seen[block], where, size):
                found.append((first_seen[block], where))
    return found


def _apart(first: str, second: str, size: int) -> bool:
    # a block of identical lines repeating into itself (e.g. 11 equal lines) is one block, not two copies
    return int(second.rsplit(":", 1)[1]) - int(first.rsplit(":", 1)[1]) >= size


def test_the_repeated_block_rule_finds_a_copied_block():
    body = "\n".join(f"x{i} = {i}" for i in range(REPEATED_BLOCK))
    assert repeated_blocks({"a.py": body, "b.py": "import os\n\n" + body}) == [("a.py:1", "b.py:3")]
    assert repeated_blocks({"a.py": body + "\n" + body}) == [("a.py:1", "a.py:11")]
    shorter = "\n".join(body.splitlines()[:-1])
    assert repeated_blocks({"a.py": body, "b.py": shorter}) == []


def test_no_block_of_ten_lines_is_repeated_under_the_package():
    modules = sorted((REPO / "ds_bertopt").rglob("*.py"))
    found = repeated_blocks({str(p.relative_to(REPO)): p.read_text(encoding="utf-8") for p in modules})
    pairs = "; ".join(f"{first} / {again}" for first, again in found[:5])
    assert not found, f"blocks of {REPEATED_BLOCK}+ lines written twice (first / again): {pairs}"


def test_links_to_generated_benchmark_pages_find_their_run():
    """A generated page moves a run to its continuation when it fills up: a link must name the page that holds it."""
    link = re.compile(r"\]\(((?:\.\./)?(?:docs/)?benchmarks/\w+\.md)#(\w+)\)")
    broken = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for path, run in link.findall(doc.read_text(encoding="utf-8")):
            page = (doc.parent / path).resolve()
            if not page.exists() or f"## {run}\n" not in page.read_text(encoding="utf-8"):
                broken.append(f"{doc.relative_to(REPO)} -> {path}#{run}")
    assert not broken, "links to a run its page does not hold: " + "; ".join(broken)
