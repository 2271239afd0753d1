"""Fine-tuning tasks, ours unpadded vs transformers' ``Trainer`` padded: BoolQ (sentence pairs), Twitter NER,
SQuAD-style QA. MiniLM-L6, 2 ranks (the ``deepspeed`` launcher, one thread each), fp32, ZeRO 0 (``--zero``).

    flock /tmp/ds_heavy.lock .venv/bin/python bench/finetune_tasks.py            # full: about 2 hours on 2 AVX2 cores
    .venv/bin/python bench/finetune_tasks.py --quick                              # subsets: about 10 minutes

Every contender is ``examples/run_glue.py`` / ``run_ner.py`` / ``run_qa.py`` run by ``bench/finetune_tasks_run.py``:
**ours** the script as written (``BertOptTrainer``, ``"bertopt": {"model": {"unpadded": true}, "sampler":
{"strategy": "packed_node_balance"}}``), **HF** the same script with ``Trainer`` (dynamic padding for BoolQ and NER,
``pad_to_max_length`` for QA; ``HF group_by_length``: ``train_sampling_strategy="group_by_length"``). Same data,
hyper-parameters, seed and micro-batch (16 examples per rank; NER 32: at 16 the step's fixed costs hide what padding
costs); a task's contenders run one after another; NER averages ``--ner-seeds``.

* **speed**: examples (NER: real tokens) per second from every optimizer step's wall time (loading and collating
  included), the run after its first step (a one-step run: that step) cut into 10 windows: the median of their rates.
  MFU = model FLOPs on the real tokens / time / the GEMM peak (``bench/mfu.py``'s, one thread, times 2 ranks).
* **peak** (the targets): one training step on the same random batches of 16 BoolQ training examples (their real
  lengths, padded to the longest or packed), a fresh child per setup as ``ds-bertopt memory`` measures it; the median
  of the per-batch ratios. Printed without a target: each training process's RSS high-water mark during the epoch
  above its RSS after its imports, the larger rank.
* **scores**: on the dev files (BoolQ accuracy, entity F1 with seqeval semantics) or on the 20 % of ``disfl_qa.jsonl``
  held out (EM and F1 by the SQuAD v2 rules). BoolQ runs one seed: its accuracy on 1,640 dev questions has a standard
  error near 1.2 points, more than the 0.5-point target resolves.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer, HfArgumentParser, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._common import bar_figure, ROOT, cpu_kind, deepspeed_launcher, environment_line, median, record, run_checked
from bench._common import argv, gemm_peak, say, status, trainer_ds_config, add_record_as
from ds_bertopt.model.local import default_model_dir
from ds_bertopt.train.finetune_memory import task_variant
from ds_bertopt.wtacrs.memory import measure_step_in_child

SHARED = ROOT.parent / "shared" / "data"
OURS = {"model": {"unpadded": True}, "sampler": {"strategy": "packed_node_balance"}}
CONTENDERS = {  # name -> (trainer, bertopt section or None, extra script arguments)
    "HF padded": ("hf", None, []),
    "ours unpadded": ("ours", OURS, []),
    "HF group_by_length": ("hf", None, ["--train_sampling_strategy", "group_by_length"]),
    "ours + preset balanced": ("ours", {**OURS, "wtacrs": {"preset": "balanced"}}, []),
}
COMMON = (
    "--per_device_eval_batch_size 64 --seed 42 --report_to none --save_strategy no --disable_tqdm true "
    "--logging_steps 1000000 --weight_decay 0.01 --warmup_steps 0.1"
).split()
WINDOWS = 10
GiB, MiB = 2**30, 2**20


def task_arguments(task: str, quick: bool, boolq_train: int | None) -> list[str]:
    if task == "glue":
        args = [
            "--train_file", str(SHARED / "boolq" / "train.csv"), "--validation_file", str(SHARED / "boolq" / "dev.csv"),
            "--sentence1_key", "question", "--sentence2_key", "passage", "--max_seq_length", "256",
            "--pad_to_max_length", "false", "--num_train_epochs", "1", "--learning_rate", "3e-5",
            "--per_device_train_batch_size", "16",
        ]  # fmt: skip
        if quick or boolq_train:
            args += ["--max_train_samples", str(boolq_train or 384)]
        return args + (["--max_eval_samples", "256"] if quick else [])
    if task == "ner":
        args = [
            "--train_file", str(SHARED / "ner" / "train.conll"), "--validation_file", str(SHARED / "ner" / "dev.conll"),
            "--max_seq_length", "128", "--num_train_epochs", "1" if quick else "5", "--learning_rate", "1e-4",
            "--per_device_train_batch_size", "32",
        ]  # fmt: skip
        return args + (["--max_train_samples", "480"] if quick else [])
    args = [
        "--train_file", str(SHARED / "qa" / "disfl_qa.jsonl"), "--validation_split_percentage", "20",
        "--version_2_with_negative", "true", "--max_seq_length", "384", "--doc_stride", "128",
        "--num_train_epochs", "1" if quick else "2", "--learning_rate", "5e-5", "--per_device_train_batch_size", "16",
    ]  # fmt: skip
    return args + (["--max_train_samples", "192", "--max_eval_samples", "64"] if quick else [])


def windows(step_s: list[float], batch: int) -> tuple[list[float], list[float]]:
    """``(examples/s, s/step)`` of :data:`WINDOWS` windows of the optimizer steps after the first (all of them when
    there is only one); none when there is no step."""
    steps = step_s[1:] or step_s
    size = max(1, -(-len(steps) // WINDOWS))
    chunks = [steps[i : i + size] for i in range(0, len(steps), size)]
    return [len(c) * batch / sum(c) for c in chunks], [sum(c) / len(c) for c in chunks]


def run(task: str, name: str, work: Path, script_args: list[str], seed: int, stage: int) -> dict:
    """One contender under the deepspeed launcher; its ranks' measurements, merged."""
    trainer, section, extra = CONTENDERS[name]
    out = work / f"{task}_{name.replace(' ', '_').replace('+', 'and')}_{seed}"
    out.mkdir(parents=True)
    (out / "ds.json").write_text(json.dumps(trainer_ds_config(stage, **({"bertopt": section} if section else {}))))
    script = argv(ROOT / "bench" / "finetune_tasks_run.py", task=task, trainer=trainer, out=out)
    options = argv(seed=seed, deepspeed=out / "ds.json", output_dir=out / "run")
    cmd = [*deepspeed_launcher(2), *script, *script_args, *extra, *options]
    print(f"[{task}] {name} ...", flush=True)
    run_checked(cmd, f"{task} {name}", timeout=14400)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    steps = [max(times) for times in zip(*(r["step_s"] for r in ranks))]  # a step ends when both ranks are done
    rates, step_s = windows(steps, ranks[0]["batch"])
    result = {"rates": rates, "step_s": step_s, "train_s": max(r["train_s"] for r in ranks)}
    result.update(steps=ranks[0]["steps"], batch=ranks[0]["batch"], peak=max(r["peak"] for r in ranks))
    result.update(exact_peak=all(r["exact_peak"] for r in ranks), eval=ranks[0]["eval"])
    print(f"[{task}] {name}: {speed(result):.2f} examples/s, peak {result['peak'] / GiB:.2f} GiB, {result['eval']}")
    return result


