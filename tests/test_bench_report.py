"""``docs/benchmarks.md`` and its pages come from the recorded results (``bench/_report.py``), never retyped."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import _report  # noqa: E402


def test_verdicts_and_runs_come_from_the_records(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    lines = ["speed x vs y: 1.30x (median of 3) (target >= 1.5x: NOT met)", "a plain figure: 2.0x (median of 3)"]
    (raw / "balance_probe.json").write_text(
        json.dumps({"name": "balance_probe", "time": "2026-01-02 03:04:05", "summary": lines, "note": "2 seeds"})
    )
    (raw / "other_probe.json").write_text(
        json.dumps({"name": "other_probe", "time": "t", "ratio": 1.25, "seconds": {}})
    )
    (raw / "_runs.json").write_text("{}")  # the run log is not a result
    run = {"mode": "quick", "status": "ok", "seconds": 12.0, "command": "/elsewhere/clone/bench/balance.py --quick"}
    runs = {"balance_probe": run}
    docs = _report.benchmarks_docs(raw, runs)
    verdicts = docs["benchmarks.md"].split("## Verdicts", 1)[1]
    assert lines[0] in verdicts and lines[1] not in verdicts  # only lines with a verdict, NOT met kept
    assert "(benchmarks/balance.md#balance_probe)" in verdicts
    section = docs["benchmarks/balance.md"].split("## balance_probe", 1)[1]
    # the command as the checkout sees it, wherever the recording run was cloned
    assert all(line in section for line in lines) and "`python bench/balance.py --quick`" in section
    assert "2 seeds" in section
    assert "## other_probe" in docs["benchmarks/other.md"] and "ratio: 1.25" in docs["benchmarks/other.md"]
    assert sorted(docs) == ["benchmarks.md", "benchmarks/balance.md", "benchmarks/other.md"]
    assert not any("_runs" in text for text in docs.values())


def test_stale_pages_are_removed(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "optim_probe.json").write_text(json.dumps({"name": "optim_probe", "time": "t", "summary": ["x"]}))
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "balance.md").write_text("a capability with no runs any more")
    _report.write_benchmarks_doc(raw, {}, docs_dir=tmp_path)
    assert sorted(p.name for p in (tmp_path / "benchmarks").iterdir()) == ["optim.md"]


def test_docs_benchmarks_md_is_up_to_date():
    raw = REPO / "bench" / "report" / "raw"
    runs_path = raw / "_runs.json"
    runs = json.loads(runs_path.read_text()) if runs_path.exists() else {}
    expected = _report.benchmarks_docs(raw, runs)
    actual = {
        str(path.relative_to(REPO / "docs")): path.read_text(encoding="utf-8")
        for path in [REPO / "docs" / "benchmarks.md", *(REPO / "docs" / "benchmarks").glob("*.md")]
    }
    assert actual == expected, "docs/benchmarks*.md differ from bench/report/raw: run `python bench/_report.py`"


def test_a_capability_with_many_runs_continues_on_more_pages(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    filler = [f"figure {i}: " + "x" * 100 for i in range(40)]  # ~4.5 KB a run
    for run in range(8):
        summary = [*filler, f"run {run} speed vs peer: 1.1x (median of 3) (target >= 1.5x: NOT met)"]
        (raw / f"optim_r{run}.json").write_text(
            json.dumps({"name": f"optim_r{run}", "time": f"2026-01-0{run + 1}", "summary": summary})
        )
    docs = _report.benchmarks_docs(raw, {})
    pages = sorted(name for name in docs if name.startswith("benchmarks/"))
    assert pages[0] == "benchmarks/optim.md" and len(pages) >= 3
    assert all(len(docs[name].encode()) <= 15 * 1024 for name in pages)
    held = {f"optim_r{run}": [name for name in pages if f"## optim_r{run}\n" in docs[name]] for run in range(8)}
    assert all(len(where) == 1 for where in held.values())  # every run on exactly one page, never split
    # the index links each shortfall to the page that holds its run
    index = docs["benchmarks.md"]
    assert f"({held['optim_r7'][0]}#optim_r7)" in index and held["optim_r7"][0] != "benchmarks/optim.md"
    assert "(benchmarks/optim_2.md)" in index


def test_a_verdicts_table_longer_than_a_page_goes_on_over_the_next_pages(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    for run in range(40):  # 120 verdict rows of ~230 bytes: a table of ~27 KB, each run's own block small
        summary = [f"verdict {run}.{i}: 1.1x " + "y" * 150 + " (target >= 1.5x: NOT met)" for i in range(3)]
        (raw / f"optim_r{run:02}.json").write_text(
            json.dumps({"name": f"optim_r{run:02}", "time": "2026-01-01", "summary": summary})
        )
    docs = _report.benchmarks_docs(raw, {})
    pages = sorted(name for name in docs if name.startswith("benchmarks/"))
    assert len(pages) >= 2 and all(len(docs[name].encode()) <= 15 * 1024 for name in pages)
    tables = "".join(docs[name].split("\n## optim_r", 1)[0] for name in pages)
    assert all(tables.count(f"verdict {run}.{i}: ") == 1 for run in range(40) for i in range(3))  # every row once
    assert "## Verdicts (continued)" in tables


def test_a_record_as_that_would_not_be_one_recorded_file_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    """``--record-as`` names ``<raw>/<name>.json``: a path (``../x``, ``a/b``), a hidden or ``.json`` name is refused by
    the option (before a bench measures) and by ``record_results`` itself; so is a ``--record-as`` while
    ``DS_BERTOPT_BENCH_OUT`` is unset (nothing would be recorded), in one line; every bench takes the shared option."""
    import argparse
    import re

    from bench._common import add_record_as
    from ds_bertopt.testing.measure import record_results

    parser = argparse.ArgumentParser(prog="bench")
    add_record_as(parser, "probe")
    monkeypatch.delenv("DS_BERTOPT_BENCH_OUT", raising=False)
    assert parser.parse_args([]).record_as == "probe"  # the default: a smoke run, nothing recorded, not refused
    with pytest.raises(SystemExit):
        parser.parse_args(["--record-as", "mine"])
    refusal = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--record-as mine: nothing is recorded while DS_BERTOPT_BENCH_OUT is unset" in refusal
    monkeypatch.setenv("DS_BERTOPT_BENCH_OUT", str(tmp_path / "raw"))
    assert parser.parse_args(["--record-as", "mine"]).record_as == "mine"
    for bad in ("../escaped", "a/b", ".hidden", "mfu.json", ""):
        with pytest.raises(SystemExit):
            parser.parse_args(["--record-as", bad])
        assert "record name" in capsys.readouterr().err
        with pytest.raises(argparse.ArgumentTypeError, match="record name"):
            record_results(bad, {"summary": []})
    assert not (tmp_path / "raw").exists() and not (tmp_path / "escaped.json").exists()
    record_results("mfu_native_bf16", {"summary": ["a line"]})
    assert json.loads((tmp_path / "raw" / "mfu_native_bf16.json").read_text())["summary"] == ["a line"]
    named = {p.name: p.read_text() for p in (REPO / "bench").glob("*.py") if "args.record_as" in p.read_text()}
    assert len(named) >= 6 and all("add_record_as(" in text for text in named.values()), sorted(named)
    assert not any(re.search(r"add_argument\(\s*[\"']--record-as", t) for t in named.values())


def test_a_baseline_records_older_code_so_its_shortfalls_stay_on_its_page(tmp_path):
    """``mfu_baseline*`` records measured an older commit (``bench/mfu.py --baseline``): the index's shortfalls leave
    them out, their page lists them marked as a baseline; a run of today's code with the same line stays listed."""
    raw = tmp_path / "raw"
    raw.mkdir()
    line = "fp32 MFU, ours unpadded: 0.77 (target >= 0.85: NOT met)"
    for name in (f"{_report.BASELINE_PREFIX}_probe", "mfu_probe"):
        (raw / f"{name}.json").write_text(json.dumps({"name": name, "time": "2026-01-02", "summary": [line]}))
    docs = _report.benchmarks_docs(raw, {})
    shortfalls = docs["benchmarks.md"].split("## Verdicts", 1)[1]
    assert "[mfu_probe]" in shortfalls and _report.BASELINE_PREFIX not in shortfalls
    page = docs["benchmarks/other.md"]
    assert f"| `{_report.BASELINE_PREFIX}_probe` (a baseline: older code) | 2026-01-02 | {line} |" in page
    assert f"| `mfu_probe` | 2026-01-02 | {line} |" in page
