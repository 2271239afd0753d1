"""BERT-base-shaped training step, Hugging Face padded vs ours unpadded (eager and compiled): tokens/s, MFU, and where
the step's time goes (GEMMs, attention, the rest), in fp32 and, on a CPU with native bf16 (or CUDA), in bf16.

    flock /tmp/ds_heavy.lock .venv/bin/python bench/mfu.py        # ~6 min on 2 AVX2 cores
    .venv/bin/python bench/mfu.py --sequences 8 --layers 2 --epoch-batches 20   # a quick look

One process, every core as torch threads (or the GPU). The batch: 16 sequences drawn (seed 0) from the seq-128 mix of
``../shared/data/wiki_sample.jsonl`` built as pretraining builds it (MiniLM-L6's vocabulary; a uniform 20–128 mix
without the shared data), 15 % of the tokens masked. The step: forward + backward of a random-init ``BertForMaskedLM``
of BERT-base's shape (dropout 0.1, training mode) as **HF padded** (the stock model, SDPA, on the batch padded to its
longest, the MLM head on every position: what ``Trainer`` runs), **ours unpadded** (``UnpaddedMLM`` on the samples
packed into one row: attention per sequence, the MLM head on the masked positions only), **ours unpadded, fused
dropout** (``model.fused_dropout``: dropout from packed random bits, fused with the residual add) and **ours unpadded,
compiled** (``model.compile`` too, where this checkout has it; compared round by round with the fused eager one).

bf16 is ``torch.autocast`` on all; without native bf16 (emulated: minutes per step) only fp32 is measured. **Model
FLOPs** (the same for every contender): ``3 × [layers × (2·T·(4h² + 2h·ffn) + 4h·ΣL²) + M·(2h² + 2h·vocab)]`` (T real
tokens, L the sequence lengths, M masked tokens). **MFU** = model FLOPs / step time / the GEMM peak measured in the
same run and precision (``bench._common.gemm_peak``). Medians of ``--repeats`` interleaved steps after a warm-up step
(where the compiled contender compiles).

**The split** (``ds_bertopt.testing.step_split``): ``--repeats`` more steps of each under ``torch.profiler``, each
op's self time in GEMMs (outside attention), attention (inside an attention call and its backward) or the rest
(dropout, LayerNorm, GELU, adds, copies, the loss, and host time: the wall time minus the other two; Inductor's fused
kernels are no profiler events, so the compiled step's are there). **Non-GEMM time per real token** is attention +
the rest over the real tokens; ``--baseline NAME`` compares it with the recorded run ``bench/report/raw/NAME.json``
(``mfu_baseline``: main before issue 40, on this CPU).

**Recompiles over an epoch**: the compiled model (tiny width, the same code) trains on every micro-batch of one
shuffled epoch of the seq-128 mix; the line counts the graphs compiled and the padding the packed length costs.
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench._common import cpu_kind, figure, gemm_peak, interleaved, padded_batch, record, say, status, sync

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
RAW = Path(__file__).resolve().parent / "report" / "raw"
BASE = dict(hidden=768, heads=12, ffn=3072, vocab=30522)
HF, OURS, FUSED = "HF padded", "ours unpadded", "ours unpadded, fused dropout"
COMPILED = "ours unpadded, compiled"
TARGETS = {"mfu_fp32": 0.85, "non_gemm_vs_baseline": 0.5, "recompiles": 8, "compiled_bf16": 1.15}
BF16_MFU_TARGETS = {"AVX512-BF16": 0.80, "AMX": 0.45}


def seq128_sequences(seed: int = 0) -> list[list[int]]:
    """Every training sequence (token ids) of wiki_sample at max_seq_length 128, as pretraining builds them (a uniform
    20–128 stand-in of 4,000 sequences without the shared data)."""
    rng = random.Random(seed)
    from ds_bertopt.model.local import default_model_dir

    corpus, model_dir = SHARED / "wiki_sample.jsonl", default_model_dir()
    if not corpus.is_file() or model_dir is None:
        return [[rng.randrange(1000, 30000) for _ in range(rng.randint(20, 128))] for _ in range(4000)]
    import tempfile

    import datasets

    from ds_bertopt.data.config import DataConfig
    from ds_bertopt.data.corpus import load_documents
    from ds_bertopt.data.pipeline import build_sequences
    from ds_bertopt.data.tokenizer import load_tokenizer

    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as cache:
        documents = load_documents(DataConfig(train_files=(str(corpus),)), cache)
        built = build_sequences(
            documents, load_tokenizer(model_dir), max_seq_length=128, short_seq_prob=0.1, nsp=False, seed=1234,
            cache_dir=cache, split="train",
        )  # fmt: skip
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


def model_flops(lengths: list[int], masked: int, layers: int) -> float:
    h, ffn, vocab = BASE["hidden"], BASE["ffn"], BASE["vocab"]
    tokens = sum(lengths)
    encoder = layers * (2 * tokens * (4 * h * h + 2 * h * ffn) + 4 * h * sum(n * n for n in lengths))
    return 3.0 * (encoder + masked * (2 * h * h + 2 * h * vocab))


def compile_supported() -> bool:
    from ds_bertopt.model.unpadded import UnpaddedMLM

    return "compile" in inspect.signature(UnpaddedMLM).parameters


def bert(layers: int, device: torch.device, width: dict = BASE):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=width["vocab"], hidden_size=width["hidden"], num_hidden_layers=layers,
        num_attention_heads=width["heads"], intermediate_size=width["ffn"], attn_implementation="sdpa",
    )  # fmt: skip
    return BertForMaskedLM(config).to(device).train()


def contenders(samples: list[dict], layers: int, dtype: torch.dtype, device: torch.device) -> dict:
    """name -> one training step (forward + backward, gradients dropped)."""
    from ds_bertopt.data.collate import pack_sequences
    from ds_bertopt.model.unpadded import UnpaddedMLM

    autocast = dict(device_type=device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    padded = padded_batch(samples, device)
    packed = {k: v.to(device) if torch.is_tensor(v) else v for k, v in pack_sequences(samples).items()}

    def step_of(model, batch):
        def step():
            with torch.autocast(**autocast):
                loss = model(**batch).loss
            loss.backward()
            model.zero_grad(set_to_none=True)

        return step

    steps = {HF: step_of(bert(layers, device), padded)}
    options = {OURS: {}, FUSED: {"fused_dropout": True}}
    if compile_supported():
        options[COMPILED] = {"fused_dropout": True, "compile": True}
    for name, kwargs in options.items():
        model = UnpaddedMLM(bert(layers, device), **kwargs)
        model.choose_attention(device, dtype)
        steps[name] = step_of(model, packed)
    return steps


def median_splits(steps: dict, device: torch.device, repeats: int) -> dict:
    """Each contender's split (``split_step`` of a profiled step), part by part the median of ``repeats`` profiled
    steps (interleaved rounds)."""
    from torch.profiler import ProfilerActivity, profile

    from ds_bertopt.testing.step_split import split_step

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    splits: dict[str, list[dict]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            with profile(activities=activities) as prof:
                sync(device)
                start = time.perf_counter()
                step()
                sync(device)
                wall = time.perf_counter() - start
            splits[name].append(split_step(prof.events(), wall_s=wall, device=device.type == "cuda"))
    return {name: {part: statistics.median(s[part] for s in runs) for part in runs[0]} for name, runs in splits.items()}


def measure(samples: list[dict], layers: int, dtype: torch.dtype, device: torch.device, repeats: int) -> dict:
    steps = contenders(samples, layers, dtype, device)
    warm = {}
    for name, step in steps.items():
        start = time.perf_counter()
        step()  # warm-up; the compiled contender compiles here
        warm[name] = time.perf_counter() - start

    def synced(step):
        return lambda: (step(), sync(device))  # the step ends when the device is done (a no-op on a CPU)

    sync(device)
    times = interleaved({name: synced(step) for name, step in steps.items()}, repeats=repeats, warmup=0)
    lengths = [len(s["input_ids"]) for s in samples]
    masked = sum(label != -100 for s in samples for label in s["labels"])
    return {
        "tokens": sum(lengths),
        "padded_tokens": len(lengths) * max(lengths),
        "masked": masked,
        "flops": model_flops(lengths, masked, layers),
        "seconds": {k: statistics.median(v) for k, v in times.items()},
        # round by round: the machine's drift between rounds (8-10 % here) is larger than what compiling changes
        "compiled_speedup": statistics.median(f / c for f, c in zip(times[FUSED], times[COMPILED]))
        if COMPILED in times
        else None,
        "first_step_s": warm,
        "split": median_splits(steps, device, repeats),
    }


def epoch_recompiles(sequences: list[list[int]], per_batch: int, limit: int) -> dict:
    """Graphs compiled while the compiled unpadded model (tiny, same code) trains on every micro-batch of an epoch."""
    import torch._dynamo

    from ds_bertopt.data.collate import pack_sequences
    from ds_bertopt.model.unpadded import UnpaddedMLM

    order = list(range(len(sequences)))
    random.Random(2).shuffle(order)
    batches = [order[i : i + per_batch] for i in range(0, len(order), per_batch)][: limit or None]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = UnpaddedMLM(
        bert(2, torch.device("cpu"), dict(hidden=64, heads=4, ffn=128, vocab=BASE["vocab"])), compile=True
    )
    lengths, real, computed, start = set(), 0, 0, time.perf_counter()
    for index in batches:
        packed = pack_sequences(mask([sequences[i] for i in index], seed=len(lengths)))
        lengths.add(int(packed["input_ids"].numel()))
        real += sum(len(sequences[i]) for i in index)
        computed += int(packed["input_ids"].numel())  # the rows every compiled layer ran on
        model(**packed).loss.backward()
        model.zero_grad(set_to_none=True)
    graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return {
        "micro_batches": len(batches),
        "distinct_lengths": len(lengths),
        "graphs": graphs,
        "recompiles": max(0, graphs - 1),
        "padding_tokens": computed - real,
        "padding_share": (computed - real) / computed,
        "seconds": time.perf_counter() - start,
    }


def baseline_non_gemm(name: str):
    """(µs per real token, its CPU, its layers) of the recorded run ``name``'s eager unpadded fp32 step, or None."""
    path = RAW / f"{name}.json"
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    fp32 = record["results"]["fp32"]
    return fp32["non_gemm_us_per_token"][OURS], record["device"], fp32.get("layers", 12)


