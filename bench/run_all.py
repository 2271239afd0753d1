"""Run every benchmark and write ``bench/report/REPORT.md`` with its plots.

    python bench/run_all.py --quick      # every benchmark in its quick settings
    python bench/run_all.py              # full settings (an hour or more on 2 CPU cores)
    python bench/run_all.py --report-only   # re-render the report (and docs/benchmarks.md) from bench/report/raw

Each benchmark runs as its own process with ``DS_BERTOPT_BENCH_OUT`` set, prints its ratio lines and records the
numbers behind them (``bench/_common.py``'s ``record``); the report and its figures come from those records only. A
benchmark that fails or times out is reported as such; the others still run.
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

# report name -> (script, quick arguments, full arguments, quick timeout s, full timeout s); {out}: the report folder
CLIP_QUICK = "--convergence --steps 80 --eval-every 20 --seeds 42 --convergence-dir {out}/runs/bucket_clip_convergence"
CLIP_FULL = "--convergence --convergence-dir {out}/runs/bucket_clip_convergence"
FAMILIES_QUICK = "--sections families --family-batch 8 --record-as wtacrs_families"
FAMILIES_FULL = "--sections families --record-as wtacrs_families"
AS_CONTINUED = "--record-as time_to_train_continued"
CONTINUED_QUICK = f"--scenarios continued128 --seeds 1 2 --steps 80 --points 4 --masks 2 {AS_CONTINUED}"
CONTINUED_FULL = f"--scenarios continued128 continued512 {AS_CONTINUED}"
BENCHES: dict[str, tuple[str, str, str, int, int]] = {
    "balance": ("balance", "--quick --part planner --part ranks --repeats 2", "", 300, 3600),
    "bucket_clip": ("bucket_clip", "--quick", "", 300, 7200),
    "bucket_clip_convergence": ("bucket_clip", CLIP_QUICK, CLIP_FULL, 240, 3600),
    "optim": ("optim", "--quick", "", 330, 7200),
    "wtacrs": ("wtacrs", "--quick", "", 1200, 7200),
    "wtacrs_families": ("wtacrs", FAMILIES_QUICK, FAMILIES_FULL, 1800, 7200),
    "time_to_train": ("time_to_train", "--quick", "", 900, 14400),
    "preprocess": ("preprocess", "--repeats 2", "", 600, 1200),
    "corpus_scale": ("corpus_scale", "--sizes 5 25 50 --slice-mb 5", "", 1800, 7200),
    "mfu": ("mfu", "", "", 900, 1800),
    "wtacrs_budget": ("wtacrs_budget", "", "--repeats 2 --exhaustive", 600, 2400),
    "finetune_tasks": ("finetune_tasks", "--quick", "", 1800, 14400),
    "time_to_train_continued": ("time_to_train", CONTINUED_QUICK, CONTINUED_FULL, 4800, 14400),
}


def run_bench(name: str, script: str, extra: list[str], timeout: int, raw_dir: Path, log_dir: Path) -> dict:
    """Run ``bench/<script>.py``; stream its output to the console and ``log_dir/<name>.log``."""
    cmd = [sys.executable, "-u", str(ROOT / "bench" / f"{script}.py"), *extra]
    env = dict(os.environ, DS_BERTOPT_BENCH_OUT=str(raw_dir), DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    print(f"\n=== {name}: {' '.join(cmd[2:])} (timeout {timeout} s)", flush=True)
    start, lines = time.monotonic(), []

    def echo(line: str) -> None:
        log.write(line)
        lines.append(line.rstrip("\n"))
        print(f"  [{name}] {line}", end="", flush=True)

    with open(log_dir / f"{name}.log", "w") as log:
        code = run_streamed(cmd, echo, timeout, env)  # a watchdog: a benchmark that hangs silently is stopped too
    seconds = time.monotonic() - start
    status = f"timed out after {timeout} s" if seconds >= timeout else "ok" if code == 0 else f"failed (exit {code})"
    print(f"=== {name}: {status} in {seconds:.0f} s", flush=True)
    command = " ".join([f"bench/{script}.py", *extra])  # checkout-relative: the same in every clone
    ratio_lines = _report.ratio_lines(lines)
    return dict(name=name, status=status, seconds=round(seconds, 1), command=command, ratio_lines=ratio_lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="every benchmark in its quick mode")
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHES), help="run only these benchmarks")
    parser.add_argument("--out", default=str(ROOT / "bench" / "report"), help="report directory")
    parser.add_argument("--report-only", action="store_true", help="do not run; re-render from <out>/raw")
    args = parser.parse_args(argv)

    out = Path(args.out)
    raw_dir, log_dir, runs_path = out / "raw", out / "logs", out / "raw" / "_runs.json"
    if args.report_only and not runs_path.exists():
        parser.error(f"--report-only: {runs_path} does not exist (no earlier run_all.py results in {out})")
    raw_dir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    runs = json.loads(runs_path.read_text()) if runs_path.exists() else {}
    if not args.report_only:
        started, mode = time.monotonic(), "quick" if args.quick else "full"
        for name in args.only or list(BENCHES):
            script, quick_args, full_args, quick_timeout, full_timeout = BENCHES[name]
            (raw_dir / f"{name}.json").unlink(missing_ok=True)  # never report a stale result as this run's
            extra = [a.format(out=out) for a in (quick_args if args.quick else full_args).split()]
            timeout = quick_timeout if args.quick else full_timeout
            runs[name] = {**run_bench(name, script, extra, timeout, raw_dir, log_dir), "mode": mode}
            runs_path.write_text(json.dumps(runs, indent=1))
        print(f"\nall benchmarks: {time.monotonic() - started:.0f} s", flush=True)
    print(f"report: {_report.write_report(out, runs)}")
    if out.resolve() == (ROOT / "bench" / "report").resolve():  # the project's own results: their history too
        print(f"history: {_report.write_benchmarks_doc(raw_dir, runs)}")
    failed = [name for name, run in runs.items() if run["status"] != "ok"]
    if failed:
        print(f"not ok: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
