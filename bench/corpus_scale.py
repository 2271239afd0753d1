"""Corpus scale: pretraining's data path, from a first run to a restart, on 25 MB to 1 GB of text (issue 38).

    flock /tmp/ds_heavy.lock .venv/bin/python bench/corpus_scale.py        # 25, 100, 400, 1000 MB: about an hour
    .venv/bin/python bench/corpus_scale.py --sizes 5 10 --warm-repeats 1     # a quick look

Each size is a synthetic corpus of ``../shared/data``'s sentences reshuffled into documents of the real ones' shapes,
outside the checkout (``--work``, removed at the end). Per size: the **first run**, 1 node x 2 ranks
(``launch/pretrain.py``, ``ds_configs/bert.json``, 1 step, an empty ``data.cache_dir``, the default
``train.dist_timeout_s``): completed?, wall and build seconds, the waiting rank's longest gap between progress lines;
**the build over nodes**: 2 simulated nodes x 1 rank on one shared cache vs 1 node x 1 rank (``data.num_proc`` 1):
build seconds, equal stored digests?; **build throughput per process** vs the Hugging Face fast tokenizer alone on the
same slice, interleaved, the best of ``--repeats`` (another job only ever slows a run down); **warm start-up**: a second
2-rank run minus the embedded corpus's, medians of ``--warm-repeats``, with each rank's peak private (anonymous) and
mapped memory (``/proc/self/smaps_rollup``). Then both extrapolated to 40M and 156.7M sequences.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

os.environ["TOKENIZERS_PARALLELISM"] = "false"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import argv, cpu_env, cpu_kind, deepspeed_launcher, failed_nodes, figure, interleaved, record
from bench._common import ROOT, run_streamed, say, status
from ds_bertopt.data.config import DataConfig
from ds_bertopt.data.corpus import load_documents
from ds_bertopt.data.pipeline import build_sequences
from ds_bertopt.data.sequences import _PARAGRAPH, split_sentences
from ds_bertopt.data.tokenizer import load_tokenizer

SHARED = ROOT.parent / "shared" / "data"
SIZES_MB = (25, 100, 400, 1000)
EXTRAPOLATE = {"40M sequences (Wikipedia, 128 tokens)": 40e6, "156.7M sequences (MLPerf phase 2)": 156.7e6}
TARGET_ADDED_S, TARGET_ADDED_AT_SCALE_S = 5.0, 30.0
TARGET_THROUGHPUT, TARGET_NODES, TARGET_PRIVATE = 0.9, 1.7, 1.2
GAP_SLACK_S = 2.0
"""A waiting rank's progress lines may be this much later than every 30 s (its poll and the heartbeat)."""


# --------------------------------------------------------------------------------------- the synthetic corpora
def synthesize(path: Path, megabytes: float, seed: int) -> Path:
    """A jsonl corpus of about ``megabytes`` MB: documents shaped as the real ones (paragraphs of so many
    sentences), filled with sentences drawn at random from all of them."""
    if path.exists():
        return path
    pool, shapes = [], []
    for name, opener in (("wiki_sample.jsonl", open), ("linux_docs.jsonl.gz", gzip.open)):
        with opener(SHARED / name, "rt", encoding="utf-8") as fh:
            for line in fh:
                paragraphs = [s for p in _PARAGRAPH.split(json.loads(line)["text"]) if (s := split_sentences(p))]
                pool += [sentence for sentences in paragraphs for sentence in sentences]
                shapes += [[len(sentences) for sentences in paragraphs]] if paragraphs else []
    rng, written, target = np.random.default_rng(seed), 0, int(megabytes * 1e6)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        while written < target:
            shape = shapes[rng.integers(len(shapes))]
            drawn = iter(rng.integers(len(pool), size=sum(shape)))  # each paragraph takes the next ``count``
            text = "\n\n".join(" ".join(pool[i] for i in itertools.islice(drawn, count)) for count in shape)
            written += fh.write(json.dumps({"text": text}) + "\n")
    tmp.rename(path)
    return path


