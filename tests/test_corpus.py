"""Corpus files: formats that work, and one-line errors for the ones that do not."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from _permissions import permissions_apply

from ds_bertopt.config import DataConfig
from ds_bertopt.data.corpus import expand_train_files, load_documents
from ds_bertopt.data.skipped import Skipped
from ds_bertopt.errors import DataError

TEXT = "The cat sat on the mat. It was warm.\n\nA second paragraph follows here.\n\n\n\nAnd a third one."


def test_txt_paragraphs_and_lines(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(TEXT)
    docs = load_documents(DataConfig(train_files=(str(path),)), str(tmp_path / "cache"))
    assert docs["text"] == [
        "The cat sat on the mat. It was warm.",
        "A second paragraph follows here.",
        "And a third one.",
    ]
    (tmp_path / "b.txt").write_text("line one\nline two\n\n\nline three\n")
    lines = load_documents(
        DataConfig(train_files=(str(tmp_path / "b.txt"),), txt_format="line"), str(tmp_path / "cache")
    )
    assert lines["text"] == ["line one", "line two", "line three"]  # empty lines skipped


def test_jsonl_gz_and_globs(tmp_path):
    for i in range(2):
        with gzip.open(tmp_path / f"part{i}.jsonl.gz", "wt", encoding="utf-8") as fh:
            for j in range(3):
                fh.write(json.dumps({"body": f"document {i}-{j} text.", "id": j}) + "\n")
            fh.write(json.dumps({"body": "   ", "id": 9}) + "\n")
    skipped = Skipped()
    cfg = DataConfig(train_files=(str(tmp_path / "part*.jsonl.gz"),), text_field="body", max_skipped_fraction=0.3)
    docs = load_documents(cfg, str(tmp_path / "cache"), skipped)
    assert len(docs) == 6 and docs.column_names == ["text"]
    assert skipped.line() == "2 of 8 records skipped: empty text (part0.jsonl.gz line 4, part1.jsonl.gz line 4)"


DIRTY = [
    {"text": "The first document. It is fine."},
    {"text": "A second document, also fine."},
    {"title": "a record without its text"},
    {"text": 42},
    {"text": "   "},
    {"text": "The last document of the file."},
]


def test_records_without_usable_text_are_counted_and_named(tmp_path):
    """Silently wrong before: records without a text field, or with text that is not a string, vanished."""
    path = tmp_path / "dirty.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in DIRTY))
    skipped = Skipped()
    docs = load_documents(DataConfig(train_files=(str(path),), max_skipped_fraction=0.5), str(tmp_path / "c"), skipped)
    assert docs["text"] == [DIRTY[0]["text"], DIRTY[1]["text"], DIRTY[5]["text"]]
    assert skipped.line() == (
        "3 of 6 records skipped: 1 × no text field (line 3); 1 × text not a string (line 4); 1 × empty text (line 5)"
    )
    with pytest.raises(DataError) as info:  # the default cap: 1 %
        load_documents(DataConfig(train_files=(str(path),)), str(tmp_path / "c"))
    assert str(info.value) == (
        f"corpus {path}: 3 of 6 records skipped: 1 × no text field (line 3); 1 × text not a string (line 4); "
        "1 × empty text (line 5); that is 50%, more than data.max_skipped_fraction 0.01: fix the data or raise "
        "data.max_skipped_fraction"
    )
    # blank lines are layout, not records: the lines named are still the file's
    lines = [json.dumps(r) for r in DIRTY if r.get("text") != 42]
    path.write_text("\n".join(lines[:2] + ["", ""] + lines[2:]) + "\n")
    skipped = Skipped()
    load_documents(DataConfig(train_files=(str(path),), max_skipped_fraction=0.5), str(tmp_path / "c"), skipped)
    assert skipped.line() == "2 of 5 records skipped: 1 × no text field (line 5); 1 × empty text (line 6)"


def test_skipped_names_a_few_places_and_counts_the_rest():
    skipped = Skipped("rows", total=500)
    for line in range(10, 16):
        skipped.add("empty text", f"line {line}")
    assert skipped.line() == "6 of 500 rows skipped: empty text (line 10, line 11, line 12, …)"
    skipped.check("x.csv", 0.02)  # 1.2 % is under the cap
    with pytest.raises(DataError, match="x.csv: 6 of 500 rows skipped: .* more than data.max_skipped_fraction 0.01"):
        skipped.check("x.csv", 0.01)


def bad(tmp_path, name, content):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return str(path)


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.txt", "", "is empty"),
        ("blank.txt", "  \n\n \n", "holds only white space"),
        ("latin.txt", "caf\xe9 au lait is nice. ".encode("latin-1") * 3, "is not UTF-8 text"),
        ("data.csv", "a,b\n1,2\n", "unsupported extension"),
        ("trunc.jsonl.gz", b"\x1f\x8b\x08\x00garbage", "cannot be read"),
    ],
)
def test_bad_files(tmp_path, name, content, message):
    with pytest.raises(DataError, match=message) as info:
        expand_train_files([bad(tmp_path, name, content)])
    assert name in str(info.value)


def test_missing_and_directory_and_glob(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        expand_train_files([str(tmp_path / "nope.txt")])
    (tmp_path / "dir.txt").mkdir()
    with pytest.raises(DataError, match="is not a regular file"):
        expand_train_files([str(tmp_path / "dir.txt")])
    with pytest.raises(DataError, match="matches no files"):
        expand_train_files([str(tmp_path / "*.jsonl")])


def test_unreadable(tmp_path):
    path = bad(tmp_path, "locked.txt", "text here.")
    os.chmod(path, 0)
    with permissions_apply(), pytest.raises(DataError, match="not readable"):
        expand_train_files([path])


def test_jsonl_without_text_field(tmp_path):
    path = bad(tmp_path, "docs.jsonl", json.dumps({"body": "hello there."}) + "\n")
    with pytest.raises(DataError, match="has no field 'text' \\(fields: body\\); set data.text_field"):
        load_documents(DataConfig(train_files=(path,)), str(tmp_path / "cache"))


def test_jsonl_that_is_not_json(tmp_path):
    path = bad(tmp_path, "docs.jsonl", '{"text": "ok"}\nthis is not json\n')
    with pytest.raises(DataError, match="cannot be parsed"):
        load_documents(DataConfig(train_files=(path,)), str(tmp_path / "cache"))


def test_single_document_is_not_enough(tmp_path):
    path = bad(tmp_path, "one.txt", "Just one paragraph of text.")
    with pytest.raises(DataError, match="need at least 2"):
        load_documents(DataConfig(train_files=(path,)), str(tmp_path / "cache"))


def test_mixed_kinds_refused(tmp_path):
    a = bad(tmp_path, "a.txt", "Some text.")
    b = bad(tmp_path, "b.jsonl", json.dumps({"text": "x"}) + "\n")
    with pytest.raises(DataError, match="mix .txt and .jsonl"):
        load_documents(DataConfig(train_files=(a, b)), str(tmp_path / "cache"))