def merged(runs: list[dict]) -> dict:
    """Several seeds of one contender: every window's rate and step time, the larger peak, the mean score."""
    if len(runs) == 1:
        return runs[0]
    out = {key: [x for r in runs for x in r[key]] for key in ("rates", "step_s")}
    out.update(train_s=sum(r["train_s"] for r in runs), steps=sum(r["steps"] for r in runs), batch=runs[0]["batch"])
    out.update(peak=max(r["peak"] for r in runs), exact_peak=all(r["exact_peak"] for r in runs))
    scores = [r["eval"] for r in runs]
    out["eval"] = {k: statistics.mean(s[k] for s in scores) for k, v in scores[0].items() if isinstance(v, float)}
    out["seeds"] = scores
    return out


def real_lengths(task: str, script_args: list[str]) -> list[int]:
    """The training examples' real token counts (QA: windows), tokenized as the scripts do."""
    sys.path.insert(0, str(ROOT / "examples"))
    script = importlib.import_module(f"run_{task}")
    parser = HfArgumentParser((script.ModelArguments, script.DataArguments, TrainingArguments))
    model_args, data, _ = parser.parse_args_into_dataclasses([*script_args, "--output_dir", tempfile.mkdtemp()])
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    raw, truncated = script.load_raw(data)["train"], {"truncation": True, "max_length": data.max_seq_length}
    if task == "glue":
        encoded = tokenizer(list(raw[data.sentence1_key]), list(raw[data.sentence2_key]), **truncated)
    elif task == "ner":
        encoded = tokenizer(list(raw["tokens"]), is_split_into_words=True, **truncated)
    else:
        data.pad_to_max_length = False
        encoded = script.windows(tokenizer, data, raw[:])
    return [len(ids) for ids in encoded["input_ids"]]


