"""Issue 40's budget-mode target: how long ``ds-bertopt memory --budget-gb 2 --seq 64 --compare`` takes to answer, and
whether it answers what measuring every setup (``--exhaustive``) does.

    python bench/wtacrs_budget.py [--repeats 2] [--exhaustive] [--lock /tmp/ds_heavy.lock]

Each run is the real command in a fresh process (the default model, every core), timed to its ``recommended:`` line;
``--exhaustive`` runs the reference once after them (about 9 minutes on 2 cores). Both choose by ``sizing.choose``'s
rule; the record keeps every run's output.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import cpu_kind, maybe_lock, record, run_streamed, say, status, add_record_as

COMMAND = ["memory", "--budget-gb", "2", "--seq", "64", "--compare"]
TARGET_S = 180.0
CHOICE = re.compile(r"^recommended: (.+?) \(batch (\d+),")


def answer(extra: list[str], lock: str) -> dict:
    """One run of :data:`COMMAND`: ``seconds``, ``recommended`` ("<setup> at batch <n>"), ``output`` (its lines)."""
    lines: list[str] = []
    cmd = [sys.executable, "-u", "-c", "import sys; from ds_bertopt.cli import main; sys.exit(main())", *COMMAND]
    with maybe_lock(lock):
        start = time.monotonic()
        code = run_streamed([*cmd, *extra], lambda line: lines.append(line.rstrip("\n")) or print(line, end=""), 3600)
        seconds = time.monotonic() - start
    chosen = next((m for m in map(CHOICE.match, lines) if m), None)
    if code or chosen is None:
        raise RuntimeError(f"ds-bertopt {' '.join(COMMAND + extra)} failed (exit {code}): {lines[-5:]}")
    return {"seconds": seconds, "recommended": f"{chosen.group(1)} at batch {chosen.group(2)}", "output": lines}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs of the fast search")
    parser.add_argument("--exhaustive", action="store_true", help="also run the reference (every setup timed)")
    parser.add_argument("--lock", default="", help="hold this flock around each run (a shared machine)")
    add_record_as(parser, "wtacrs_budget")
    args = parser.parse_args()
    cpu, command = cpu_kind(), f"ds-bertopt {' '.join(COMMAND)}"
    runs = [answer([], args.lock) for _ in range(args.repeats)]
    reference = answer(["--exhaustive"], args.lock) if args.exhaustive else None
    for index, run in enumerate(runs, 1):
        say(f"{command}, run {index}: {run['seconds']:.0f} s, recommended {run['recommended']}")
    if reference is not None:
        say(f"{command} --exhaustive: {reference['seconds']:.0f} s, recommended {reference['recommended']}")
    slowest, choices = max(run["seconds"] for run in runs), {run["recommended"] for run in runs}
    same = "not checked (run with --exhaustive)" if reference is None else status(choices == {reference["recommended"]})
    say(
        f"[target] {' '.join(COMMAND)} on {cpu}: <= {TARGET_S:.0f} s with the exhaustive recommendation: "
        f"{status(slowest <= TARGET_S)} ({slowest:.0f} s, slowest of {len(runs)}; same recommendation: {same})"
    )
    record(args.record_as, f"{cpu}; every core per child", runs=runs, exhaustive=reference)
    return 0


if __name__ == "__main__":
    sys.exit(main())
