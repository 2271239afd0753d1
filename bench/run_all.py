"""Run every benchmark and write ``bench/report/REPORT.md`` with its plots.

    python bench/run_all.py --quick      # every benchmark in its quick settings
    python bench/run_all.py              # full settings (an hour or more on 2 CPU cores)
    python bench/run_all.py --report-only   # re-render the report (and docs/benchmarks.md) from bench/report/raw

Each benchmark runs as its own process with ``DS_BERTOPT_BENCH_OUT`` set; it prints its ratio lines
and writes the numbers behind them with ``ds_bertopt.testing.measure.record_results``. The report and the
figures are generated from those files only. A benchmark that fails or times out is reported as such;
the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import _report
from bench._common import run_streamed

# report name -> (script, quick arguments, full arguments, quick timeout s, full timeout s)
BENCHES: dict[str, tuple[str, list[str], list[str], int, int]] = {
    "balance": ("balance", ["--quick", "--part", "planner", "--part", "ranks", "--repeats", "2"], [], 300, 3600),
    "bucket_clip": ("bucket_clip", ["--quick"], [], 300, 7200),
    "bucket_clip_convergence": (
        "bucket_clip",
        [
            "--convergence",
            "--steps",
            "80",
            "--eval-every",
            "20",
            "--seeds",
            "42",
            "--convergence-dir",
            "{out}/runs/bucket_clip_convergence",
        ],
        ["--convergence", "--convergence-dir", "{out}/runs/bucket_clip_convergence"],
        240,
        3600,
    ),
    "optim": ("optim", ["--quick"], [], 330, 7200),
    "wtacrs": ("wtacrs", ["--quick"], [], 1200, 7200),
    "wtacrs_families": (
        "wtacrs",
        ["--sections", "families", "--family-batch", "8", "--record-as", "wtacrs_families"],
        ["--sections", "families", "--record-as", "wtacrs_families"],
        1800,
        7200,
    ),
    "time_to_train": ("time_to_train", ["--quick"], [], 900, 14400),
    "preprocess": ("preprocess", ["--repeats", "2"], [], 600, 1200),
    "corpus_scale": ("corpus_scale", ["--sizes", "5", "25", "50", "--slice-mb", "5"], [], 1800, 7200),
    "mfu": ("mfu", [], [], 900, 1800),
    "wtacrs_budget": ("wtacrs_budget", [], ["--repeats", "2", "--exhaustive"], 600, 2400),
    "finetune_tasks": ("finetune_tasks", ["--quick"], [], 1800, 14400),
    "time_to_train_continued": (
        "time_to_train",
        ["--scenarios", "continued128", "--seeds", "1", "2", "--steps", "80", "--points", "4", "--masks", "2"]
        + ["--record-as", "time_to_train_continued"],
        ["--scenarios", "continued128", "continued512", "--record-as", "time_to_train_continued"],
        4800,
        14400,
    ),
}


def run_bench(name: str, script: str, extra: list[str], timeout: int, raw_dir: Path, log_dir: Path) -> dict:
    """Run ``bench/<script>.py``; stream its output to the console and ``log_dir/<name>.log``."""
    cmd = [sys.executable, "-u", str(ROOT / "bench" / f"{script}.py"), *extra]
    env = {
        **os.environ,
        "DS_BERTOPT_BENCH_OUT": str(raw_dir),
        "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    print(f"\n=== {name}: {' '.join(cmd[2:])} (timeout {timeout} s)", flush=True)
    start = time.monotonic()
    log_path = log_dir / f"{name}.log"
    lines: list[str] = []

    def echo(line: str) -> None:
        log.write(line)
        lines.append(line.rstrip("\n"))
        print(f"  [{name}] {line}", end="", flush=True)

    with open(log_path, "w") as log:
        code = run_streamed(cmd, echo, timeout, env)  # a watchdog: a benchmark that hangs silently is stopped too
    if time.monotonic() - start >= timeout:
        status = f"timed out after {timeout} s"
    else:
        status = "ok" if code == 0 else f"failed (exit {code})"
    seconds = time.monotonic() - start
    print(f"=== {name}: {status} in {seconds:.0f} s", flush=True)
    return {
        "name": name,
        "status": status,
        "seconds": round(seconds, 1),
        "command": " ".join([f"bench/{script}.py", *extra]),  # checkout-relative: the same in every clone
        "ratio_lines": _report.ratio_lines(lines),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="every benchmark in its quick mode")
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHES), help="run only these benchmarks")
    parser.add_argument("--out", default=str(ROOT / "bench" / "report"), help="report directory")
    parser.add_argument("--report-only", action="store_true", help="do not run; re-render from <out>/raw")
    args = parser.parse_args(argv)

    out = Path(args.out)
    raw_dir, log_dir = out / "raw", out / "logs"
    runs_path = out / "raw" / "_runs.json"
    if args.report_only and not runs_path.exists():
        parser.error(f"--report-only: {runs_path} does not exist (no earlier run_all.py results in {out})")
    raw_dir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    runs = json.loads(runs_path.read_text()) if runs_path.exists() else {}
    if not args.report_only:
        names = args.only or list(BENCHES)
        started = time.monotonic()
        for name in names:
            script, quick_args, full_args, quick_timeout, full_timeout = BENCHES[name]
            (raw_dir / f"{name}.json").unlink(missing_ok=True)  # never report a stale result as this run's
            extra = [a.format(out=out) for a in (quick_args if args.quick else full_args)]
            result = run_bench(name, script, extra, quick_timeout if args.quick else full_timeout, raw_dir, log_dir)
            result["mode"] = "quick" if args.quick else "full"
            runs[name] = result
            runs_path.write_text(json.dumps(runs, indent=1))
        print(f"\nall benchmarks: {time.monotonic() - started:.0f} s", flush=True)
    report = _report.write_report(out, runs)
    print(f"report: {report}")
    if out.resolve() == (ROOT / "bench" / "report").resolve():  # the project's own results: their history too
        print(f"history: {_report.write_benchmarks_doc(raw_dir, runs)}")
    failed = [name for name, run in runs.items() if run["status"] != "ok"]
    if failed:
        print(f"not ok: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