def flops_per_token(lengths: list[int]) -> float:
    """Model FLOPs (forward + backward) per real token: ``3 × layers × (2(4h² + 2h·ffn) + 4h·L)`` averaged."""
    h, ffn, layers = 384, 1536, 6  # MiniLM-L6's
    total = sum(3 * layers * (2 * n * (4 * h * h + 2 * h * ffn) + 4 * h * n * n) for n in lengths)
    return total / sum(lengths)


def mid(values: list[float]) -> float:
    """The median; NaN for none (a run without an optimizer step)."""
    return median(values) if values else float("nan")


def speed(result: dict) -> float:
    return mid(result["rates"])


STEP_SETUPS = ("HF padded", "ours unpadded", "ours + preset balanced")  # the one-step peak at the same batch


def step_peaks(lengths: list[int], batches: int) -> dict[str, list[float]]:
    """One training step's peak (``ds-bertopt memory``'s measure, a fresh child each) of each setup on the same
    ``batches`` random batches of 16 BoolQ training examples, interleaved."""
    rng = random.Random(0)
    peaks: dict[str, list[float]] = {name: [] for name in STEP_SETUPS}
    for _ in range(batches):
        batch = rng.sample(lengths, 16)
        for name in STEP_SETUPS:
            section = CONTENDERS[name][1] or {}  # HF's (None): padded, no wtacrs
            spec = {"build": task_variant, "model": default_model_dir(), "packed": bool(section)}
            spec["wtacrs"] = section.get("wtacrs", {})
            spec.update(lengths=batch, batch=16, seq=max(batch), threads=1)
            peaks[name].append(measure_step_in_child(spec)["step_peak"])
        print(f"[glue] step peaks, a batch of {sum(batch)} real tokens, longest {max(batch)}: "
              + ", ".join(f"{n} {p[-1] / MiB:.0f} MiB" for n, p in peaks.items()), flush=True)  # fmt: skip
    return peaks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="subsets of every task (the code path; minutes)")
    parser.add_argument("--tasks", nargs="+", choices=("ner", "qa", "glue"), default=["ner", "qa", "glue"])
    parser.add_argument("--boolq-train", type=int, help="train BoolQ on its first N examples (every contender)")
    parser.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage of every contender")
    parser.add_argument("--ner-seeds", type=int, nargs="+", default=[42, 43], help="NER: one run per seed, averaged")
    add_record_as(parser, "finetune_tasks")
    args = parser.parse_args(argv)
    if not SHARED.is_dir():
        print(f"skipped: {SHARED} is absent")
        return 0
    torch.set_num_threads(1)  # each rank runs one thread
    peak = 2 * gemm_peak(torch.device("cpu"), torch.float32, repeats=3)
    say(
        f"{cpu_kind()}; MiniLM-L6, 2 ranks x 1 thread, fp32, ZeRO {args.zero}; GEMM peak {peak / 1e9:.1f} GFLOP/s "
        "(2 threads)"
    )
    print(environment_line(), flush=True)
    work = Path(tempfile.mkdtemp(prefix="finetune_tasks_"))
    results: dict[str, dict] = {}
    for task in args.tasks:
        names = tuple(CONTENDERS) if task == "glue" else ("ours unpadded", "HF padded")  # the order they run in
        script_args = task_arguments(task, args.quick, args.boolq_train) + COMMON
        lengths = real_lengths(task, script_args)
        seeds = args.ner_seeds if task == "ner" else [42]
        runs = [{name: run(task, name, work, script_args, seed, args.zero) for name in names} for seed in seeds]
        results[task] = {name: merged([r[name] for r in runs]) for name in names}
        results[task].update(_tokens_per_example=sum(lengths) / len(lengths), _flops_per_token=flops_per_token(lengths))
        results[task]["_examples"] = len(lengths)
        if task == "glue":
            results[task]["_step_peaks"] = step_peaks(lengths, 2 if args.quick else 5)
    report(results, args, peak)
    record(
        args.record_as,
        f"{'quick subsets' if args.quick else 'full'}; one seed (42); speed: median of {WINDOWS} windows of each "
        "run's optimizer steps; peak: RSS high-water mark above the bare process, larger rank",
        results=results,
        gemm_peak=peak,
    )
    return 0


