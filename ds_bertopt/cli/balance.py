"""``ds-bertopt balance``: plan a corpus for a world size with every strategy and print the load balance.

    ds-bertopt balance --corpus ../shared/data/linux_docs.jsonl.gz --max-seq-len 512 \\
        --world-size 1024 --ranks-per-node 8 --micro-batch 16 --plot balance.png
    ds-bertopt balance --lengths lengths.npy --world-size 64 --ranks-per-node 8 --micro-batch 32
    ds-bertopt balance --mlperf-mix --world-size 1024 --ranks-per-node 8 --micro-batch 16
    ds-bertopt balance --sequences 100M --world-size 1024 --ranks-per-node 8

``--corpus`` builds the sequences the way pretraining does (``data.pipeline``, cached), so the
lengths are the ones training will see. When the corpus holds fewer than ``--steps`` global
batches, the plan runs on that many global batches of lengths drawn (with replacement) from the
corpus's length mix: the balance figures depend on the mix, not on which text it is.

For every strategy it prints the per-step max/mean rank work (mean over steps and p99), with the
unpadded cost ``a·L + b·L²`` and the padded one (samples × cost of the padded length), the padding
fraction, real tokens per rank and step, the predicted step time relative to ``random`` with padded
kernels (a synchronous step lasts as long as its busiest rank; per global batch of samples), the
samples per step and per micro-batch, and the planning CPU time per step. These figures need every
rank's plan: they come from the global planner (:func:`~ds_bertopt.data.plan.plan_epoch`), whose rows
training's windowed planner reproduces. ``--peers`` adds the batch planners of transformers and
DeepSpeed, driven as their trainers drive them (``data.peers.peer_plan``; both global, their own algorithms).
``--plot`` writes a PNG: the corpus length histogram and, per strategy, the distribution of rank work
relative to the step mean.

``--sequences N`` is the seed's scale instead (MLPerf phase 2: 156.7M sequences, 1,024 ranks): one rank's
view of a synthetic corpus of ``N`` sequences, planned by the training sampler a window at a time, each
strategy in a fresh process: time to the first step, time per window, steps that waited for planning
behind a simulated step of ``--step-time`` s, peak RSS; ``--global-plan`` also runs the whole-epoch
planner for every rank in a fresh process (time, peak RSS, and whether the rows are bit-identical).

This file only parses and prints: the figures come from :mod:`ds_bertopt.data.peers` (:func:`evaluate`, the length
mixes, the peers' planners) and :mod:`ds_bertopt.data.scale` (the fresh-process measurement at scale).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Optional

import numpy as np

from ..data.config import STRATEGIES, SamplerConfig
from ..data.cost import CostModel
from ..data.peers import (
    PEERS,
    StrategyResult,
    evaluate,
    mlperf_phase2_lengths,
    per_global_batch,
    read_lengths,
    simulation_lengths,
)
from ..data.scale import SCALE_STEP_TIME, parse_count, scale_lines, scale_view, synthetic_lengths
from ..errors import DataError, check


def scale_main(args: argparse.Namespace) -> int:
    """``--sequences``: one rank's windowed view of a synthetic corpus of that size, a fresh process a strategy."""
    n = parse_count(args.sequences)
    global_batch = args.world_size * args.micro_batch * args.grad_accum
    check(n >= global_batch, f"--sequences {n} is below one global batch of {global_batch}")
    check(0 <= args.rank < args.world_size, f"--rank {args.rank} is outside world size {args.world_size}")
    started = time.perf_counter()
    label = (
        f"{args.sequences} sequences, {args.world_size} ranks ({args.world_size // args.ranks_per_node} nodes × "
        f"{args.ranks_per_node}) × {args.micro_batch} × {args.grad_accum}, rank {args.rank}"
    )
    print(
        f"corpus: {n} synthetic MLPerf-like lengths (half at 512, the rest uniform 32–511; int16, "
        f"{n * 2 / 2**20:.0f} MiB), seed {args.seed}; every strategy planned by rank {args.rank}'s sampler in a "
        "fresh process (hf_batch_rebalance, a peer's algorithm, plans globally and is not run here)",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="ds_bertopt_balance_") as tmp:
        path = os.path.join(tmp, "lengths.npy")
        np.save(path, synthetic_lengths(n, args.seed))
        results = []
        for strategy in args.strategies:  # one at a time: print as they finish
            results += scale_view(
                path,
                strategies=(strategy,),
                world_size=args.world_size,
                ranks_per_node=args.ranks_per_node,
                micro_batch=args.micro_batch,
                grad_accum=args.grad_accum,
                rank=args.rank,
                windows=args.windows,
                step_time=args.step_time,
                seed=args.seed,
                reference=args.reference,
            )
            print(scale_lines(results[-1:], label, args.step_time)[0], flush=True)
    for line in scale_lines(results, label, args.step_time)[len(results) :]:
        print(line)
    print(f"done in {time.perf_counter() - started:.1f} s")
    return 0


