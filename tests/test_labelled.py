"""Labelled-data loading: csv / jsonl / datasets directories, and one-line errors for bad files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_bertopt.errors import DataError
from ds_bertopt.data.labelled import load_labelled

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def write(tmp_path: Path, name: str, content, binary: bool = False) -> str:
    path = tmp_path / name
    if binary:
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return str(path)


def test_csv_with_quoted_commas_and_newlines(tmp_path):
    path = write(tmp_path, "a.csv", 'text,label,extra\n"good, really",1,x\n"two\nlines",0,y\nplain,"1",z\n')
    data = load_labelled(path)
    assert data.texts == ("good, really", "two\nlines", "plain")
    assert data.labels == (1, 0, 1)
    assert data.num_labels == 2


def test_jsonl_with_custom_columns_and_float_labels(tmp_path):
    rows = [{"sentence": "a", "y": 2.0}, {"sentence": "b", "y": 0}]
    path = write(tmp_path, "a.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    data = load_labelled(path, text_column="sentence", label_column="y")
    assert data.labels == (2, 0) and data.num_labels == 3


@pytest.mark.parametrize(
    "content,pattern",
    [
        ("", r"a\.csv is empty"),
        ("text,label\n", r"a\.csv has no examples"),
        ("sentence,label\nx,1\n", r"a\.csv has no column 'text' \(columns: sentence, label\)"),
        ("text,target\nx,1\n", r"has no column 'label'"),
        ("text,label\nfine,1\nbad,pos\n", r"a\.csv line 3: label 'pos' is not an integer class label"),
        ("text,label\nx,1.5\n", r"line 2: label '1.5' is not an integer"),
        ("text,label\nx,-1\n", r"line 2: label -1 is negative"),
    ],
)
def test_csv_errors_name_the_problem(tmp_path, content, pattern):
    path = write(tmp_path, "a.csv", content)
    with pytest.raises(DataError, match=pattern) as info:
        load_labelled(path)
    assert "\n" not in str(info.value)


def test_jsonl_errors(tmp_path):
    path = write(tmp_path, "a.jsonl", '{"text": "x", "label": 1}\n{"text": "y", "label": tru\n')
    with pytest.raises(DataError, match=r"a\.jsonl line 2 is not valid JSON"):
        load_labelled(path)
    path = write(tmp_path, "b.jsonl", '{"text": "x", "label": 1}\n{"text": "y"}\n')
    with pytest.raises(DataError, match=r"b\.jsonl line 2: no 'label' field \(fields: text\)"):
        load_labelled(path)
    path = write(tmp_path, "c.jsonl", '{"text": "x", "label": null}\n')
    with pytest.raises(DataError, match=r"line 1: label is empty"):
        load_labelled(path)
    path = write(tmp_path, "e.jsonl", '{"text": null, "label": 1}\n')  # no usable row at all: over the cap
    with pytest.raises(DataError, match=r"e\.jsonl: 1 of 1 rows skipped: empty text \(line 1\); that is 100%"):
        load_labelled(path)
    path = write(tmp_path, "d.jsonl", '{"text": "x", "label": true}\n')
    with pytest.raises(DataError, match=r"label True is not an integer"):
        load_labelled(path)


def test_missing_file_non_utf8_and_unknown_format(tmp_path):
    with pytest.raises(DataError, match=r"nope\.csv does not exist"):
        load_labelled(str(tmp_path / "nope.csv"))
    path = write(tmp_path, "latin.csv", "text,label\ncaf\xe9,1\n".encode("latin-1"), binary=True)
    with pytest.raises(DataError, match=r"latin\.csv is not UTF-8 text \(byte 0xe9 on line 2\)"):
        load_labelled(path)
    path = write(tmp_path, "a.txt", "x")
    with pytest.raises(DataError, match=r"unsupported format"):
        load_labelled(path)


def test_datasets_directory(tmp_path):
    import datasets

    single = datasets.Dataset.from_dict({"text": ["a", "b"], "label": [0, 1]})
    single.save_to_disk(str(tmp_path / "single"))
    assert load_labelled(str(tmp_path / "single")).labels == (0, 1)
    datasets.DatasetDict({"train": single, "test": single}).save_to_disk(str(tmp_path / "multi"))
    assert load_labelled(str(tmp_path / "multi"), split="test").texts == ("a", "b")
    with pytest.raises(DataError, match=r"holds splits train, test; choose one"):
        load_labelled(str(tmp_path / "multi"), split="validation")
    datasets.Dataset.from_dict({"sentence": ["a"], "label": [0]}).save_to_disk(str(tmp_path / "cols"))
    with pytest.raises(DataError, match=r"has no column 'text' \(columns: sentence, label\)"):
        load_labelled(str(tmp_path / "cols"))


@pytest.mark.shared_data
@pytest.mark.skipif(not (SHARED / "rt_polarity").is_dir(), reason="../shared/data is absent")
def test_rt_polarity_loads():
    train = load_labelled(str(SHARED / "rt_polarity" / "train.csv"))
    dev = load_labelled(str(SHARED / "rt_polarity" / "dev.csv"))
    assert len(train) == 10451 and len(dev) == 981
    assert set(train.labels) == {0, 1}


def test_rows_with_empty_text_are_skipped_and_counted(tmp_path):
    """Silently wrong before: "32 training examples", 7 of them empty strings."""
    rows = [f"review {i} is {'good' if i % 2 else 'bad'},{i % 2}" for i in range(32)]
    for line in (3, 9, 20):
        rows[line] = f'"  ",{line % 2}'
    path = write(tmp_path, "a.csv", "text,label\n" + "\n".join(rows) + "\n")
    data = load_labelled(path, max_skipped_fraction=0.2)
    assert len(data) == 29 and all(t.strip() for t in data.texts)
    assert data.skipped == "3 of 32 rows skipped: empty text (line 5, line 11, line 22)"
    assert data.subset(10, seed=0, shuffle=True).skipped == data.skipped  # the count stays with the data line
    with pytest.raises(DataError, match=r"a\.csv: 3 of 32 rows skipped: .*that is 9%, more than"):
        load_labelled(path)  # the default cap, 1 %


def test_labels_written_as_floats(tmp_path):
    """``1.0`` is the integer class 1 (a spreadsheet's export); ``1.5`` is not a class, and label_names would not
    fix it, so the message does not suggest them."""
    path = write(tmp_path, "a.csv", "text,label\nx,1.0\ny,0.0\nz, 2 \n")
    assert load_labelled(path).labels == (1, 0, 2)
    path = write(tmp_path, "b.csv", "text,label\nx,1.0\ny,0.5\n")
    with pytest.raises(DataError) as info:
        load_labelled(path)
    assert "line 3: label '0.5' is not an integer class label (a number with a fraction" in str(info.value)
    assert "label_names" not in str(info.value)
