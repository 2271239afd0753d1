"""BERT-base-shaped training step, Hugging Face padded vs ours unpadded: tokens/s and MFU, in fp32 and bf16.

    flock /tmp/ds_heavy.lock .venv/bin/python bench/mfu.py        # ~6 min on 2 AVX2 cores
    .venv/bin/python bench/mfu.py --sequences 8 --layers 2        # a quick look

One process, every available core as torch threads (on CUDA: the GPU). The batch is 16 sequences drawn (seed 0)
from the seq-128 mix of ``../shared/data/wiki_sample.jsonl`` built as pretraining builds it (MiniLM-L6's WordPiece
vocabulary; a uniform 20–128 mix when the shared data is absent), 15 % of the tokens masked. The step is forward +
backward of a randomly initialised ``BertForMaskedLM`` of BERT-base's shape (hidden 768, 12 heads, FFN 3072,
vocabulary 30,522; dropout 0.1, training mode), with

* **HF padded**: the stock model on the batch padded to its longest sequence (SDPA attention, the MLM head on
  every position, the loss over the masked ones), what ``Trainer`` runs;
* **ours unpadded**: ``ds_bertopt.model.unpadded.UnpaddedMLM`` on the same samples packed into one row (attention
  per sequence, the MLM head on the masked positions only).

bf16 is ``torch.autocast`` (fp32 weights) on both. **Model FLOPs** are what the batch needs on its real tokens,
the same figure for both contenders: ``3 × [layers × (2·T·(4h² + 2h·ffn) + 4h·ΣL²) + M·(2h² + 2h·vocab)]`` (forward
+ backward; T real tokens, L the sequence lengths, M masked tokens: the MLM objective needs the head there only).
**MFU** = model FLOPs / step time / the GEMM peak, the best ``torch.mm`` or ``F.linear`` rate of square matrices
(512–2048; to 4096 on CUDA) measured in the same run in the same precision. On a CPU without native bf16 (AVX2,
AVX512 without BF16) bf16 is emulated (its backward matmuls take a slow path: minutes per step): the bf16 rows
then run 1 of the 12 layers (``--bf16_layers``), one step without warm-up, and the line says so. Elsewhere, medians
of ``--repeats`` steps after one warm-up step, the contenders interleaved.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _cpu import cpu_kind  # noqa: E402
from bench._common import SUMMARY, say  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
BASE = dict(hidden=768, heads=12, ffn=3072, vocab=30522)


def native_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def seq128_mix(count: int, seed: int = 0) -> list[list[int]]:
    """``count`` training sequences (token ids) of wiki_sample at max_seq_length 128, as pretraining builds them."""
    rng = random.Random(seed)
    from ds_bertopt.model.local import default_model_dir

    corpus, model_dir = SHARED / "wiki_sample.jsonl", default_model_dir()
    if not corpus.is_file() or model_dir is None:
        return [[rng.randrange(1000, 30000) for _ in range(rng.randint(20, 128))] for _ in range(count)]
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
        return [built[i]["input_ids"] for i in rng.sample(range(len(built)), count)]


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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def gemm_peak(device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    """The best FLOP/s of ``torch.mm`` and ``F.linear`` (the op the model's layers run) on square matrices of 512 to
    4096 in ``dtype``: on CPUs without native bf16 the two take different kernels (``mm`` a slow one)."""
    import torch.nn.functional as F

    best = 0.0
    for n in (512, 1024, 2048, 4096) if device.type == "cuda" else (512, 1024, 2048):
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        for op in (torch.mm, F.linear):
            op(a, b)
            for _ in range(repeats):
                sync(device)
                start = time.perf_counter()
                op(a, b)
                sync(device)
                best = max(best, 2.0 * n**3 / (time.perf_counter() - start))
    return best


def step_times(step, device: torch.device, repeats: int, warmup: bool) -> list[float]:
    if warmup:
        step()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def measure(
    samples: list[dict], layers: int, dtype: torch.dtype, device: torch.device, repeats: int, warmup: bool
) -> dict:
    from transformers import BertConfig, BertForMaskedLM

    from ds_bertopt.data.collate import pack_sequences
    from ds_bertopt.model.unpadded import UnpaddedMLM

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=BASE["vocab"], hidden_size=BASE["hidden"], num_hidden_layers=layers,
        num_attention_heads=BASE["heads"], intermediate_size=BASE["ffn"], attn_implementation="sdpa",
    )  # fmt: skip
    stock = BertForMaskedLM(config).to(device).train()
    ours_model = BertForMaskedLM(config).to(device).train()
    ours = UnpaddedMLM(ours_model)
    longest = max(len(s["input_ids"]) for s in samples)
    padded = {k: torch.full((len(samples), longest), -100 if k == "labels" else 0) for k in ("input_ids", "labels")}
    padded["attention_mask"] = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        padded["input_ids"][row, :n] = torch.tensor(s["input_ids"])
        padded["labels"][row, :n] = torch.tensor(s["labels"])
        padded["attention_mask"][row, :n] = 1
    padded = {k: v.to(device) for k, v in padded.items()}
    packed = {k: v.to(device) if torch.is_tensor(v) else v for k, v in pack_sequences(samples).items()}
    ours.choose_attention(device, dtype)
    autocast = dict(device_type=device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)

    def hf_step():
        with torch.autocast(**autocast):
            loss = stock(**padded).loss
        loss.backward()
        stock.zero_grad(set_to_none=True)

    def our_step():
        with torch.autocast(**autocast):
            loss = ours(**packed).loss
        loss.backward()
        ours_model.zero_grad(set_to_none=True)

    lengths = [len(s["input_ids"]) for s in samples]
    masked = sum(label != -100 for s in samples for label in s["labels"])
    times = {"HF padded": [], "ours unpadded": []}
    for _ in range(repeats):  # interleaved rounds: drift on a shared machine hits both alike
        times["HF padded"] += step_times(hf_step, device, 1, warmup)
        times["ours unpadded"] += step_times(our_step, device, 1, warmup)
    return {
        "tokens": sum(lengths),
        "padded_tokens": len(lengths) * longest,
        "masked": masked,
        "flops": model_flops(lengths, masked, layers),
        "seconds": {k: statistics.median(v) for k, v in times.items()},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--layers", type=int, default=12, help="fp32 rows (BERT-base: 12)")
    parser.add_argument("--bf16_layers", type=int, default=None, help="bf16 rows (default: 12, or 1 when emulated)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--record-as", default="mfu", help="name of the recorded results (report section)")
    args = parser.parse_args(argv)
    from bench._common import record_results

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        from ds_bertopt.data.parallel import available_cores

        torch.set_num_threads(available_cores())
    emulated = not native_bf16(device)
    bf16_layers = args.bf16_layers or (1 if emulated else args.layers)
    slow = emulated and device.type == "cpu"  # emulated bf16: one step, no warm-up (minutes per step)
    samples = mask(seq128_mix(args.sequences))
    where = torch.cuda.get_device_name(0) if device.type == "cuda" else cpu_kind()
    say(f"{where}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    results, bars = {}, []
    for name, dtype, layers, repeats, warmup in (
        ("fp32", torch.float32, args.layers, args.repeats, True),
        ("bf16", torch.bfloat16, bf16_layers, 1 if slow else args.repeats, not slow),
    ):
        peak = gemm_peak(device, dtype, repeats=3)
        run = measure(samples, layers, dtype, device, repeats, warmup)
        results[name] = {**run, "gemm_peak": peak, "layers": layers}
        note = f", {layers} of BERT-base's 12 layers" + (" (bf16 emulated)" if emulated and name == "bf16" else "")
        note = note if layers != 12 else ""
        say(
            f"{name}: {args.sequences} sequences of the seq-128 mix, {run['tokens']} real tokens "
            f"({run['padded_tokens']} padded), {run['masked']} masked; GEMM peak {peak / 1e9:.1f} GFLOP/s{note}"
        )
        rates = {}
        for contender, seconds in run["seconds"].items():
            rates[contender] = run["tokens"] / seconds
            mfu = run["flops"] / seconds / peak
            results[name].setdefault("mfu", {})[contender] = mfu
            bars.append({"label": f"{name}, {contender}", "MFU": mfu})
            say(
                f"  {contender}: {rates[contender]:,.0f} tokens/s, MFU {mfu:.2f} ({seconds:.2f} s/step, median of "
                f"{repeats}{'' if warmup else ', no warm-up'})"
            )
        say(f"  {name} tokens/s, ours unpadded vs HF padded: {rates['ours unpadded'] / rates['HF padded']:.2f}x")
    printed = all(len(results[name]["mfu"]) == 2 for name in ("fp32", "bf16"))
    say(f"MFU printed for both precisions, both contenders: {'met' if printed else 'NOT met'}")
    record_results(
        args.record_as,
        {
            "device": where,
            "results": results,
            "summary": SUMMARY,
            "note": f"{args.sequences} sequences of the seq-128 mix, BERT-base shape, forward + backward, one process; "
            f"MFU = model FLOPs on real tokens / step time / the GEMM peak measured in the same run and precision",
            "figures": [
                {
                    "kind": "bars",
                    "title": "MFU, HF padded vs ours unpadded (BERT-base shape, seq-128 mix)",
                    "file": "mfu",
                    "unit": "model FLOPs / GEMM peak",
                    "stack": ["MFU"],
                    "series": bars,
                }
            ],
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
