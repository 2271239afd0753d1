"""Render ``bench/report/REPORT.md`` with its PNGs, and ``docs/benchmarks.md`` with its pages, from the benchmarks'
records (``bench/report/raw/<name>.json``, ``bench/_common.py``'s ``record``): ``summary`` (the lines that matter),
``note`` (settings), optional ``tables`` (markdown) and ``figures`` (``kind``, ``title``, ``file``, ``series``,
optionally a dashed ``reference`` line and a ``note``), by kind: ``bars`` (``[{"label", <value keys>...}]``, ``stack``:
the keys stacked in one bar, ``unit``), ``curves`` (``[{"label", "x": [...], "y": [...]}]``, ``xlabel``, ``ylabel``),
``scatter`` (``[{"label", "x", "y", "front"}]``, the front drawn larger) and ``errorbars`` (``[{"label", "mean",
"std", "runs"}]``).

``python bench/_report.py`` rewrites the docs pages; ``bench/run_all.py`` writes the report (and the docs after a run
of the project's own results).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

RATIO = re.compile(r"\d+(\.\d+)?x \((median|mean) of \d+")
VERDICT = re.compile(r"\bNOT met\b|\bmet\b|NOT reachable")
ROOT = Path(__file__).resolve().parents[1]
BASELINE_PREFIX = "mfu_baseline"
"""Records named so measured an older commit's code as a later run's baseline (``bench/mfu.py --baseline``): their
verdicts are that code's, so they stay on their page and out of the index's shortfalls."""
DOC = ROOT / "docs" / "benchmarks.md"
CAPABILITIES = (  # (record name prefix, heading): the pages of docs/benchmarks/, in this order
    ("time_to_train", "Time to train (ours vs Hugging Face Trainer + DeepSpeed)"),
    ("balance", "Length-aware batches and unpadded pretraining"),
    ("bucket_clip", "Bucket-wise clipping before allreduce"),
    ("optim", "Large-batch optimizers"),
    ("wtacrs", "Fine-tuning memory (WTA-CRS, memory kit)"),
    ("finetune_tasks", "Fine-tuning tasks: pairs, NER, QA (unpadded vs Trainer)"),
    ("", "Other measurements"),
)


def ratio_lines(lines: list[str]) -> list[str]:
    """The headline lines of a benchmark's output: ``... vs ...: 0.83x (median of 7)`` and friends."""
    return [line.strip() for line in lines if RATIO.search(line)]


def _environment_caption(env: dict) -> str:
    keys = ("machine", "cuda", "torch", "deepspeed", "transformers", "OMP_NUM_THREADS", "torch_threads")
    return ", ".join(f"{key} {env[key]}" for key in keys if key in env)


