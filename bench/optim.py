"""Miniature of the large-batch optimizer study, LAMB vs AdamW, on real text; and LAMB's step time.

1. Convergence: ``launch/pretrain.py`` under the real ``deepspeed`` launcher (2 CPU ranks, ZeRO 1)
   trains a small BERT on ``../shared/data/wiki_sample.jsonl`` with each optimizer at a small
   global batch and at an 8× larger one (same micro-batch, 8× gradient accumulation), each with
   the same sample budget and its LR scaled from the small batch by the sqrt rule
   (``schedule.scaling``). Printed: steps and samples until the held-out MLM accuracy first
   reaches the target, and the large/small ratios.
2. Step time: ``optimizer.step()`` of our LAMB vs ``torch_optimizer.Lamb`` (only when that package
   is importable — install it in a separate bench environment, never in the project's venv; see
   docs/optim.md) and vs torch's fused AdamW, on the parameters of ``ds_configs/bert.json``'s model,
   interleaved, median of 7.

    python bench/optim.py [--quick]

``--quick`` (about 3 min on 2 cores): a tenth of the sample budget, a lower target, the step-time part.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ds_bertopt.testing.distributed import free_port  # noqa: E402
from ds_bertopt.testing.measure import environment_line, interleaved, median, ratio_line, record_results  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "wiki_sample.jsonl"
SMALL_MODEL = ["model.hidden_size=128", "model.num_hidden_layers=2", "model.num_attention_heads=2",
               "model.intermediate_size=512", "train.save_model=false"]


SUMMARY: list[str] = []  # for bench/run_all.py's report (record_results)
CURVES: list[dict] = []


def say(line: str) -> None:
    print(line, flush=True)
    SUMMARY.append(line)




def pretrain(optimizer: str, *, micro: int, accumulation: int, steps: int, eval_every: int, lr: float,
             reference_batch: int, seq: int, out: Path, seed: int, prefix: list[str]) -> list[dict]:
    """One ``launch/pretrain.py`` run; returns its metrics.jsonl records."""
    overrides = SMALL_MODEL + [
        f"deepspeed.train_micro_batch_size_per_gpu={micro}", f"deepspeed.gradient_accumulation_steps={accumulation}",
        f"optimizer.lr={lr}", f"schedule.reference_batch={reference_batch}", "schedule.scaling=sqrt"]
    cmd = prefix + [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           str(ROOT / "launch" / "pretrain.py"), "--deepspeed_config", str(ROOT / "ds_configs" / f"bert_{optimizer}.json"),
           "--train_file", str(DATA), "--max_steps", str(steps), "--eval_every", str(eval_every),
           "--log_every", str(eval_every), "--max_seq_length", str(seq), "--output_dir", str(out), "--seed", str(seed)]
    for text in overrides:
        cmd += ["-o", text]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pretrain {optimizer} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    for line in proc.stdout.splitlines():
        if "peak lr" in line:
            print(f"  {optimizer} batch {micro * accumulation * 2}: {line.split('] ', 1)[-1]}", flush=True)
    with open(out / "metrics.jsonl", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def first_reaching(records: list[dict], target: float):
    """(step, accuracy) of the first eval at or above ``target``, or None; and the best accuracy."""
    evals = [r for r in records if "eval_accuracy" in r]
    best = max((r["eval_accuracy"] for r in evals), default=0.0)
    for record in evals:
        if record["eval_accuracy"] >= target:
            return record["step"], best
    return None, best


def convergence_study(args) -> None:
    if not DATA.exists():
        print(f"convergence study skipped: {DATA} is absent")
        return
    small = args.micro * 2
    large = small * args.factor
    budget = args.samples
    print(f"convergence: small BERT (128 hidden, 2 layers), seq {args.seq}, 2 ranks ZeRO 1, {budget} samples per run, "
          f"target held-out MLM accuracy {args.target}; batches {small} and {large} (×{args.factor} accumulation)",
          flush=True)
    reached: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench_optim_") as tmp:
        for batch, accumulation in ((small, 1), (large, args.factor)):
            steps = budget // batch
            eval_every = max(1, args.eval_samples // batch)
            for optimizer, lr in (("lamb", args.lamb_lr), ("adam", args.adam_lr)):
                start = time.perf_counter()
                records = pretrain(optimizer, micro=args.micro, accumulation=accumulation, steps=steps,
                                   eval_every=eval_every, lr=lr, reference_batch=small, seq=args.seq,
                                   out=Path(tmp) / f"{optimizer}_{batch}", seed=args.seed,
                                   prefix=args.run_prefix.split())
                step, best = first_reaching(records, args.target)
                evals = [r for r in records if "eval_accuracy" in r]
                CURVES.append({"label": f"{optimizer} batch {batch}", "x": [r["step"] * batch for r in evals],
                               "y": [r["eval_accuracy"] for r in evals]})
                minutes = (time.perf_counter() - start) / 60
                if step is None:
                    say(f"{optimizer} batch {batch}: did not reach {args.target} in {steps} steps "
                        f"({steps * batch} samples); best {best:.4f} ({minutes:.1f} min)")
                else:
                    say(f"{optimizer} batch {batch}: MLM accuracy {args.target} at step {step} = {step * batch} "
                        f"samples (best {best:.4f} of {steps} steps; {minutes:.1f} min)")
                reached[(optimizer, batch)] = step
    for optimizer in ("lamb", "adam"):
        s_small, s_large = reached[(optimizer, small)], reached[(optimizer, large)]
        if s_small is None or s_large is None:
            print(f"{optimizer} samples to accuracy {args.target} at batch {large} vs batch {small}: n/a (not reached)")
            continue
        say(ratio_line(f"{optimizer} samples to accuracy {args.target} at batch {large}", [s_large * large],
                         [s_small * small], f"batch {small}"))
        print(ratio_line(f"{optimizer} steps to accuracy {args.target} at batch {large}", [s_large], [s_small],
                         f"batch {small}"))
    for batch in (small, large):
        lamb, adam = reached[("lamb", batch)], reached[("adam", batch)]
        if lamb is not None and adam is not None:
            say(ratio_line(f"samples to accuracy {args.target} at batch {batch}: lamb", [lamb], [adam], "adam"))


def step_time_study(repeats: int) -> None:
    import torch
    from transformers import BertConfig, BertForMaskedLM

    from ds_bertopt.optim import param_groups
    from ds_bertopt.optim.lamb import Lamb

    torch.set_num_threads(1)

    def model_with_grads():
        torch.manual_seed(0)
        model = BertForMaskedLM(BertConfig(vocab_size=8192, hidden_size=256, num_hidden_layers=4,
                                           num_attention_heads=4, intermediate_size=1024))
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-2
        return model

    n_params = sum(p.numel() for p in model_with_grads().parameters())
    def ours(max_grad_norm: float) -> Lamb:
        return Lamb(param_groups(model_with_grads(), 0.01, decay_extra={"adapt": True},
                                 no_decay_extra={"adapt": False}), lr=1e-3, max_grad_norm=max_grad_norm)

    # torch_optimizer.Lamb does no global-norm clipping: "ours" matches that work, "ours+clip" adds ours.
    variants = {"ours": ours(0.0), "ours+clip": ours(1.0),
                "adamw": torch.optim.AdamW(param_groups(model_with_grads(), 0.01), lr=1e-3, fused=True)}
    try:
        import torch_optimizer

        variants["torch_optimizer"] = torch_optimizer.Lamb(param_groups(model_with_grads(), 0.01), lr=1e-3)
    except ImportError:
        pass
    times = interleaved({name: opt.step for name, opt in variants.items()}, repeats=repeats, warmup=2)
    print(f"step time, BERT {n_params / 1e6:.1f}M parameters, 1 thread: "
          + ", ".join(f"{name} {median(t) * 1e3:.1f} ms" for name, t in times.items()))
    if "torch_optimizer" in times:
        say(ratio_line("LAMB optimizer step time (ours)", times["ours"], times["torch_optimizer"],
                         "torch_optimizer.Lamb"))
        print(ratio_line("LAMB optimizer step time (ours, with global-norm clipping)", times["ours+clip"],
                         times["torch_optimizer"], "torch_optimizer.Lamb"))
    else:
        print("LAMB optimizer step time (ours) vs torch_optimizer.Lamb: not available (torch_optimizer is not "
              "installed in this environment; see docs/optim.md for the separate bench venv)")
    say(ratio_line("LAMB optimizer step time (ours)", times["ours"], times["adamw"], "torch fused AdamW"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="about 3 minutes: smaller budget and target")
    parser.add_argument("--micro", type=int, default=16, help="sequences per rank per micro-batch")
    parser.add_argument("--factor", type=int, default=8, help="large batch = factor × small (accumulation)")
    parser.add_argument("--samples", type=int, help="training samples per run")
    parser.add_argument("--eval-samples", type=int, help="evaluate every this many samples")
    parser.add_argument("--target", type=float, help="held-out MLM accuracy to reach")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lamb-lr", type=float, default=None, help="LAMB peak LR at the small batch")
    parser.add_argument("--adam-lr", type=float, default=None, help="AdamW peak LR at the small batch")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--skip-convergence", action="store_true")
    parser.add_argument("--skip-step-time", action="store_true")
    parser.add_argument("--run-prefix", default="", help="command prefix for each training run, e.g. a lock: "
                        "'flock /tmp/ds_bertopt_cpu.lock'")
    args = parser.parse_args()
    defaults = QUICK if args.quick else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    print(environment_line(), flush=True)
    if not args.skip_convergence:
        convergence_study(args)
    if not args.skip_step_time:
        step_time_study(repeats=7)
    record_results("optim", {
        "summary": SUMMARY,
        "note": f"2 ranks ZeRO 1, small BERT, seq {args.seq}, seed {args.seed}, {args.samples} samples per run, "
                f"LR sqrt-scaled from batch {args.micro * 2} (lamb {args.lamb_lr}, adam {args.adam_lr}); one run each",
        "figures": [{"kind": "curves", "file": "convergence", "xlabel": "training samples",
                     "ylabel": "held-out MLM accuracy", "reference": args.target,
                     "title": "LAMB vs AdamW at two global batch sizes", "series": CURVES}] if CURVES else []})


# LRs at the small batch (32): ds_configs/bert_{lamb,adam}.json's values (tuned at reference batch 32).
FULL = {"samples": 24000, "eval_samples": 800, "target": 0.07, "lamb_lr": 5e-3, "adam_lr": 1e-3}
QUICK = {"samples": 2400, "eval_samples": 300, "target": 0.05, "lamb_lr": 5e-3, "adam_lr": 1e-3}

if __name__ == "__main__":
    main()
