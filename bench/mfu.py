"""BERT-base-shaped training step, Hugging Face padded vs ours unpadded (eager and compiled): tokens/s, MFU, and where
the step's time goes (GEMMs, attention, the rest), in fp32 and, with native bf16 (a CPU's or CUDA), in bf16 too.

    flock /tmp/ds_heavy.lock .venv/bin/python bench/mfu.py        # ~6 min on 2 AVX2 cores
    .venv/bin/python bench/mfu.py --sequences 8 --layers 2 --epoch-batches 20   # a quick look

16 sequences of wiki_sample's seq-128 mix as pretraining builds it (uniform 20–128 without the shared data), 15 %
masked; a random-init BERT-base-shaped ``BertForMaskedLM``, every core: **HF padded** (SDPA, the MLM head on every
position: what ``Trainer`` runs), **ours unpadded** (``UnpaddedMLM``: packed, the head on masked positions only),
**fused dropout** and **compiled** (``model.fused_dropout``; ``model.compile`` too, compared round by round).
bf16 is DeepSpeed's bf16 step, what the launcher runs: parameters cast to bf16 (``DeepSpeedEngine.
_configure_distributed_model``), no autocast; autocast over fp32 weights (``Trainer``'s bf16 without DeepSpeed) adds a
cast of every weight in each forward and measured 0.3 s more per step on a Zen 5 AVX512-BF16 CPU.
**MFU** = model FLOPs (``3 × [layers × (2·T·(4h² + 2h·ffn) + 4h·ΣL²) + M·(2h² + 2h·vocab)]``, T real tokens, L the
lengths, M masked) / step time / the GEMM peak measured in the same run and precision (the best rate of ``mm`` and
``F.linear`` probes before and after the steps and of the steps' own GEMMs in the profile); medians of ``--repeats``
interleaved steps after a warm-up. **The split** (``ds_bertopt.testing.step_split``) of ``--repeats`` profiled steps:
GEMMs, attention, the rest (host time and Inductor's fused kernels included); its non-GEMM time per real token is
compared with the recorded ``--baseline``. **Recompiles**: the compiled model (tiny width) over one shuffled epoch.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import datasets
import torch
import torch._dynamo
from torch.profiler import ProfilerActivity, profile
from transformers import BertConfig, BertForMaskedLM

from bench._common import bert_sizes, cpu_kind, figure, gemm_peak, interleaved, median, padded_batch, record, say
from bench._common import bar_figure, status, sync, add_record_as
from bench._report import BASELINE_PREFIX
from ds_bertopt.data.collate import pack_sequences
from ds_bertopt.data.config import DataConfig
from ds_bertopt.data.corpus import load_documents
from ds_bertopt.data.parallel import available_cores
from ds_bertopt.data.pipeline import build_sequences
from ds_bertopt.data.tokenizer import load_tokenizer
from ds_bertopt.model.local import default_model_dir
from ds_bertopt.model.unpadded import UnpaddedMLM
from ds_bertopt.testing.step_split import split_step

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
RAW = Path(__file__).resolve().parent / "report" / "raw"
BASE = bert_sizes(768, 12, 12, 3072, vocab_size=30522)
HF, OURS, FUSED, COMPILED = "HF padded", "ours unpadded", "ours unpadded, fused dropout", "ours unpadded, compiled"
TARGETS = {"mfu_fp32": 0.85, "non_gemm_vs_baseline": 0.5, "recompiles": 8, "compiled_bf16": 1.15}
BF16_MFU_TARGETS = {"AVX512-BF16": 0.80, "AMX": 0.45}


def seq128_sequences(seed: int = 0) -> list[list[int]]:
    """wiki_sample's training sequences at max_seq_length 128 as pretraining builds them (else 4,000 of 20–128)."""
    rng = random.Random(seed)
    corpus, model_dir = SHARED / "wiki_sample.jsonl", default_model_dir()
    if not corpus.is_file() or model_dir is None:
        return [[rng.randrange(1000, 30000) for _ in range(rng.randint(20, 128))] for _ in range(4000)]
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as cache:
        documents = load_documents(DataConfig(train_files=(str(corpus),)), cache)
        options = dict(max_seq_length=128, short_seq_prob=0.1, nsp=False, seed=1234, cache_dir=cache, split="train")
        built = build_sequences(documents, load_tokenizer(model_dir), **options)
        return [list(row) for row in built["input_ids"]]