# ------------------------------------------------------------------------------------------------
# the command
# ------------------------------------------------------------------------------------------------
def corpus_lengths(path: str, max_seq_len: int, tokenizer: Optional[str], cache_dir: Optional[str]) -> np.ndarray:
    """Lengths of the training sequences pretraining builds from ``path`` (cached by the pipeline)."""
    from ..config import BertOptConfig
    from ..configlib import load_section
    from ..data.corpus import check_cache_dir, expand_train_files
    from ..data.pipeline import build_pretrain_data
    from ..data.tokenizer import check_tokenizer_location

    expand_train_files([path])  # every path checked before the cache is written
    if tokenizer:
        check_tokenizer_location(tokenizer, "--tokenizer")
    if cache_dir:
        check_cache_dir(cache_dir, "--cache-dir")
    data = {"train_files": [path], "max_seq_length": max_seq_len}
    if tokenizer:
        data["tokenizer"] = tokenizer
    if cache_dir:
        data["cache_dir"] = cache_dir
    cfg = load_section(
        BertOptConfig, {"data": data, "model": {"max_position_embeddings": max(512, max_seq_len)}}, "bertopt"
    )
    return build_pretrain_data(cfg).lengths.astype(np.int64)


def format_table(results: dict[str, StrategyResult], global_batch: Optional[int] = None) -> list[str]:
    """One row per strategy; step times relative to ``random``'s with padded kernels, per global batch."""
    base = results.get("random")
    lines = [
        f"{'strategy':<25} {'work max/mean':>13} {'p99':>6} {'padded max/mean':>15} {'p99':>6} "
        f"{'padding':>8} {'tokens/rank':>11} {'step time / random':>19} {'samples/step':>13} "
        f"{'micro mean/max':>14} {'dropped':>8} {'plan CPU s':>11}",
        f"{'':<25} {'(unpadded)':>13} {'':>6} {'':>15} {'':>6} {'':>8} {'':>11} {'unpadded / padded':>19} "
        f"{'':>13} {'':>14} {'':>8} {'per step':>11}",
    ]
    for name, r in results.items():
        f = r.figures
        scale = per_global_batch(f, global_batch) if global_batch else 1.0
        rel = (
            f"{scale * f.step_time / base.figures.padded_step_time:.3f} / "
            f"{scale * f.padded_step_time / base.figures.padded_step_time:.3f}"
            if base is not None
            else "-"
        )
        samples = (
            f"{f.samples_per_step_min}"
            if f.samples_per_step_min == f.samples_per_step_max
            else f"{f.samples_per_step_min}-{f.samples_per_step_max}"
        )
        micro = f"{f.micro_batch_samples_mean:.1f}/{f.micro_batch_samples_max}"
        lines.append(
            f"{name:<25} {f.imbalance_mean:>13.3f} {f.imbalance_p99:>6.3f} {f.padded_imbalance_mean:>15.3f} "
            f"{f.padded_imbalance_p99:>6.3f} {100 * f.padding:>7.1f}% {f.tokens_per_rank:>11.0f} {rel:>19} "
            f"{samples:>13} {micro:>14} {r.plan.dropped:>8d} {r.seconds:>11.4f}"
        )
    return lines