# --------------------------------------------------------------------------------------- a rank, with its memory
def _memory() -> dict:
    """Private (anonymous) and mapped (file and shared) resident bytes of this process (``smaps_rollup``)."""
    with open("/proc/self/smaps_rollup", encoding="utf-8") as fh:
        rows = [line.partition(":") for line in fh]
    fields = {key: int(value.split()[0]) * 1024 for key, _, value in rows if value.strip().endswith("kB")}
    return {"private": fields.get("Anonymous", 0), "mapped": fields.get("Rss", 0) - fields.get("Anonymous", 0)}


def as_rank(argv: list[str]) -> int:
    """Run ``launch/pretrain.py``'s main with a thread sampling this rank's memory; the peaks go to
    ``$CORPUS_SCALE_MEMORY/rank<RANK>.json``."""
    peak, stop = {"private": 0, "mapped": 0}, threading.Event()

    def sample():
        while not stop.is_set():
            peak.update({key: max(peak[key], value) for key, value in _memory().items()})
            stop.wait(0.2)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    from ds_bertopt.train.tasks.pretrain import main

    code = main(argv)
    stop.set()
    thread.join()
    folder = os.environ.get("CORPUS_SCALE_MEMORY")
    if folder:
        Path(folder, f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(peak))
    return code


# --------------------------------------------------------------------------------------- the jobs
def pretrain_args(corpus, cache: Path, out: Path, *extra: str) -> list[str]:
    files = {"train_file": corpus} if corpus else {}
    overrides = ["train.save_model=false", "train.overwrite_output_dir=true", f"data.cache_dir={cache}", *extra]
    args = argv(Path(__file__).resolve(), "--as-rank", deepspeed_config=ROOT / "ds_configs" / "bert.json", **files)
    return args + argv(output_dir=out, max_steps=1, eval_every=0, overrides=overrides)


def run_job(ranks: int, args: list[str], memory: Path, timeout: float) -> dict:
    """A ``deepspeed --num_gpus ranks`` job: exit status, wall seconds, its lines with their times, memory per rank."""
    shutil.rmtree(memory, ignore_errors=True)
    memory.mkdir(parents=True)
    cmd = [*deepspeed_launcher(ranks), *args]
    env = cpu_env(CORPUS_SCALE_MEMORY=str(memory))
    start, lines = time.monotonic(), []
    rc = run_streamed(cmd, lambda line: lines.append((time.monotonic() - start, line)), timeout, env)
    ranks_memory = [json.loads(p.read_text()) for p in sorted(memory.glob("rank*.json"))]
    return {"rc": rc, "wall": time.monotonic() - start, "lines": lines, "memory": ranks_memory}


def stored(cache: Path) -> dict:
    """The stored fingerprint of the one build in ``cache``."""
    (path,) = cache.glob("built/*/manifest.json")
    return json.loads(path.read_text())


def progress_gaps(lines: list[tuple[float, str]]) -> tuple[int, float]:
    """The waiting rank's progress lines during the build, and the longest time without one."""
    start = next(t for t, line in lines if "data: building" in line)
    end = next(t for t, line in lines if "data: built in" in line)
    waits = [t for t, line in lines if "waiting for node" in line]
    times = [start, *waits, end]
    return len(waits), max(b - a for a, b in zip(times, times[1:]))


def throughput(corpus: Path, tokenizer_dir: str, work: Path, megabytes: float, repeats: int) -> dict:
    """Tokens per second of the build (one process) and of the HF fast tokenizer alone, on the same text."""
    piece = work / "slice.jsonl"
    with open(corpus, encoding="utf-8") as src, open(piece, "w", encoding="utf-8") as dst:
        dst.writelines(itertools.takewhile(lambda _: dst.tell() <= megabytes * 1e6, src))  # whole lines, to the size
    documents = load_documents(DataConfig(train_files=(str(piece),)), str(work / "slice_cache"))
    texts, tokenizer = list(documents["text"]), load_tokenizer(tokenizer_dir)
    cache, tokens = work / "throughput_cache", 0
    options = dict(max_seq_length=128, short_seq_prob=0.1, nsp=False, seed=1, split="train", num_proc=1)

    def build() -> float:
        shutil.rmtree(cache, ignore_errors=True)  # every build from scratch, its removal not timed
        start = time.perf_counter()
        build_sequences(documents, tokenizer, cache_dir=str(cache), **options)
        return time.perf_counter() - start

    def hf_tokenizer() -> None:
        nonlocal tokens
        tokens = sum(map(len, tokenizer(texts, add_special_tokens=False)["input_ids"]))

    seconds = interleaved({"build": build, "tokenizer": hf_tokenizer}, repeats=repeats, warmup=0)
    shutil.rmtree(cache, ignore_errors=True)
    rate = {name: tokens / min(values) for name, values in seconds.items()}
    return {"tokens": tokens, "seconds": seconds, "build_tps": rate["build"], "hf_tps": rate["tokenizer"]}