def mask(sequences: list[list[int]], seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    samples = []
    for ids in sequences:
        labels = [t if 0 < i < len(ids) - 1 and rng.random() < 0.15 else -100 for i, t in enumerate(ids)]
        if all(label == -100 for label in labels):
            labels[1] = ids[1]
        masked = [103 if label != -100 else t for t, label in zip(ids, labels)]
        samples.append({"input_ids": masked, "token_type_ids": [0] * len(ids), "labels": labels})
    return samples


def bert(layers: int, device: torch.device, sizes: dict = BASE):
    torch.manual_seed(0)
    config = BertConfig(**{**sizes, "num_hidden_layers": layers}, attn_implementation="sdpa")
    return BertForMaskedLM(config).to(device).train()


def measure(samples: list[dict], layers: int, dtype: torch.dtype, device: torch.device, repeats: int) -> dict:
    """The contenders' training steps (forward + backward, gradients dropped): medians of ``repeats`` interleaved
    steps, then of ``repeats`` profiled steps' splits."""
    padded = padded_batch(samples, device)
    packed = {k: v.to(device) if torch.is_tensor(v) else v for k, v in pack_sequences(samples).items()}

    def train_step(model, batch):
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)

    def timed(step) -> float:
        """``step``'s seconds, from and to an idle device (``sync``: a no-op on a CPU)."""
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        return time.perf_counter() - start

    steps = {HF: functools.partial(train_step, bert(layers, device).to(dtype), padded)}
    options = {OURS: {}, FUSED: {"fused_dropout": True}, COMPILED: {"fused_dropout": True, "compile": True}}
    for name, kwargs in options.items():
        model = UnpaddedMLM(bert(layers, device).to(dtype), **kwargs)
        model.choose_attention(device, dtype)
        steps[name] = functools.partial(train_step, model, packed)
    warm = {name: timed(step) for name, step in steps.items()}  # warm-up; the compiled contender compiles here
    times = interleaved({n: functools.partial(timed, s) for n, s in steps.items()}, repeats=repeats, warmup=0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    splits: dict[str, list[dict]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            with profile(activities=activities) as prof:
                wall = timed(step)
            splits[name].append(split_step(prof.events(), wall_s=wall, device=device.type == "cuda"))
    split = {n: {part: median(s[part] for s in runs) for part in runs[0]} for n, runs in splits.items()}
    # round by round: the machine's drift between rounds (8-10 % here) is larger than what compiling changes
    speedup = median(f / c for f, c in zip(times[FUSED], times[COMPILED]))
    lengths = [len(s["input_ids"]) for s in samples]
    masked = sum(label != -100 for s in samples for label in s["labels"])
    sizes = {"tokens": sum(lengths), "padded_tokens": len(lengths) * max(lengths), "masked": masked}
    h, ffn, vocab = BASE["hidden_size"], BASE["intermediate_size"], BASE["vocab_size"]  # model FLOPs: the docstring's
    gemm_flops = 3.0 * (layers * 2 * sum(lengths) * (4 * h * h + 2 * h * ffn) + masked * (2 * h * h + 2 * h * vocab))
    flops = gemm_flops + 3.0 * layers * 4 * h * sum(n * n for n in lengths)  # + attention's score and value products
    # the rate the eager unpadded contenders' GEMMs reached (HF's run on padded tokens: other FLOPs; Inductor's
    # kernels are named otherwise)
    reached = max(gemm_flops / split[name]["gemm"] for name in (OURS, FUSED))
    seconds = {k: median(v) for k, v in times.items()}
    timing = {"seconds": seconds, "compiled_speedup": speedup, "first_step_s": warm, "split": split}
    return {**sizes, "flops": flops, "gemm_flops": gemm_flops, "gemm_rate_reached": reached, **timing}


def epoch_recompiles(sequences: list[list[int]], per_batch: int, limit: int) -> dict:
    """Graphs compiled while the compiled unpadded model (tiny, same code) trains on every micro-batch of an epoch."""
    order = list(range(len(sequences)))
    random.Random(2).shuffle(order)
    batches = [order[i : i + per_batch] for i in range(0, len(order), per_batch)][: limit or None]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = UnpaddedMLM(bert(2, torch.device("cpu"), bert_sizes(64, 2, 4, 128, vocab_size=30522)), compile=True)
    lengths, real, computed, start = set(), 0, 0, time.perf_counter()
    for index in batches:
        packed = pack_sequences(mask([sequences[i] for i in index], seed=len(lengths)))
        lengths.add(int(packed["input_ids"].numel()))
        real += sum(len(sequences[i]) for i in index)
        computed += int(packed["input_ids"].numel())  # the rows every compiled layer ran on
        model(**packed).loss.backward()
        model.zero_grad(set_to_none=True)
    graphs, padding = int(torch._dynamo.utils.counters["stats"]["unique_graphs"]), computed - real
    counts = {"micro_batches": len(batches), "distinct_lengths": len(lengths), "graphs": graphs}
    padded = {"padding_tokens": padding, "padding_share": padding / computed}
    return {**counts, "recompiles": max(0, graphs - 1), **padded, "seconds": time.perf_counter() - start}


def compiled_line(precision: str, ratio: float, repeats: int, target: float, why: str = "") -> str:
    return (
        f"{precision} tokens/s, compiled vs eager (both fused dropout): {ratio:.3f}x (median of {repeats} paired "
        f"rounds) (target >= {target:.2f}x{why}: {status(ratio >= target)})"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--layers", type=int, default=12, help="BERT-base: 12")
    parser.add_argument("--repeats", type=int, default=3)
    what = "recorded run whose non-GEMM time is the baseline (default: the mfu_baseline* record of this CPU kind)"
    parser.add_argument("--baseline", help=what)
    parser.add_argument("--epoch-batches", type=int, default=0, help="cap the epoch's micro-batches (0: all)")
    add_record_as(parser, "mfu")
    args = parser.parse_args(argv)
    if args.baseline not in (None, args.record_as) and not (RAW / f"{args.baseline}.json").is_file():
        parser.error(f"--baseline {args.baseline}: no record {RAW / args.baseline}.json")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(available_cores())
    where = torch.cuda.get_device_name(0) if device.type == "cuda" else cpu_kind()
    sequences = seq128_sequences()
    samples = mask([sequences[i] for i in random.Random(0).sample(range(len(sequences)), args.sequences)])
    say(f"{where}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    native_bf16 = device.type == "cuda" or "(native bf16)" in where
    precisions = [("fp32", torch.float32)] + ([("bf16", torch.bfloat16)] if native_bf16 else [])
    results, bars = {}, {}
    note = f", {args.layers} of BERT-base's 12 layers" if args.layers != 12 else ""
    for name, dtype in precisions:
        # a probe can land on a slow spell of a shared machine (bf16 here once read 222 GFLOP/s between probes of
        # 430): the peak is the best rate seen, the probes before and after the steps and the steps' own GEMMs
        probes = {"probe before": gemm_peak(device, dtype, repeats=3)}
        run = {**measure(samples, args.layers, dtype, device, args.repeats), "sequences": args.sequences}
        probes["probe after"], probes["the step's GEMMs"] = gemm_peak(device, dtype, 3), run["gemm_rate_reached"]
        peak = max(probes.values())
        run = results[name] = {**run, "gemm_peak": peak, "gemm_peak_probes": probes, "layers": args.layers}
        run.update(mfu={}, non_gemm_us_per_token={})
        tokens = f"{run['tokens']} real tokens ({run['padded_tokens']} padded), {run['masked']} masked"
        seen = ", ".join(f"{what} {rate / 1e9:.0f}" for what, rate in probes.items())
        say(
            f"{name}: {args.sequences} sequences of the seq-128 mix, {tokens}; GEMM peak {peak / 1e9:.1f} GFLOP/s "
            f"(best of {seen}){note}"
        )
        rates = {contender: run["tokens"] / seconds for contender, seconds in run["seconds"].items()}
        for contender, seconds in run["seconds"].items():
            mfu = run["mfu"][contender] = run["flops"] / seconds / peak
            gemm, attention, rest, total = (run["split"][contender][k] for k in ("gemm", "attention", "rest", "total"))
            non_gemm = run["non_gemm_us_per_token"][contender] = (attention + rest) / run["tokens"] * 1e6
            bars[f"{name}, {contender}"] = mfu
            timing = f"{seconds:.2f} s/step, median of {args.repeats}; first step {run['first_step_s'][contender]:.1f}"
            say(f"  {contender}: {rates[contender]:,.0f} tokens/s, MFU {mfu:.2f} ({timing} s)")
            say(
                f"    profiled step (medians of {args.repeats}): {total:.2f} s; GEMMs {gemm:.2f} s, "
                f"attention {attention:.2f} s, rest {rest:.2f} s; non-GEMM {non_gemm:.0f} us/real token"
            )
        for what, a, b in (("ours unpadded vs HF padded", OURS, HF), ("fused dropout vs ours unpadded", FUSED, OURS)):
            say(f"  {name} tokens/s, {what}: {rates[a] / rates[b]:.2f}x (median of {args.repeats})")
    fp32 = results["fp32"]
    mfu = fp32["mfu"][COMPILED]
    say(f"fp32 MFU, {COMPILED}: {mfu:.2f} (target >= {TARGETS['mfu_fp32']}: {status(mfu >= TARGETS['mfu_fp32'])})")
    non_gemm = fp32["non_gemm_us_per_token"]
    pair = f"{FUSED} {non_gemm[FUSED]:.0f} vs {OURS} {non_gemm[OURS]:.0f} us = {non_gemm[FUSED] / non_gemm[OURS]:.2f}x"
    say(f"non-GEMM time per real token, fp32, this run: {pair} (median of {args.repeats})")
    if args.baseline is None:  # the step before issue 40's work, recorded on this kind of CPU where it was
        mine = (
            p.stem for p in sorted(RAW.glob(f"{BASELINE_PREFIX}*.json")) if json.loads(p.read_text())["device"] == where
        )
        args.baseline = next(mine, BASELINE_PREFIX)
    baseline = RAW / f"{args.baseline}.json"  # its eager unpadded fp32 step
    if args.baseline == args.record_as or not baseline.is_file():
        say(f"non-GEMM time per real token, fp32, {OURS} (eager): {non_gemm[OURS]:.0f} us (no recorded baseline "
            f"{args.baseline!r}: this run is one)")  # fmt: skip
    else:
        recorded = json.loads(baseline.read_text())
        base_us, base_where = recorded["results"]["fp32"]["non_gemm_us_per_token"][OURS], recorded["device"]
        base_layers = recorded["results"]["fp32"].get("layers", 12)  # the LM head's share differs with the depth
        caveats = "" if base_where == where else ", other CPU"
        caveats += "" if base_layers == args.layers else f", {args.layers} layers vs the baseline's {base_layers}"
        for contender in (FUSED, COMPILED):
            ratio = non_gemm[contender] / base_us
            verdict = status(not caveats and ratio <= TARGETS["non_gemm_vs_baseline"]) + caveats
            say(
                f"non-GEMM time per real token, fp32, {contender} vs recorded baseline {args.baseline} "
                f"({base_where}): {non_gemm[contender]:.0f} vs {base_us:.0f} us = {ratio:.2f}x (median of "
                f"{args.repeats}) (target <= {TARGETS['non_gemm_vs_baseline']}x: {verdict})"
            )
    say(compiled_line("fp32", fp32["compiled_speedup"], args.repeats, 1.0, ", never slower"))
    epoch = results["epoch"] = epoch_recompiles(sequences, args.sequences, args.epoch_batches)
    say(
        f"recompiles over an epoch of the seq-128 mix ({epoch['micro_batches']} micro-batches of "
        f"{args.sequences}, {epoch['distinct_lengths']} distinct packed lengths; dynamic shapes, padding "
        f"{epoch['padding_tokens']} tokens = {epoch['padding_share']:.1%}): {epoch['recompiles']} "
        f"({epoch['graphs']} graphs compiled) "
        f"(target <= {TARGETS['recompiles']}: {status(epoch['recompiles'] <= TARGETS['recompiles'])})"
    )
    if "bf16" in results:
        bf16, kind = results["bf16"], next((k for k in BF16_MFU_TARGETS if k in where), None)  # cpu_kind names one
        mfu, target = bf16["mfu"][COMPILED], BF16_MFU_TARGETS.get(kind)
        if kind:
            say(f"bf16 MFU, {COMPILED} on {kind}: {mfu:.2f} (target >= {target}: {status(mfu >= target)})")
        else:
            say(f"bf16 MFU, {COMPILED}: {mfu:.2f} (targets are for AVX512-BF16 / AMX CPUs: not judged here)")
        say(compiled_line("bf16", bf16["compiled_speedup"], args.repeats, TARGETS["compiled_bf16"]))
    else:
        say(
            "bf16: not measured on this CPU (no native bf16: emulated, minutes per step); its targets, MFU >= 0.80 "
            "on AVX512-BF16 and >= 0.45 on AMX, compiled >= 1.15x eager: not measured"
        )
    title = "MFU, HF padded vs ours unpadded (BERT-base shape, seq-128 mix)"
    bar_figure("mfu", title, "MFU", bars, "model FLOPs / GEMM peak")
    parts = {"GEMMs": "gemm", "attention": "attention", "rest": "rest"}
    split = [{"label": c, **{key: s[part] for key, part in parts.items()}} for c, s in fp32["split"].items()]
    title = "Where a step's time goes, fp32 (profiled steps, medians, seconds)"
    figure("bars", "split", title, split, unit="seconds", stack=list(parts))
    what = f"{args.sequences} sequences of the seq-128 mix, BERT-base shape, forward + backward, one process"
    method = "MFU = model FLOPs on real tokens / step time / the GEMM peak measured in the same run and precision"
    split_of = "split: the medians of profiled steps per contender (torch.profiler op self times)"
    record(args.record_as, f"{what}; {method}; {split_of}", device=where, results=results)


if __name__ == "__main__":
    sys.exit(main())