def plot(path: str, corpus: np.ndarray, results: dict[str, StrategyResult], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hist_ax, work_ax, padded_ax) = plt.subplots(3, 1, figsize=(11, 12))
    hist_ax.hist(corpus, bins=min(128, int(corpus.max())), color="#4c72b0")
    hist_ax.set(title=f"sequence lengths: {title}", xlabel="tokens", ylabel="sequences")
    names = list(results)
    for ax, attr, what in (
        (work_ax, "work_per_rank", "unpadded cost a·L + b·L²"),
        (padded_ax, "padded_work_per_rank", "padded cost (micro × cost of padded length)"),
    ):
        data = [getattr(results[n].figures, attr).ravel() for n in names]
        ax.boxplot(data, whis=(0, 100), showfliers=False)
        ax.set_xticks(range(1, len(names) + 1), names, rotation=12)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(
            title=f"rank work / step mean, every rank and step — {what} (whiskers: min, max)", ylabel="work / step mean"
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-bertopt balance", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--corpus", help="a corpus file (.txt/.jsonl[.gz]); sequences are built as pretraining builds them"
    )
    src.add_argument("--lengths", help="sequence lengths: .npy or text with one integer per sequence")
    src.add_argument(
        "--mlperf-mix",
        action="store_true",
        help="MLPerf BERT phase-2 mix: bins 1-128/129-256/257-384/385-512 as 6:3:2:5, spike at 512",
    )
    src.add_argument(
        "--sequences",
        help="the seed's scale: one rank's windowed plan of this many synthetic sequences (e.g. 100M, 156.7M): "
        "time to the first step, per window, waits, peak RSS",
    )
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--ranks-per-node", type=int, required=True)
    p.add_argument("--micro-batch", type=int, default=16, help="samples per micro-batch (default 16, MLPerf's)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-seq-len", type=int, default=512, help="sequence length the corpus is built for (--corpus)")
    p.add_argument("--tokenizer", help="tokenizer directory for --corpus (default: WordPiece trained on the corpus)")
    p.add_argument("--cache-dir", help="ds_bertopt cache for --corpus (default: the pretraining default)")
    p.add_argument("--steps", type=int, default=50, help="global batches to simulate when the corpus has fewer")
    p.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    p.add_argument("--config", help="DeepSpeed JSON whose bertopt.sampler section to start from")
    p.add_argument("--bins", help="comma-separated upper bin edges, e.g. 128,256,384,512")
    p.add_argument("--bin-counts", help="comma-separated samples per bin in a local batch, e.g. 6,3,2,5")
    p.add_argument("--num-bins", type=int, help="quantile bins when --bins is not given")
    p.add_argument(
        "--hidden-size",
        type=int,
        default=None,
        help="cost model b = 1/(6·hidden) (default: the config's cost_quadratic, BERT-large)",
    )
    objective = p.add_mutually_exclusive_group()
    objective.add_argument(
        "--padded",
        dest="padded",
        action="store_const",
        const=True,
        help="stratified_node_balance balances the padded micro-batch cost (the default)",
    )
    objective.add_argument(
        "--unpadded",
        dest="padded",
        action="store_const",
        const=False,
        help="stratified_node_balance balances the per-sample cost (both costs are printed)",
    )
    p.add_argument(
        "--peers",
        action="store_true",
        help=f"also plan with {' and '.join(PEERS)} (transformers, DeepSpeed; slow at 1,024 ranks)",
    )
    p.add_argument(
        "--peer-budget",
        type=float,
        default=60.0,
        help="seconds of planning after which the transformers peer stops adding steps (at least one)",
    )
    p.add_argument("--micro-batch-tokens", type=int, help="sampler.micro_batch_tokens for the packed strategies")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", help="write a PNG here")
    scale = p.add_argument_group("--sequences")
    scale.add_argument("--rank", type=int, default=0, help="the rank whose view is planned")
    scale.add_argument("--windows", type=int, default=4, help="windows of steps to take (then a resume at the end)")
    scale.add_argument(
        "--step-time",
        type=float,
        default=SCALE_STEP_TIME,
        help=f"simulated seconds of a training step, while the next window is planned (default {SCALE_STEP_TIME})",
    )
    scale.add_argument(
        "--global-plan",
        dest="reference",
        action="store_true",
        help="also the whole epoch for every rank (the global planner) in a fresh process: time, peak RSS, and "
        "whether the windows are bit-identical to it",
    )
    return p


def _int_list(text: Optional[str], flag: str) -> Optional[tuple[int, ...]]:
    if text is None:
        return None
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise DataError(f"{flag}: expected comma-separated integers, got {text!r}") from None