# --------------------------------------------------------------------------------------- the benchmark
def measure_size(mb: float, work: Path, args) -> dict:
    corpus = synthesize(work / f"corpus_{mb:g}MB.jsonl", mb, seed=int(mb * 10))
    cache, row = work / f"cache_{mb:g}MB", {"mb": mb, "bytes": corpus.stat().st_size}
    first = run_job(2, pretrain_args(corpus, cache, work / "out"), work / "memory", args.timeout)
    completed = first["rc"] == 0
    waits, gap = progress_gaps(first["lines"]) if completed else (0, float("inf"))
    timed_out = any("lost contact" in line or "Timed out" in line for _, line in first["lines"])
    built = stored(cache) if completed else {}
    row["first"] = {"rc": first["rc"], "wall": first["wall"], "waits": waits, "gap": gap, "timed_out": timed_out}
    row["first"]["build_s"] = built.get("build_seconds")
    row["sequences"] = built.get("train", {}).get("rows", 0)
    say(
        f"{mb:g} MB ({row['sequences']:,} training sequences): first run, 1 node x 2 ranks: "
        f"{'completed' if completed else 'FAILED (exit %s)' % first['rc']} in {first['wall']:.0f} s (build "
        f"{row['first']['build_s']} s); {waits} progress lines while rank 1 waited, longest gap {gap:.0f} s"
    )
    if not completed:
        print("".join(line for _, line in first["lines"][-40:]))
        return row
    one_cache, two_cache, extra = work / "one_node", work / "two_nodes", "data.num_proc=1"
    one = run_job(1, pretrain_args(corpus, one_cache, work / "out1", extra), work / "memory", args.timeout)
    failed = failed_nodes(2, 1, pretrain_args(corpus, two_cache, work / "out2", extra), args.timeout)  # 2 x 1 rank
    for r in failed:
        print(r.output[-3000:])
    one_built, two_built = stored(one_cache), stored(two_cache)
    digests = {json.dumps([b["vocabulary"], b["samples"]]) for b in (built, one_built, two_built)}
    row["nodes"] = n = {
        "one_s": one_built["build_seconds"] if one["rc"] == 0 else None,
        "two_s": two_built["build_seconds"] if not failed else None,
        "identical": len(digests) == 1,
        "stages_one": one_built.get("stage_seconds"),
        "stages_two": two_built.get("stage_seconds"),
    }
    for folder in (one_cache, two_cache):
        shutil.rmtree(folder, ignore_errors=True)
    speedup = n["one_s"] / n["two_s"] if n["one_s"] and n["two_s"] else 0.0  # 0: one of the builds failed
    say(
        f"{mb:g} MB: build on 2 simulated nodes (one shared data.cache_dir, 1 process each) vs 1 node: "
        f"{speedup:.2f}x faster ({n['two_s']} s vs {n['one_s']} s); identical result "
        f"(stored digests of the 2-node, 1-node and 2-rank builds): {'yes' if n['identical'] else 'NO'}"
    )
    row["throughput"] = t = throughput(corpus, str(cache / built["tokenizer"]), work, args.slice_mb, args.repeats)
    say(
        f"{mb:g} MB: build (tokenize + sequences) per process vs HF fast tokenizer alone: "
        f"{t['build_tps'] / t['hf_tps']:.2f}x (best of {args.repeats} each: {t['build_tps']:,.0f} vs "
        f"{t['hf_tps']:,.0f} tokens/s on the first {args.slice_mb:g} MB)"
    )
    return row