def _bars(ax, series: list, figure: dict) -> None:
    labels, bottom = [item["label"] for item in series], [0.0] * len(series)
    for key in figure["stack"]:
        values = [float(item.get(key, 0.0)) for item in series]
        ax.bar(labels, values, bottom=bottom, label=key.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    for x, total in enumerate(bottom):
        ax.annotate(f"{total:.3g}", (x, total), ha="center", va="bottom", fontsize=8)
    if len(figure["stack"]) > 1:
        ax.legend()


def _curves(ax, series: list, figure: dict) -> None:
    for item in series:
        ax.plot(item["x"], item["y"], marker="." if len(item["x"]) <= 100 else None, label=item["label"])


def _scatter(ax, series: list, figure: dict) -> None:
    for item in series:
        style = {"s": 60, "edgecolors": "black"} if item.get("front") else {"s": 25, "edgecolors": "none"}
        ax.scatter([item["x"]], [item["y"]], zorder=3, label=item["label"], **style)


def _errorbars(ax, series: list, figure: dict) -> None:
    means, stds = [item["mean"] for item in series], [item.get("std", 0.0) for item in series]
    ax.bar([item["label"] for item in series], means, yerr=stds, capsize=5, color="tab:blue", alpha=0.7)
    for x, item in enumerate(series):
        ax.scatter([x] * len(item.get("runs") or []), item.get("runs") or [], color="black", s=10, zorder=3)
    low = min(min(item.get("runs") or [item["mean"]]) for item in series)
    ax.set_ylim(bottom=max(0.0, low - 0.1 * abs(low) - 0.02))


DRAW = {"bars": _bars, "curves": _curves, "scatter": _scatter, "errorbars": _errorbars}
"""Each figure kind's drawing; labels, the reference line, legend and grid are common (:func:`_plot`)."""


def _plot(figure: dict, caption: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kind = figure["kind"]
    if kind not in DRAW:
        raise ValueError(f"unknown figure kind {kind!r}")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    DRAW[kind](ax, figure["series"], figure)
    ax.set_xlabel(figure.get("xlabel", ""))
    ax.set_ylabel(figure.get("ylabel", figure.get("unit", "")))
    if figure.get("reference") is not None:
        ax.axhline(figure["reference"], color="gray", linestyle="--", linewidth=1)
    if kind in ("bars", "errorbars"):  # category labels
        plt.setp(ax.get_xticklabels(), rotation=20, ha="right", fontsize=8)
    else:
        ax.legend(fontsize=7 if kind == "scatter" else 8)
        ax.grid(alpha=0.3)
    ax.set_title(figure["title"], fontsize=11)
    fig.text(0.01, 0.005, caption, fontsize=6, color="dimgray", wrap=True)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out: Path, runs: dict) -> Path:
    """Write ``out/REPORT.md`` (+ PNGs) from ``out/raw/<bench>.json`` and the run log ``runs``."""
    raw = out / "raw"
    sections: list[str] = []
    table = ["| benchmark | mode | status | time | headline |", "|---|---|---|---|---|"]
    # results recorded by a benchmark run directly (not through run_all.py) have no run-log entry
    direct = {p.stem: None for p in sorted(raw.glob("*.json")) if p.stem != "_runs" and p.stem not in runs}
    for name, run in {**runs, **direct}.items():
        path = raw / f"{name}.json"
        record = json.loads(path.read_text()) if path.exists() and (run is None or run["status"] == "ok") else None
        headline = (record or {}).get("summary") or (run or {}).get("ratio_lines") or []
        if run is None:
            timing = "direct | ok | –"
            how = f"Recorded {record.get('time', '?')} by a direct run of its benchmark (not through `run_all.py`)."
        else:
            timing = f"{run.get('mode', '?')} | {run['status']} | {run['seconds']:.0f} s"
            how = f"`python {_checkout_relative(run['command'])}` — {run['status']} in {run['seconds']:.0f} s"
            how += f" (log: `logs/{name}.log`)."
        table.append(f"| {name} | {timing} | " + "<br>".join(line.replace("|", "/") for line in headline) + " |")
        lines = [f"## {name}", "", how, ""]
        if record is None:
            follow = ": the printed ratio lines follow." if headline else "."
            lines += [f"No recorded results from this run{follow}", "", *(f"    {line}" for line in headline), ""]
        else:
            caption = f"{_environment_caption(record.get('environment', {}))}. {record.get('note', '')}".strip()
            lines += ["```", *record.get("summary", []), "```", "", f"Measured {record.get('time', '')} on {caption}"]
            lines.append("")
            for figure in record.get("figures", []):
                png = f"{name}_{figure['file']}.png"
                _plot(figure, f"{caption} {figure.get('note', '')}", out / png)
                lines += [f"![{figure['title']}]({png})", "", f"*{figure['title']}.* {figure.get('note', '')}", ""]
            for extra in record.get("tables", []):
                lines += [extra, ""]
        sections.append("\n".join(lines))
    generated = "Generated by `bench/run_all.py` from the benchmarks' recorded results; do not edit by hand."
    report = out / "REPORT.md"
    report.write_text("\n".join(["# ds_bertopt benchmark report", "", generated, "", *table, "", *sections]) + "\n")
    return report


def _capability(name: str) -> str:
    return next(prefix for prefix, _ in CAPABILITIES if name.startswith(prefix))


def _scalars(record: dict) -> list[str]:
    """A record without ``summary`` lines (a single measurement): its top-level numbers and strings."""
    skip = {"name", "environment", "time", "note", "figures", "tables"}
    values = {key: value for key, value in record.items() if key not in skip and isinstance(value, (int, float, str))}
    return [f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}" for key, value in values.items()]


def _checkout_relative(command: str) -> str:
    """A recorded command with the script's path relative to the checkout: the same text wherever the repository is
    cloned (a run records the absolute path it was started with)."""
    return re.sub(r"(?<!\S)\S*/(bench/[\w./-]+\.py)", r"\1", command)


PAGE_BYTES = 14 * 1024  # a generated page stays reference-sized (tests/test_house.py: every doc <= 15 KB)
NOT_MET = re.compile(r"\bNOT met\b|NOT reachable")


def _page(prefix: str, part: int = 1) -> str:
    """The file, under ``docs/benchmarks/``, of part ``part`` of a capability's runs."""
    return f"{prefix or 'other'}{'' if part == 1 else f'_{part}'}.md"


def _paginate(head: list[str], blocks: list[tuple[str, list[str]]]) -> list[tuple[list[str], list[str]]]:
    """``blocks`` (name, lines) packed in order onto pages of at most ``PAGE_BYTES`` with ``head`` on each: a list of
    (names, lines) per page. A block is never split."""
    pages: list[tuple[list[str], list[str]]] = [([], list(head))]
    for name, lines in blocks:
        names, page = pages[-1]
        if names and len("\n".join(page + lines).encode()) > PAGE_BYTES:
            pages.append(([], list(head)))
            names, page = pages[-1]
        names.append(name)
        page += lines
    return pages


def _verdict_tables(rows: list[str]) -> list[tuple[str, list[str]]]:
    """The verdicts table as blocks that each fit a page beside its head: a long one goes on over the next pages,
    its header again."""
    chunks: list[list[str]] = []
    for row in rows:
        if not chunks or len("\n".join([*chunks[-1], row]).encode()) > PAGE_BYTES - 1024:
            chunks.append([])
        chunks[-1].append(row)
    heading = ["", "## Verdicts", "", "| run | recorded | line |", "|---|---|---|"]
    return [
        ("", [*heading[:1], heading[1] + (" (continued)" if i else ""), *heading[2:], *c]) for i, c in enumerate(chunks)
    ]


def _baseline(name: str) -> bool:
    return name.startswith(BASELINE_PREFIX)


def _verdict_row(name: str, record: dict, line: str, link: str = "", baseline: bool = False) -> str:
    run = (f"[{name}]({link})" if link else f"`{name}`") + (" (a baseline: older code)" if baseline else "")
    return f"| {run} | {record.get('time', '?')[:10]} | {line.replace('|', '/')} |"


def benchmarks_docs(raw: Path, runs: dict) -> dict[str, str]:
    """``docs/benchmarks.md`` and its pages, by path relative to ``docs/``: the index holds every verdict that falls
    short (NOT met) of every recorded run; ``benchmarks/<capability>.md`` (continued in ``<capability>_2.md``, ...
    where one page would pass ``PAGE_BYTES``) every verdict of the capability, then each run's command, settings and
    summary lines, oldest first. Only what the benchmarks recorded; nothing retyped."""
    # every recorded result, by name (``_runs.json`` is the run log, not a result)
    records = {p.stem: json.loads(p.read_text()) for p in sorted(raw.glob("*.json")) if not p.stem.startswith("_")}
    prefixes = [prefix for prefix, _ in CAPABILITIES]
    order = sorted(records, key=lambda n: (prefixes.index(_capability(n)), records[n].get("time", "")))
    captions = [_environment_caption(r.get("environment", {})) for r in records.values()]
    common = max(set(captions), key=captions.count) if captions else ""
    generated = [
        "Generated by `python bench/_report.py` (and by `bench/run_all.py` after a run) from the results the",
        "benchmarks recorded in `bench/report/raw/*.json`; do not edit by hand.",
    ]
    present = [(prefix, heading) for prefix, heading in CAPABILITIES if any(_capability(n) == prefix for n in order)]
    verdicts = {name: [line for line in records[name].get("summary", []) if VERDICT.search(line)] for name in order}
    docs: dict[str, str] = {}
    index_links, page_of = [], {}
    for prefix, heading in present:
        names = [n for n in order if _capability(n) == prefix]
        blocks = []
        for name in names:
            record, run = records[name], runs.get(name, {})
            command = _checkout_relative(run.get("command", ""))
            facts = [f"recorded {record.get('time', '?')}"]
            if run:
                facts.append(f"mode {run.get('mode', '?')}, {run.get('status', '?')} in {run.get('seconds', 0):.0f} s")
            block = ["", f"## {name}", "", "; ".join(facts) + (f": `python {command}`" if command else "") + "."]
            env = _environment_caption(record.get("environment", {}))
            settings = (f"{env}. " if env != common else "") + record.get("note", "")
            block += ["", settings] if settings else []
            block += ["", "```", *(record.get("summary") or _scalars(record)), "```"]
            blocks.append((name, block))
        head = [f"# {heading}", "", *generated, "Shortfalls of every run: [benchmarks.md](../benchmarks.md).", ""]
        head.append(f"Machine and stack, unless a run says otherwise: {common}.")
        rows = [_verdict_row(n, records[n], line, baseline=_baseline(n)) for n in names for line in verdicts[n]]
        pages = _paginate(head, [*_verdict_tables(rows), *blocks])
        for part, (held, lines) in enumerate(pages, 1):
            for name in held:
                page_of[name] = _page(prefix, part)
            if len(pages) > 1:
                others = ", ".join(f"[{k}]({_page(prefix, k)})" for k in range(1, len(pages) + 1) if k != part)
                lines.insert(1, f"\nPart {part} of {len(pages)} (also {others}).")
            docs[f"benchmarks/{_page(prefix, part)}"] = "\n".join(lines) + "\n"
        parts = ", ".join(f"[{k}](benchmarks/{_page(prefix, k)})" for k in range(2, len(pages) + 1))
        index_links.append(f"- [{heading}](benchmarks/{_page(prefix)})" + (f" (continued: {parts})" if parts else ""))
    out = [
        "# Benchmark results and run history",
        "",
        *generated,
        "The plots and tables of each run are in [bench/report/REPORT.md](../bench/report/REPORT.md); how each",
        "benchmark works is in its module's docstring and the capability's doc. Every figure was printed by the run",
        "named with it.",
        "",
        f"Machine and stack, unless a run says otherwise: {common}.",
        "",
        "Each run's command, settings, printed lines and every verdict (met or not), by capability:",
        "",
        *index_links,
        "",
        "## Verdicts",
        "",
        "Every line a run printed with a verdict that falls short of its target (`NOT met`); the capability pages",
        "hold every verdict, met ones included.",
        "",
        "| run | recorded | line |",
        "|---|---|---|",
    ]
    for name in (n for n in order if not _baseline(n)):
        for line in verdicts[name]:
            if NOT_MET.search(line):
                out.append(_verdict_row(name, records[name], line, f"benchmarks/{page_of[name]}#{name}"))
    docs["benchmarks.md"] = "\n".join(out) + "\n"
    return docs


def write_benchmarks_doc(raw: Path, runs: dict, docs_dir: Path = DOC.parent) -> Path:
    """Write ``docs/benchmarks.md`` and its pages; a page no capability has any more is removed."""
    docs = benchmarks_docs(raw, runs)
    pages = docs_dir / "benchmarks"
    pages.mkdir(exist_ok=True)
    for stale in set(pages.glob("*.md")) - {docs_dir / rel for rel in docs}:
        stale.unlink()
    for rel, text in docs.items():
        (docs_dir / rel).write_text(text)
    return docs_dir / "benchmarks.md"


if __name__ == "__main__":
    report_raw = ROOT / "bench" / "report" / "raw"
    runs_path = report_raw / "_runs.json"
    print(write_benchmarks_doc(report_raw, json.loads(runs_path.read_text()) if runs_path.exists() else {}))