def report_precision(name: str, run: dict, peak: float, repeats: int, note: str, results: dict, bars: list) -> None:
    say(
        f"{name}: {run['sequences']} sequences of the seq-128 mix, {run['tokens']} real tokens "
        f"({run['padded_tokens']} padded), {run['masked']} masked; GEMM peak {peak / 1e9:.1f} GFLOP/s{note}"
    )
    rates = {}
    for contender, seconds in run["seconds"].items():
        rates[contender] = run["tokens"] / seconds
        mfu = run["flops"] / seconds / peak
        split = run["split"][contender]
        non_gemm = (split["attention"] + split["rest"]) / run["tokens"] * 1e6
        results.setdefault("mfu", {})[contender] = mfu
        results.setdefault("non_gemm_us_per_token", {})[contender] = non_gemm
        bars.append({"label": f"{name}, {contender}", "MFU": mfu})
        say(
            f"  {contender}: {rates[contender]:,.0f} tokens/s, MFU {mfu:.2f} ({seconds:.2f} s/step, median of "
            f"{repeats}; first step {run['first_step_s'][contender]:.1f} s)"
        )
        say(
            f"    profiled step (medians of {repeats}): {split['total']:.2f} s; GEMMs {split['gemm']:.2f} s, "
            f"attention {split['attention']:.2f} s, rest {split['rest']:.2f} s; non-GEMM {non_gemm:.0f} us/real token"
        )
    say(f"  {name} tokens/s, ours unpadded vs HF padded: {rates[OURS] / rates[HF]:.2f}x (median of {repeats})")
    say(f"  {name} tokens/s, fused dropout vs ours unpadded: {rates[FUSED] / rates[OURS]:.2f}x (median of {repeats})")


