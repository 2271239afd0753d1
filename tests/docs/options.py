"""Render the option tables of docs/*.md from the config dataclasses, so that a page's options are the code's.

A page holds a table between ``<!-- options: SECTION ... -->`` and ``<!-- /options -->``: every field under
``bertopt.SECTION`` (nested sections included, e.g. ``wtacrs.kit.*``), its default as JSON and its docstring (the
same text as ``--SECTION.field``'s help). ``python tests/docs/options.py`` rewrites every such block in place;
tests/test_docs.py checks that each block is what the code renders and that every field has a page.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BLOCK = re.compile(r"(<!-- options: (?P<section>[\w.]+) [^\n]*-->\n)(?P<body>.*?)(<!-- /options -->)", re.S)
MARKER = "<!-- options: {section} (generated from the config dataclasses by python tests/docs/options.py) -->\n"


def _fields():
    sys.path.insert(0, str(ROOT))
    from ds_bertopt.config import BertOptConfig
    from ds_bertopt.configlib import iter_fields

    return list(iter_fields(BertOptConfig))


def _default(value) -> str:
    if isinstance(value, float):
        value = float(f"{value:.6g}")
    if isinstance(value, tuple):
        value = list(value)
    return "`" + json.dumps(value, ensure_ascii=False) + "`"


def _text(doc: str) -> str:
    doc = re.sub(r":(?:func|class|mod|meth|attr):`~?([^`]+)`", r"``\1``", doc)
    doc = doc.replace("``", "`").replace("|", "\\|")
    return " ".join(doc.split()) or "(no docstring)"


def render(section: str) -> str:
    """The options table of ``bertopt.<section>``."""
    rows = [(key, default, doc) for key, _, default, doc in _fields() if key.startswith(section + ".")]
    if not rows:
        raise SystemExit(f"no config section {section!r}")
    lines = ["| key | default | what it does |", "| --- | --- | --- |"]
    lines += [f"| `{key}` | {_default(default)} | {_text(doc)} |" for key, default, doc in rows]
    return "\n".join(lines) + "\n"


def blocks(text: str) -> list[tuple[str, str]]:
    """``(section, body)`` of every options block of a page."""
    return [(m["section"], m["body"]) for m in BLOCK.finditer(text)]


def rewrite(text: str) -> str:
    return BLOCK.sub(lambda m: MARKER.format(section=m["section"]) + render(m["section"]) + m[4], text)


def sections() -> set[str]:
    """The top-level sections of ``"bertopt"`` (every field belongs to one)."""
    return {key.split(".")[0] for key, *_ in _fields()}


def main() -> int:
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        new = rewrite(text)
        if new != text:
            page.write_text(new, encoding="utf-8")
            print(f"rewrote the options of {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