def warm_starts(rows: list[dict], work: Path, args) -> dict:
    """Second runs (cache filled), interleaved with the embedded corpus's: wall seconds and memory per rank, into
    each row's ``warm`` and ``memory``; returns the embedded corpus's."""
    jobs = {"embedded": (None, work / "cache_embedded")}
    jobs.update({f"{r['mb']:g}": (work / f"corpus_{r['mb']:g}MB.jsonl", work / f"cache_{r['mb']:g}MB") for r in rows})
    run_job(2, pretrain_args(None, jobs["embedded"][1], work / "out"), work / "memory", args.timeout)  # its first
    out: dict = {name: {"wall": [], "memory": []} for name in jobs}
    for _ in range(args.warm_repeats):
        for name, (corpus, cache) in jobs.items():
            job = run_job(2, pretrain_args(corpus, cache, work / "out"), work / "memory", args.timeout)
            opened = any("data: opened the stored build" in line for _, line in job["lines"])
            if job["rc"] != 0 or not opened:
                print("".join(line for _, line in job["lines"][-30:]))
                raise SystemExit(f"corpus_scale: the warm run of {name} failed or rebuilt")
            out[name]["wall"].append(job["wall"])
            out[name]["memory"].append(job["memory"])
    for result in out.values():
        result["median"] = statistics.median(result["wall"])
        for key in ("private", "mapped"):
            result[key] = max(m[key] for memory in result["memory"] for m in memory)
    base = out["embedded"]
    for r in rows:
        w = out[f"{r['mb']:g}"]
        r["warm"] = {"median": w["median"], "added": w["median"] - base["median"], "walls": w["wall"]}
        r["memory"] = {"private": w["private"], "mapped": w["mapped"]}
        say(
            f"{r['mb']:g} MB: warm start-up to step 1, 2 ranks: {w['median']:.1f} s, {r['warm']['added']:+.1f} s "
            f"over the embedded corpus ({base['median']:.1f} s; medians of {args.warm_repeats}); per rank: private "
            f"{w['private'] / 2**20:,.0f} MiB, mapped {w['mapped'] / 2**20:,.0f} MiB (peaks)"
        )
    return base


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--as-rank" in argv:  # a rank of a job (the launcher puts --local_rank first)
        return as_rank([a for a in argv if a != "--as-rank"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=list(SIZES_MB), help="corpus sizes in MB")
    parser.add_argument("--work", default=None, help="where corpora and caches go (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep --work afterwards")
    parser.add_argument("--repeats", type=int, default=3, help="throughput: interleaved runs, the best of each")
    parser.add_argument("--slice-mb", type=float, default=10.0, help="throughput: MB of each corpus measured")
    parser.add_argument("--warm-repeats", type=int, default=2, help="warm runs per corpus (the median)")
    parser.add_argument("--timeout", type=float, default=7200, help="seconds one job may take")
    args = parser.parse_args(argv)
    if not (SHARED / "wiki_sample.jsonl").is_file():
        print(f"corpus_scale: {SHARED} is absent (the shared data sits beside the checkout); nothing measured")
        return 0
    work = Path(args.work or tempfile.mkdtemp(prefix="ds_bertopt_corpus_scale_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        say(cpu_kind())
        rows = [measure_size(mb, work, args) for mb in args.sizes]
        done = [r for r in rows if r["first"]["rc"] == 0]
        base = warm_starts(done, work, args) if done else {}
        summarize(rows, done)
        note = "synthetic corpora from ../shared/data; ds_configs/bert.json, 1 step; warm: medians of "
        note += f"{args.warm_repeats}; throughput: best of {args.repeats} on {args.slice_mb:g} MB; one machine"
        record("corpus_scale", note, sizes=rows, embedded={k: v for k, v in base.items() if k != "memory"})
        return 0 if len(done) == len(rows) else 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def summarize(rows: list[dict], done: list[dict]) -> None:
    """The extrapolations and the targets, each with its verdict."""
    completed = len(done) == len(rows) and not any(r["first"]["timed_out"] for r in rows)
    worst_gap = max((r["first"]["gap"] for r in rows), default=float("inf"))
    say(
        f"first 2-rank run completes at every size, no timeout, a progress line at least every 30 s while ranks wait: "
        f"{len(done)} of {len(rows)} completed, longest gap {worst_gap:.0f} s "
        f"(target: all, <= 30 s: {status(completed and worst_gap <= 30 + GAP_SLACK_S)})"
    )
    if not done:
        return
    n = np.array([r["sequences"] for r in done], dtype=float)
    added = np.array([r["warm"]["added"] for r in done])
    private = np.array([r["memory"]["private"] for r in done], dtype=float)
    fitted = np.polyfit(n, added, 1)[0] if len(done) > 1 else 0.0
    slope = max(0.0, fitted)  # a falling fit is noise between the sizes: no growth, never a saving at scale

    def warm_at(count: float) -> float:  # from the worst size measured on, at the measured (or no) growth
        return float(added.max()) + slope * (count - n[int(added.argmax())])

    mem_slope = np.polyfit(n, private, 1)[0] if len(done) > 1 else 0.0
    for label, count in EXTRAPOLATE.items():
        say(
            f"extrapolated to {label}: warm start-up {warm_at(count):+.1f} s over the embedded corpus "
            f"(slope {slope * 1e6:.3f} s per million sequences, fitted {fitted * 1e6:.3f}); private memory per rank "
            f"{(private[-1] + mem_slope * (count - n[-1])) / 2**30:.2f} GiB (slope {mem_slope:.1f} B per sequence)"
        )
    at_scale = warm_at(EXTRAPOLATE["156.7M sequences (MLPerf phase 2)"])
    say(
        f"warm start-up added over the embedded corpus, 2 ranks: at most {added.max():+.1f} s at the sizes measured "
        f"(target <= {TARGET_ADDED_S:g} s: {status(added.max() <= TARGET_ADDED_S)}); {at_scale:+.1f} s extrapolated to "
        f"156.7M sequences (target <= {TARGET_ADDED_AT_SCALE_S:g} s: {status(at_scale <= TARGET_ADDED_AT_SCALE_S)})"
    )
    ratios = [r["throughput"]["build_tps"] / r["throughput"]["hf_tps"] for r in done]
    nodes = [r["nodes"]["one_s"] / r["nodes"]["two_s"] for r in done if r["nodes"]["one_s"] and r["nodes"]["two_s"]]
    identical = all(r["nodes"]["identical"] for r in done)
    say(
        f"build throughput per process vs the HF fast tokenizer alone: {min(ratios):.2f}x at worst "
        f"(target >= {TARGET_THROUGHPUT}x: {status(min(ratios) >= TARGET_THROUGHPUT)})"
    )
    say(
        f"2 simulated nodes on a shared directory vs 1 node: {min(nodes, default=0):.2f}x at worst, identical result: "
        f"{'yes' if identical else 'NO'} (target >= {TARGET_NODES}x, identical: "
        f"{status(min(nodes, default=0) >= TARGET_NODES and identical)})"
    )
    growth = private[-1] / private[0]
    say(
        f"private memory per rank at {done[-1]['mb']:g} MB vs {done[0]['mb']:g} MB: {growth:.2f}x "
        f"({private[-1] / 2**20:,.0f} vs {private[0] / 2**20:,.0f} MiB; target <= {TARGET_PRIVATE}x: "
        f"{status(growth <= TARGET_PRIVATE)})"
    )
    millions, axis = [float(x) / 1e6 for x in n], {"xlabel": "training sequences (millions)"}
    warm = [{"label": "measured", "x": millions, "y": [float(a) for a in added]}]
    title = "Warm start-up over the embedded corpus, 2 ranks"
    figure("curves", "warm_start", title, warm, **axis, ylabel="seconds added")
    memory = [
        {"label": "private (anonymous)", "x": millions, "y": [float(p) / 2**20 for p in private]},
        {"label": "mapped (files)", "x": millions, "y": [r["memory"]["mapped"] / 2**20 for r in done]},
    ]
    figure("curves", "memory", "Memory per rank on a warm start (peaks)", memory, **axis, ylabel="MiB")


if __name__ == "__main__":
    sys.exit(main())