def sampler_config(args: argparse.Namespace) -> SamplerConfig:
    from ..configlib import load_section, to_dict

    base = SamplerConfig()
    if args.config:
        from ..config import load_config

        base = load_config(args.config).bertopt.sampler
    raw = to_dict(base)
    for key, value in (
        ("bins", _int_list(args.bins, "--bins")),
        ("bin_counts", _int_list(args.bin_counts, "--bin-counts")),
        ("num_bins", args.num_bins),
        ("padded", args.padded),
        ("micro_batch_tokens", args.micro_batch_tokens),
    ):
        if value is not None:
            raw[key] = list(value) if isinstance(value, tuple) else value
    if args.hidden_size is not None:
        check(args.hidden_size > 0, f"--hidden-size: must be positive, got {args.hidden_size}")
        raw["cost_quadratic"] = CostModel.for_hidden_size(args.hidden_size).quadratic
    return load_section(SamplerConfig, raw, "sampler")


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    for flag in ("world_size", "ranks_per_node", "micro_batch", "grad_accum", "steps", "max_seq_len"):
        check(getattr(args, flag) > 0, f"--{flag.replace('_', '-')}: must be positive, got {getattr(args, flag)}")
    check(
        args.world_size % args.ranks_per_node == 0,
        f"--world-size {args.world_size} is not a multiple of --ranks-per-node {args.ranks_per_node}",
    )
    if args.sequences:
        check(args.windows > 0, f"--windows: must be positive, got {args.windows}")
        check(args.step_time >= 0, f"--step-time: must not be negative, got {args.step_time}")
        return scale_main(args)
    cfg = sampler_config(args)
    rng = np.random.default_rng(args.seed)
    global_batch = args.world_size * args.micro_batch * args.grad_accum
    started = time.perf_counter()
    if args.mlperf_mix:
        corpus, source = mlperf_phase2_lengths((args.steps + 1) * global_batch, rng), "MLPerf phase-2 mix (synthetic)"
    elif args.lengths:
        corpus, source = read_lengths(args.lengths), args.lengths
    else:
        corpus, source = corpus_lengths(args.corpus, args.max_seq_len, args.tokenizer, args.cache_dir), args.corpus
    lengths = simulation_lengths(corpus, global_batch, args.steps, rng)
    p10, p50, p90 = np.percentile(corpus, [10, 50, 90])
    print(
        f"corpus: {source}: {len(corpus)} sequences, length mean {corpus.mean():.1f}, p10/p50/p90 "
        f"{p10:.0f}/{p50:.0f}/{p90:.0f}, max {corpus.max()}, {np.mean(corpus == corpus.max()):.1%} at the max"
    )
    drawn = " (lengths drawn from the corpus's mix)" if len(lengths) != len(corpus) else ""
    print(
        f"plan: {args.world_size} ranks ({args.world_size // args.ranks_per_node} nodes × {args.ranks_per_node}) × "
        f"micro-batch {args.micro_batch} × accumulation {args.grad_accum} = global batch {global_batch}; "
        f"{len(lengths)} sequences{drawn}"
    )
    cost = cfg.cost_model
    print(
        f"cost model: a·L + b·L² with a = {cost.linear:g}, b = {cost.quadratic:.4g}; padding to a multiple of "
        f"{cfg.pad_multiple}; stratified_node_balance balances the {'padded' if cfg.padded else 'unpadded'} cost"
    )
    results = evaluate(
        lengths,
        world_size=args.world_size,
        ranks_per_node=args.ranks_per_node,
        micro_batch=args.micro_batch,
        grad_accum=args.grad_accum,
        cfg=cfg,
        cost=cost,
        seed=args.seed,
        strategies=tuple(args.strategies),
        peers=PEERS if args.peers else (),
        peer_budget_s=args.peer_budget,
    )
    for name, r in results.items():
        if r.note:
            print(f"{name}: {r.note}")
    for name, r in results.items():
        if r.plan.bin_edges is not None:
            edges = r.plan.bin_edges.tolist()
            shown = edges if len(edges) <= 12 else f"{len(edges)} quantile bins, {edges[:4]} … {edges[-2:]}"
            print(f"bins of {name} (per {r.plan.stratum}): {shown}")
    steps = {r.plan.steps for r in results.values()}
    print(f"figures over {min(steps)}–{max(steps)} steps" if len(steps) > 1 else f"figures over {steps.pop()} steps")
    for line in format_table(results, global_batch):
        print(line)
    print(
        "step time: the busiest rank's work per step (mean over steps, per global batch of samples) relative to "
        "random with padded kernels; unpadded = kernels that skip padding (the packed strategies' micro-batches "
        "compute no padding there)"
    )
    if args.plot:
        plot(args.plot, corpus, results, source)
        print(f"plot written to {args.plot}")
    print(f"done in {time.perf_counter() - started:.1f} s")
    return 0