def compiled_line(precision: str, ratio: float, repeats: int, target: float, why: str = "") -> str:
    return (
        f"{precision} tokens/s, compiled vs eager (both fused dropout): {ratio:.3f}x (median of {repeats} paired "
        f"rounds) (target >= {target:.2f}x{why}: {status(ratio >= target)})"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--layers", type=int, default=12, help="BERT-base: 12")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", default="mfu_baseline", help="recorded run whose non-GEMM time is the baseline")
    parser.add_argument("--epoch-batches", type=int, default=0, help="cap the epoch's micro-batches (0: all)")
    parser.add_argument("--record-as", default="mfu", help="name of the recorded results (report section)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        from ds_bertopt.data.parallel import available_cores

        torch.set_num_threads(available_cores())
    where = torch.cuda.get_device_name(0) if device.type == "cuda" else cpu_kind()
    sequences = seq128_sequences()
    samples = mask([sequences[i] for i in random.Random(0).sample(range(len(sequences)), args.sequences)])
    say(f"{where}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    native_bf16 = device.type == "cuda" or "(native bf16)" in where
    precisions = [("fp32", torch.float32)] + ([("bf16", torch.bfloat16)] if native_bf16 else [])
    results, bars = {}, []
    for name, dtype in precisions:
        peak = gemm_peak(device, dtype, repeats=3)
        run = {**measure(samples, args.layers, dtype, device, args.repeats), "sequences": args.sequences}
        results[name] = {**run, "gemm_peak": peak, "layers": args.layers}
        note = f", {args.layers} of BERT-base's 12 layers" if args.layers != 12 else ""
        report_precision(name, run, peak, args.repeats, note, results[name], bars)

    fp32 = results["fp32"]
    best = COMPILED if COMPILED in fp32["mfu"] else FUSED
    mfu = fp32["mfu"][best]
    say(f"fp32 MFU, {best}: {mfu:.2f} (target >= {TARGETS['mfu_fp32']}: {status(mfu >= TARGETS['mfu_fp32'])})")
    non_gemm = fp32["non_gemm_us_per_token"]
    say(
        f"non-GEMM time per real token, fp32, this run: {FUSED} {non_gemm[FUSED]:.0f} vs {OURS} {non_gemm[OURS]:.0f} "
        f"us = {non_gemm[FUSED] / non_gemm[OURS]:.2f}x (median of {args.repeats})"
    )
    recorded = baseline_non_gemm(args.baseline) if args.baseline != args.record_as else None
    if recorded is None:
        say(f"non-GEMM time per real token, fp32, {OURS} (eager): {fp32['non_gemm_us_per_token'][OURS]:.0f} us "
            f"(no recorded baseline {args.baseline!r}: this run is one)")  # fmt: skip
    else:
        base_us, base_where, base_layers = recorded
        same = base_where == where and base_layers == args.layers  # the LM head's share differs with the depth
        for contender in (c for c in (FUSED, COMPILED) if c in non_gemm):
            ratio = non_gemm[contender] / base_us
            verdict = status(same and ratio <= TARGETS["non_gemm_vs_baseline"])
            verdict += "" if base_where == where else ", other CPU"
            verdict += "" if base_layers == args.layers else f", {args.layers} layers vs the baseline's {base_layers}"
            say(
                f"non-GEMM time per real token, fp32, {contender} vs recorded baseline {args.baseline} "
                f"({base_where}): {non_gemm[contender]:.0f} vs {base_us:.0f} us = {ratio:.2f}x (median of "
                f"{args.repeats}) (target <= {TARGETS['non_gemm_vs_baseline']}x: {verdict})"
            )
    if COMPILED in fp32["seconds"]:
        say(compiled_line("fp32", fp32["compiled_speedup"], args.repeats, 1.0, ", never slower"))
        epoch = epoch_recompiles(sequences, args.sequences, args.epoch_batches)
        results["epoch"] = epoch
        say(
            f"recompiles over an epoch of the seq-128 mix ({epoch['micro_batches']} micro-batches of "
            f"{args.sequences}, {epoch['distinct_lengths']} distinct packed lengths; dynamic shapes, padding "
            f"{epoch['padding_tokens']} tokens = {epoch['padding_share']:.1%}): {epoch['recompiles']} "
            f"({epoch['graphs']} graphs compiled) "
            f"(target <= {TARGETS['recompiles']}: {status(epoch['recompiles'] <= TARGETS['recompiles'])})"
        )
    else:
        say("model.compile: not in this checkout (compiled contender, recompiles: not measured)")
    if "bf16" in results:
        bf16 = results["bf16"]
        kind = "AMX" if "AMX" in where else "AVX512-BF16" if "AVX512-BF16" in where else None
        mfu = bf16["mfu"][best]
        if kind is not None:
            target = BF16_MFU_TARGETS[kind]
            say(f"bf16 MFU, {best} on {kind}: {mfu:.2f} (target >= {target}: {status(mfu >= target)})")
        else:
            say(f"bf16 MFU, {best}: {mfu:.2f} (targets are for AVX512-BF16 / AMX CPUs: not judged here)")
        if COMPILED in bf16["seconds"]:
            say(compiled_line("bf16", bf16["compiled_speedup"], args.repeats, TARGETS["compiled_bf16"]))
    else:
        say(
            "bf16: not measured on this CPU (no native bf16: emulated, minutes per step); its targets, MFU >= 0.80 "
            "on AVX512-BF16 and >= 0.45 on AMX, compiled >= 1.15x eager: not measured"
        )
    title = "MFU, HF padded vs ours unpadded (BERT-base shape, seq-128 mix)"
    figure("bars", "mfu", title, bars, unit="model FLOPs / GEMM peak", stack=["MFU"])
    parts = {"GEMMs": "gemm", "attention": "attention", "rest": "rest"}
    split = [{"label": c, **{key: s[part] for key, part in parts.items()}} for c, s in fp32["split"].items()]
    title = "Where a step's time goes, fp32 (profiled steps, medians, seconds)"
    figure("bars", "split", title, split, unit="seconds", stack=list(parts))
    record(
        args.record_as,
        f"{args.sequences} sequences of the seq-128 mix, BERT-base shape, forward + backward, one process; "
        "MFU = model FLOPs on real tokens / step time / the GEMM peak measured in the same run and precision; "
        "split: the medians of profiled steps per contender (torch.profiler op self times)",
        device=where,
        results=results,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