def report(results: dict, args, peak: float) -> None:
    rates, memory = {}, {}
    for task, per in results.items():
        tokens, flops = per["_tokens_per_example"], per["_flops_per_token"]
        for name, result in per.items():
            if name.startswith("_"):
                continue
            mfu = speed(result) * tokens * flops / peak
            scores = {k: round(v, 4) for k, v in result["eval"].items() if isinstance(v, float)}
            say(
                f"{task} {name}: {speed(result):.2f} examples/s ({speed(result) * tokens:.0f} real tokens/s, MFU "
                f"{mfu:.3f}), {mid(result['step_s']):.3f} s/step, peak {result['peak'] / GiB:.2f} "
                f"GiB, {result['steps']} steps, scores {json.dumps(scores)}"
            )
            rates[f"{task}: {name}"], memory[f"{task}: {name}"] = speed(result), result["peak"] / GiB

    def ratio(what: str, ours: str, theirs: str, r: dict, target: float, unit: str, scale: float = 1.0) -> None:
        a, b = speed(r[ours]) * scale, speed(r[theirs]) * scale
        say(
            f"{what}, {ours} vs {theirs}: {a / b:.2f}x (median of {len(r[ours]['rates'])}); {a:.1f} vs {b:.1f} "
            f"{unit}; target >= {target}x: {status(a / b >= target)}"
        )

    def score(what: str, key: str, ours: str, theirs: str, r: dict, within: float) -> None:
        a, b = 100 * r[ours]["eval"][key], 100 * r[theirs]["eval"][key]
        seeds = ""
        if "seeds" in r[ours]:
            each = ["/".join(f"{100 * s[key]:.2f}" for s in r[n]["seeds"]) for n in (ours, theirs)]
            seeds = f"; mean of {len(r[ours]['seeds'])} seeds: {each[0]} vs {each[1]}"
        say(
            f"{what}, {ours} vs {theirs}: {a:.2f} vs {b:.2f} ({a - b:+.2f} points{seeds}; target within {within} "
            f"points): {status(a >= b - within)}"
        )

    if "glue" in results:
        r, peaks = results["glue"], results["glue"]["_step_peaks"]
        subset = f"first {args.boolq_train} of 9,427 training examples" if args.boolq_train else "all 9,427 training"
        subset = "quick subset" if args.quick else subset
        say(f"BoolQ, max length 256, one epoch ({subset}; {r['_examples']} examples, {r['_tokens_per_example']:.0f} "
            "real tokens each on average):")  # fmt: skip
        score("BoolQ dev accuracy", "accuracy", "ours unpadded", "HF padded", r, 0.5)
        ratio("BoolQ training examples/s", "ours unpadded", "HF padded", r, 1.5, "examples/s")
        ratio("BoolQ training examples/s", "ours unpadded", "HF group_by_length", r, 1.15, "examples/s")
        for what, ours, target in (
            ("BoolQ peak memory at the same batch", "ours unpadded", 1.5),
            ("BoolQ preset balanced, peak", "ours + preset balanced", 2.5),
        ):
            ratios = [b / a for a, b in zip(peaks[ours], peaks["HF padded"])]
            a, b = (median(peaks[n]) / MiB for n in (ours, "HF padded"))
            say(
                f"{what}: HF padded / {ours} = {median(ratios):.2f}x (median of {len(ratios)}) lower one-step peak "
                f"({a:.0f} vs {b:.0f} MiB: weights, gradients, AdamW state, activations; the same random batches of "
                f"16); target >= {target}x: {status(median(ratios) >= target)}"
            )
        for ours in ("ours unpadded", "ours + preset balanced"):  # context, no target: allocator and loading included
            a, b = r[ours]["peak"], r["HF padded"]["peak"]
            exact = "" if r[ours]["exact_peak"] and r["HF padded"]["exact_peak"] else " (high-water mark not reset)"
            say(
                f"BoolQ training process peak, HF padded / {ours}: {b / a:.2f}x ({a / GiB:.2f} vs {b / GiB:.2f} GiB: "
                f"RSS high-water mark of the epoch above the bare process, the larger rank{exact})"
            )
        score("BoolQ preset balanced, dev accuracy", "accuracy", "ours + preset balanced", "HF padded", r, 1.0)
        a, b = (mid(r[n]["step_s"]) for n in ("ours + preset balanced", "HF padded"))
        say(
            f"BoolQ preset balanced, step time vs HF padded: {a / b:.2f}x (median of {WINDOWS}); {a:.3f} vs {b:.3f} "
            f"s/step; target <= 1.0x: {status(a / b <= 1.0)}"
        )
    if "ner" in results:
        r = results["ner"]
        score("Twitter NER entity F1", "f1", "ours unpadded", "HF padded", r, 0.5)
        scale = r["_tokens_per_example"]
        ratio("Twitter NER training tokens/s", "ours unpadded", "HF padded", r, 1.3, "real tokens/s", scale)
    if "qa" in results:
        r = results["qa"]
        ours, theirs = r["ours unpadded"]["eval"], r["HF padded"]["eval"]
        ran = all(k in ours for k in ("exact_match", "f1", "has_answer_f1", "no_answer_exact_match"))
        say(
            f"QA on disfl_qa.jsonl (train on 80 %, evaluate on the other {ours['total']} questions): ours EM "
            f"{100 * ours['exact_match']:.2f} F1 {100 * ours['f1']:.2f}, HF run_qa-style EM "
            f"{100 * theirs['exact_match']:.2f} F1 {100 * theirs['f1']:.2f}; whole path runs: {status(ran)}"
        )
        ratio("QA training examples/s", "ours unpadded", "HF padded", r, 1.3, "windows/s")
    bar_figure("speed", "Training examples/s (median of windows)", "examples/s", rates, "examples/s")
    if "glue" in results:
        steps = {n: median(p) / MiB for n, p in results["glue"]["_step_peaks"].items()}
        bar_figure("step_peak", "BoolQ one-step peak at the same batches of 16 (median)", "MiB", steps, "MiB")
    bar_figure("peak", "Training process peak memory (RSS above the bare process)", "GiB", memory, "GiB")


if __name__ == "__main__":
    sys.exit(main())
