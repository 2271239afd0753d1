"""Large-batch optimizer study, LAMB vs AdamW, on real text; the gradient noise scale behind it; LAMB's step time.

    python bench/optim.py [--quick]                  # full: batch 32 vs 1,024, 2 seeds, compact grid (~1.5 h)
    python bench/optim.py --grid full --write-presets  # 8-point grid per optimizer; rewrite the presets

Method of the convergence study and of the noise scale (McCandlish et al. 2018, App. A): docs/time_to_train.md ("Large
batches"); ``--quick`` (~4 min) is a smoke run of it (batch 32 vs 256, one seed, no grid, a tenth of the samples, the
unigram plateau as target). Step time (``--skip-convergence``: only this part): ``optimizer.step()`` of our LAMB (fused
CPU kernel; with clipping; multi-tensor and foreach paths) vs torch's fused AdamW (target ≤ 1.45×) and
``torch_optimizer.Lamb`` when importable (docs/optim.md), on a 4 × 256 BERT's parameters, 1 thread, median of 25.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from transformers import BertConfig, BertForMaskedLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import bert_overrides, bert_sizes, checkpoint_weights, cpu_env, deepspeed_launcher, figure
from bench._common import environment_line, first_crossing, interleaved, md_table, median, pretrain_argv, ratio_line
from bench._common import ROOT, config_overrides, md_row, read_metrics, record, say, status, add_record_as
from ds_bertopt.config import load_config
from ds_bertopt.data.collate import MLMCollator, step_generator
from ds_bertopt.data.pipeline import build_pretrain_data
from ds_bertopt.model.bert import build_pretraining_model
from ds_bertopt.optim import Lamb, lamb_kernel, param_groups
from ds_bertopt.testing.measure import VIEW_OPS, torch_ops

DATA = ROOT.parent / "shared" / "data" / "wiki_sample.jsonl"
SMALL_MODEL = bert_overrides(128, 2, 2, 512)
CONFIGS = {"lamb": "bert_lamb.json", "adamw": "bert_adam.json"}
SHIPPED_LR = {"lamb": 5e-3, "adamw": 1e-3}
"""Peak LRs at batch 32 (``bert_lamb.json`` / ``bert_adam.json``, tuned at reference batch 32)."""
REFERENCE_BATCH = 32
STEP_TARGET = 1.45
"""The issue's target: our LAMB step ≤ 1.45× torch's fused AdamW on CPU, near the traffic limit of two passes
(40 bytes an element against AdamW's 28: 1.43×)."""
# Full: batch 32 vs 1,024; 24 optimizer steps at 1,024 (768 at 32). LRs at batch 32: the shipped configs'.
FULL = dict(
    samples=24576, eval_samples=512, target=0.07, factor=32, seeds=[1, 2], grid="compact", noise_micro_batches=32
)
QUICK = dict(samples=2400, eval_samples=300, target=0.05, factor=8, seeds=[1], grid="none", noise_micro_batches=0)
CURVES: list[dict] = []
TABLE: list[str] = []


@dataclass(frozen=True)
class Point:
    """One training configuration of the study."""

    optimizer: str
    batch: int
    lr: float
    """Peak LR at the reference batch (32), scaled to ``batch`` by ``scaling``."""
    scaling: str = "sqrt"
    warmup_fraction: float = 0.1
    beta2: float = 0.999
    seed: int = 42

    @property
    def label(self) -> str:
        warmup = f"warmup {self.warmup_fraction:g}, β₂ {self.beta2:g}"
        return f"{self.optimizer} batch {self.batch}: lr {self.lr:g}@32 {self.scaling}, {warmup}"

    @property
    def schedule(self) -> dict:
        """MLPerf-style: warmup, then linear decay to 0 from step 0; the LR scaled from the reference batch."""
        return {"type": "poly", "warmup_fraction": self.warmup_fraction, "power": 1.0, "end_lr_ratio": 0.0,
                "decay_from": "step0", "scaling": self.scaling, "reference_batch": REFERENCE_BATCH}  # fmt: skip

    def overrides(self, micro: int, world: int) -> list[str]:
        accumulation = self.batch // (micro * world)
        batching = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation}
        optimizer = {"lr": self.lr, "betas": [0.9, self.beta2]}
        return config_overrides(deepspeed=batching, optimizer=optimizer, schedule=self.schedule)


def grid(optimizer: str, batch: int, kind: str) -> list[Point]:
    """The large-batch grid: LR scaling × warmup × β₂ (``compact``: 2 (warmup, β₂) pairs; ``none``: the shipped LR)."""
    if kind == "none":
        return [Point(optimizer, batch, SHIPPED_LR[optimizer])]
    pairs = [(0.1, 0.999), (0.3, 0.95)] if kind == "compact" else [(w, b) for w in (0.1, 0.3) for b in (0.999, 0.95)]
    return [Point(optimizer, batch, SHIPPED_LR[optimizer], s, *pair) for s in ("sqrt", "linear") for pair in pairs]


@dataclass
class Result:
    point: Point
    evals: list
    """The run's records with ``eval_accuracy``."""
    diverged: bool
    minutes: float
    out: Path

    @property
    def best(self) -> float:
        return max((r["eval_accuracy"] for r in self.evals), default=0.0)

    def samples_to(self, target: float) -> float:
        """Samples at the first crossing of ``target``, linearly interpolated between evaluations; inf if never."""
        crossing = first_crossing([r["eval_accuracy"] for r in self.evals], target, [r["step"] for r in self.evals])
        return crossing[0] * self.point.batch if crossing else math.inf


def reach_text(value: float, spec: str = ",.0f", unit: str = "") -> str:
    """``value`` formatted (samples; ``".2f", "x"``: a ratio), or "not reached" where it is infinite (or inf/inf)."""
    return f"{value:{spec}}{unit}" if math.isfinite(value) else "not reached"


def run_point(point: Point, args, tmp: Path, save_every: int = 0) -> Result:
    """One ``launch/pretrain.py`` run of ``point`` into ``tmp/runNNN`` (stopped by non-finite gradients: a diverged
    result); its curve and table row are kept for the record."""
    out, every = tmp / f"run{len(CURVES):03d}", max(1, args.eval_samples // point.batch)
    run = ["train.save_model=false", f"train.save_every={save_every}", "train.keep_last=1000"]
    overrides = [*SMALL_MODEL, *point.overrides(args.micro, 2), *run, "deepspeed.csv_monitor.enabled=false"]
    options = dict(train_file=DATA, max_steps=max(1, args.samples // point.batch), eval_every=every, log_every=every)
    options.update(max_seq_length=args.seq, overwrite_output_dir=True, seed=point.seed)
    cmd = [*deepspeed_launcher(2), *pretrain_argv(out, f"ds_configs/{CONFIGS[point.optimizer]}", overrides, **options)]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=cpu_env(), capture_output=True, text=True, check=False)
    diverged = proc.returncode != 0 and "non-finite gradients" in proc.stdout + proc.stderr
    if proc.returncode != 0 and not diverged:
        raise RuntimeError(f"pretrain {point.label} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    for line in proc.stdout.splitlines():
        if "peak lr" in line:
            print(f"  {point.label}: {line.split('] ', 1)[-1]}", flush=True)
    result = Result(point, read_metrics(out, "eval_accuracy"), diverged, (time.perf_counter() - started) / 60, out)
    label, evals = f"{point.label}, seed {point.seed}", result.evals
    xs, ys = [r["step"] * point.batch for r in evals], [r["eval_accuracy"] for r in evals]
    CURVES.append({"label": label, "x": xs, "y": ys})
    samples, diverged = result.samples_to(args.target), " (diverged)" if result.diverged else ""
    fields = (point.optimizer, point.batch, f"{point.lr:g}", point.scaling, f"{point.warmup_fraction:g}")
    cells = [*fields, f"{point.beta2:g}", point.seed, reach_text(samples) + diverged, f"{result.best:.4f}"]
    TABLE.append(md_row(cells))
    reached = f"did not reach {args.target}" + (" (diverged: non-finite gradients)" if result.diverged else "")
    reached = f"accuracy {args.target} at {samples:,.0f} samples" if math.isfinite(samples) else reached
    print(f"{label}: {reached}; best {result.best:.4f} ({result.minutes:.1f} min)", flush=True)
    return result


def convergence_study(args, tmp: Path) -> dict:
    if not DATA.exists():
        print(f"convergence study skipped: {DATA} is absent")
        return {}
    small, large = args.micro * 2, args.micro * 2 * args.factor
    seeds, target = args.seeds, args.target
    runs = f"{args.samples} samples per run, target held-out MLM accuracy {target}; batches {small} and {large}"
    schedule = f"MLPerf-style schedule (warmup, linear decay from step 0), LR scaled from batch {REFERENCE_BATCH}"
    print(f"convergence: small BERT (128 hidden, 2 layers), seq {args.seq}, 2 ranks ZeRO 1, {runs} (×{args.factor} "
          f"accumulation); {schedule}; seeds {seeds}; large-batch grid {args.grid}", flush=True)  # fmt: skip
    small_runs: dict[str, list[Result]] = {"adamw": [], "lamb": []}
    for i, seed in enumerate(seeds):
        for optimizer in ("adamw", "lamb") if i % 2 == 0 else ("lamb", "adamw"):
            keep = args.noise_micro_batches and optimizer == "adamw" and seed == seeds[0]  # the noise study's run
            point = Point(optimizer, small, SHIPPED_LR[optimizer], seed=seed)
            small_runs[optimizer].append(run_point(point, args, tmp, max(1, args.samples // small // 4) if keep else 0))
    tuned: dict[str, list[Result]] = {}
    for optimizer in ("adamw", "lamb"):
        first = [run_point(replace(p, seed=seeds[0]), args, tmp) for p in grid(optimizer, large, args.grid)]
        best = min(first, key=lambda r: (r.samples_to(target), -r.best))  # else the best accuracy
        if len(first) > 1:
            say(f"{optimizer} batch {large}: best of {len(first)} grid points on seed {seeds[0]}: {best.point.label}")
        tuned[optimizer] = [best] + [run_point(replace(best.point, seed=s), args, tmp) for s in seeds[1:]]
    # samples to the target, per optimizer, per seed: at the small batch, at the large one
    got = {o: tuple([r.samples_to(target) for r in runs[o]] for runs in (small_runs, tuned)) for o in small_runs}
    for optimizer, runs in got.items():
        for batch, samples, chosen in zip((small, large), runs, ("", f" ({tuned[optimizer][0].point.label})")):
            texts = " / ".join(reach_text(s) for s in samples)
            say(f"{optimizer} batch {batch}{chosen}: samples to {target}: {texts} (seeds {seeds})")
    ratios = dict.fromkeys(got, math.inf)
    for optimizer, (ref, big) in got.items():
        what = f"{optimizer} samples to accuracy {target} at batch {large} vs batch {small}"
        paired = [b / s for b, s in zip(big, ref)]  # paired by seed (ours evaluates with seed-dependent masks)
        if not all(map(math.isfinite, big + ref)):
            say(f"{what}: n/a (not reached in every run)")
            continue
        ratios[optimizer] = median(paired)
        texts = ", ".join(f"{v:.2f}" for v in paired)
        say(f"{what}: {median(paired):.2f}x (median of {len(paired)} seed-paired ratios: {texts})")
    for batch, lamb, adam in zip((small, large), got["lamb"], got["adamw"]):
        if all(map(math.isfinite, lamb + adam)):
            say(ratio_line(f"samples to accuracy {target} at batch {batch}: lamb", lamb, adam, "adamw"))
    best_large = min(("adamw", "lamb"), key=lambda o: median(got[o][1]))
    own, against_best = ratios[best_large], median(got[best_large][1]) / min(median(got[o][0]) for o in got)
    say(
        f"[target] at batch ~{large} the best optimizer ({best_large}) needs ≤ 1.3× the samples of batch {small}: "
        f"{status(own <= 1.3 and against_best <= 1.3)} ({reach_text(own, '.2f', 'x')} of its own batch-{small} run, "
        f"{reach_text(against_best, '.2f', 'x')} of the best batch-{small} run)"
    )
    noise = noise_study(small_runs["adamw"][0], args, small, large) if args.noise_micro_batches else None
    if args.write_presets and (args.grid == "none" or large != 1024):
        this = f"batch {large}, grid {args.grid}"
        say(f"presets not written: they are for batch 1,024 chosen by a grid (this run: {this})")
    elif args.write_presets:
        for point in (tuned[optimizer][0].point for optimizer in ("adamw", "lamb")):
            say(f"preset written: {write_preset(point, args).relative_to(ROOT)} ({point.label})")
    chosen = {o: vars(tuned[o][0].point) for o in tuned}
    return {"ratios": ratios, "best_large": best_large, "noise": noise, "chosen": chosen}


def noise_scale(model, batches: list[dict], micro: int) -> tuple[float, float, float]:
    """``(B_simple, |G|², tr Σ)`` from per-micro-batch gradients (McCandlish et al. 2018, App. A.1), from ``|G_b|²``
    the mean squared norm of single micro-batch gradients (``b`` sequences) and ``|G_B|²`` that of their mean."""
    params = [p for p in model.parameters() if p.requires_grad]
    total, small_sq = None, 0.0
    model.train()
    torch.manual_seed(0)  # the same dropout draws for every checkpoint
    for batch in batches:
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        flat = torch.cat([p.grad.reshape(-1).double() for p in params if p.grad is not None])
        small_sq += float(flat @ flat)
        total = flat if total is None else total + flat
    k, b, big = len(batches), float(micro), float(micro * len(batches))
    small_sq, big_sq = small_sq / k, float((total / k) @ (total / k))
    g2 = (big * big_sq - b * small_sq) / (big - b)
    trace = (small_sq - big_sq) / (1 / b - 1 / big)
    return trace / g2, g2, trace


def noise_study(reference: Result, args, small: int, large: int) -> dict | None:
    """B_simple on the batch-32 AdamW run's checkpoints; the samples ratio it predicts for ``large`` vs ``small``."""
    checkpoints = reference.out / "checkpoints"
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    overrides = [*SMALL_MODEL, f"data.train_files={json.dumps([str(DATA)])}", f"data.max_seq_length={args.seq}"]
    cfg = load_config(str(ROOT / "ds_configs" / CONFIGS["adamw"]), overrides).bertopt
    data = build_pretrain_data(cfg)
    probability, longest = cfg.data.mlm_probability, cfg.model.max_position_embeddings
    collator = MLMCollator(data.tokenizer, mlm_probability=probability, pad_multiple=8, max_length=longest)
    rng, batches = np.random.default_rng(0), []
    for k in range(args.noise_micro_batches):
        rows = data.train[[int(i) for i in rng.choice(len(data.train), args.micro, replace=False)]]
        samples = [{"input_ids": i, "token_type_ids": t} for i, t in zip(rows["input_ids"], rows["token_type_ids"])]
        batch = collator(samples, step_generator(0, k))
        batches.append({key: batch[key] for key in ("input_ids", "token_type_ids", "attention_mask", "labels")})
    model = build_pretraining_model(cfg.model, data.tokenizer, cfg.data.max_seq_length)
    accuracy = {r["step"]: r["eval_accuracy"] for r in reference.evals}
    rows = []
    for tag in sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step") and "." not in p.name):
        step = int(tag[4:])
        model.load_state_dict(checkpoint_weights(checkpoints / tag), strict=False)
        model.tie_weights()
        b_simple, g2, trace = noise_scale(model, batches, args.micro)
        predicted = (1 + large / b_simple) / (1 + small / b_simple) if b_simple > 0 else math.nan
        near = min(accuracy, key=lambda s: abs(s - step)) if accuracy else None
        row = {"step": step, "samples": step * small, "b_simple": b_simple, "g2": g2, "trace": trace}
        rows.append({**row, "predicted_ratio": predicted, "accuracy": accuracy.get(near)})
        where = f"step {step} ({step * small} samples, accuracy {accuracy.get(near, math.nan):.4f})"
        scale = f"B_simple {b_simple:,.0f} sequences (|G|² {g2:.3g}, tr Σ {trace:.3g})"
        print(f"  noise scale at {where}: {scale}; predicted samples ratio batch {large} / {small}: {predicted:.2f}")
    if not rows:
        return None
    crossing = reference.samples_to(args.target)
    before = [r for r in rows if r["samples"] <= crossing] or rows[:1]
    needed = (large - 1.3 * small) / 0.3  # (1 + L/B) ≤ 1.3 (1 + S/B)  ⇔  B ≥ (L − 1.3 S) / 0.3
    say(
        f"gradient noise scale B_simple of the batch-{small} AdamW run before it reaches {args.target}: "
        + ", ".join(f"{r['b_simple']:,.0f} at {r['samples']:,} samples" for r in before)
        + f"; the empirical model E(B) = E_min (1 + B/B_noise) predicts batch {large} needs "
        + ", ".join(f"{r['predicted_ratio']:.2f}x" for r in before)
        + f" the samples of batch {small}; ≤ 1.3x needs B_noise ≥ {needed:,.0f}"
    )
    return {"rows": rows, "needed": needed}


def write_preset(point: Point, args) -> Path:
    """``ds_configs/bert_large_batch_<optimizer>.json``: the study's model, data and chosen optimizer/schedule."""
    base = json.loads((ROOT / "ds_configs" / CONFIGS[point.optimizer]).read_text())
    name = f"bert_large_batch_{point.optimizer}"
    accumulation = point.batch // (args.micro * 2)
    batching = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": accumulation}
    copied = {k: base[k] for k in ("gradient_clipping", "zero_allow_untested_optimizer") if k in base}
    quiet = {"steps_per_print": 1000000, "wall_clock_breakdown": False, "zero_optimization": {"stage": 1}}
    config = {**batching, **copied, **quiet, "csv_monitor": {"enabled": True, "job_name": name}}
    train = {"max_steps": max(1, args.samples // point.batch), "eval_every": max(1, args.eval_samples // point.batch)}
    config["bertopt"] = {
        "model": bert_sizes(128, 2, 2, 512, max_position_embeddings=512, objective="mlm"),
        "data": {"max_seq_length": args.seq},
        "train": {**train, "log_every": 1, "output_dir": f"runs/{name}"},
        "optimizer": {**base["bertopt"]["optimizer"], "lr": point.lr, "betas": [0.9, point.beta2]},
        "schedule": point.schedule,
    }
    path = ROOT / "ds_configs" / f"{name}.json"
    path.write_text(format_config(config))
    return path


def format_config(config: dict, width: int = 116) -> str:
    """ds_configs' house layout: a line per top-level key and per ``bertopt`` section, wrapped under its first key."""
    top = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in config.items() if k != "bertopt"]
    lines = ["{", *top, '  "bertopt": {']
    for name, body in config["bertopt"].items():
        head = f"    {json.dumps(name)}: {{"
        fields = [f"{json.dumps(k)}: {json.dumps(v)}," for k, v in body.items()]
        fields[-1] = fields[-1][:-1] + "},"
        lines.append(head + fields[0])
        for text in fields[1:]:
            if len(lines[-1]) + 1 + len(text) > width:
                lines.append(" " * len(head) + text)
            else:
                lines[-1] += " " + text
    lines[-1] = lines[-1][:-1]  # the last section takes no comma
    return "\n".join([*lines, "  }", "}", ""])


def cache_bytes() -> int:
    """The last-level cache of this CPU (bytes; 0 when the system does not say)."""
    for name in ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        with contextlib.suppress(ValueError, OSError):
            if os.sysconf(name) > 0:
                return os.sysconf(name)
    for index in (3, 2):
        with contextlib.suppress(OSError):
            text = Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size").read_text().strip()
            return int(text.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return 0


def step_time_study(repeats: int) -> None:
    torch.set_num_threads(1)
    started = time.perf_counter()
    ready = lamb_kernel.library() is not None
    built = f"ready in {time.perf_counter() - started:.3f} s (built once per machine, then loaded)"
    missing = f"unavailable ({lamb_kernel.unavailable_reason()}); ours runs the multi-tensor path"
    print(f"fused CPU LAMB kernel: {built if ready else missing}")

    def model_with_grads():
        torch.manual_seed(0)
        model = BertForMaskedLM(BertConfig(**bert_sizes(256, 4, 4, 1024, vocab_size=8192)))
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-2
        return model

    def ours(max_grad_norm: float, kernel: str = "auto") -> Lamb:
        groups = param_groups(model_with_grads(), 0.01, decay_extra={"adapt": True}, no_decay_extra={"adapt": False})
        return Lamb(groups, lr=1e-3, max_grad_norm=max_grad_norm, kernel=kernel)

    # torch_optimizer.Lamb does no global-norm clipping: "ours" matches that work, "ours+clip" adds ours
    variants = {"ours": ours(0.0), "ours+clip": ours(1.0), "ours (multi-tensor)": ours(0.0, "multi_tensor")}
    adamw = torch.optim.AdamW(param_groups(model_with_grads(), 0.01), lr=1e-3, fused=True)
    variants.update({"ours (foreach)": ours(0.0, "foreach"), "adamw": adamw})
    with contextlib.suppress(ImportError):
        import torch_optimizer

        variants["torch_optimizer"] = torch_optimizer.Lamb(param_groups(model_with_grads(), 0.01), lr=1e-3)
    times = interleaved({name: opt.step for name, opt in variants.items()}, repeats=repeats, warmup=2)
    n_params = sum(p.numel() for p in model_with_grads().parameters())
    medians = ", ".join(f"{name} {median(t) * 1e3:.1f} ms" for name, t in times.items())
    print(f"step time, BERT {n_params / 1e6:.1f}M parameters, 1 thread: {medians}")
    what = "LAMB optimizer step time (ours)"
    if "torch_optimizer" in times:
        say(ratio_line(what, times["ours"], times["torch_optimizer"], "torch_optimizer.Lamb"))
    else:
        venv = "torch_optimizer is not installed in this environment; see docs/optim.md for the separate bench venv"
        print(f"{what} vs torch_optimizer.Lamb: not available ({venv})")
    cache, groups = cache_bytes(), variants["ours"].param_groups
    adapted = [p.numel() for g in groups if g["adapt"] for p in g["params"]]
    plain = sum(p.numel() for g in groups if not g["adapt"] for p in g["params"])
    traffic = lamb_kernel.traffic(adapted, cache) * sum(adapted) + lamb_kernel.ADAMW_BYTES * plain
    cached = sum(n for n in adapted if 12 * n <= cache)
    say(
        f"bytes moved to and from memory per fp32 element: torch fused AdamW {lamb_kernel.ADAMW_BYTES} (one pass); "
        f"ours {traffic / (sum(adapted) + plain):.1f} on this model ({lamb_kernel.ADAMW_BYTES} for a layer whose p, "
        f"m, v stay in the {cache / 2**20:.0f} MiB last-level cache between its two passes: {cached / 1e6:.2f}M of "
        f"the {sum(adapted) / 1e6:.2f}M elements with the trust ratio; {lamb_kernel.TWO_PASS_BYTES} for the rest, and "
        f"under a ZeRO split); two passes' limit {lamb_kernel.TWO_PASS_BYTES / lamb_kernel.ADAMW_BYTES:.2f}x AdamW"
    )
    ratio = median(times["ours"]) / median(times["adamw"])
    # the launching ops of one multi-tensor step (the step on CUDA without apex) as CUDA runs it: without the CPU's
    # reused scratch buffers, which take ``λw`` tensor by tensor (the timings are done: the shadowing stays)
    variants["ours (multi-tensor)"]._scratch_for = lambda params: None
    ops = [name for name, _ in torch_ops(variants["ours (multi-tensor)"].step) if name not in VIEW_OPS]
    passes = [name for name in ops if name.startswith(("_foreach_", "_fused_"))]
    kernel = "fused CPU kernel" if ready else "multi-tensor path: the fused kernel is unavailable"
    multi = "LAMB step (ours, multi-tensor: the step on CUDA without apex, here on torch's CPU fused Adam kernel)"
    launches = f"; per step of the 2 param groups {len(ops)} launching ops, {len(passes)} of them over the parameters"
    lines = {  # variant: (what, baseline, what follows the ratio)
        "ours": (f"LAMB step ({kernel})", " on CPU", f"; target <= {STEP_TARGET}x: {status(ratio <= STEP_TARGET)}"),
        "ours+clip": ("LAMB step (ours, with global-norm clipping)", "", ""),
        "ours (multi-tensor)": (multi, "", f"{launches} ({', '.join(passes)})"),
        "ours (foreach)": ("LAMB step (ours, foreach path: the step before the fused kernels, for reference)", "", ""),
    }
    for name, (what, on_cpu, tail) in lines.items():
        say(ratio_line(what, times[name], times["adamw"], f"torch fused AdamW{on_cpu}") + tail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument  # options without a default take --quick's or the full run's value (QUICK, FULL)
    add("--quick", action="store_true", help="about 4 minutes: batch 32 vs 256, one seed, no grid")
    add("--micro", type=int, default=16, help="sequences per rank per micro-batch")
    add("--factor", type=int, help="large batch = factor × 32 (gradient accumulation); full 32")
    add("--samples", type=int, help="training samples per run")
    add("--eval-samples", type=int, help="evaluate every this many samples (at least every step)")
    add("--target", type=float, help="held-out MLM accuracy to reach")
    add("--seq", type=int, default=64)
    add("--seeds", nargs="+", type=int, help="full: 1 2; quick: 1")
    grids = "none (sqrt-scaled shipped LR), compact (sqrt/linear × (warmup 0.1, β₂ 0.999)/(0.3, 0.95)), full (8 points)"
    add("--grid", choices=["none", "compact", "full"], help=f"large-batch tuning grid per optimizer: {grids}")
    add("--noise-micro-batches", type=int, help="micro-batches per gradient-noise-scale estimate (0: skip); full 32")
    add("--write-presets", action="store_true", help="write ds_configs/bert_large_batch_{adamw,lamb}.json")
    add("--skip-convergence", action="store_true")
    add("--skip-step-time", action="store_true")
    add_record_as(parser, "optim")
    args = parser.parse_args()
    vars(args).update({k: v for k, v in (QUICK if args.quick else FULL).items() if getattr(args, k) is None})
    print(environment_line(), flush=True)
    study = {}
    if not args.skip_convergence:
        with tempfile.TemporaryDirectory(prefix="bench_optim_") as tmp:
            study = convergence_study(args, Path(tmp))
    if not args.skip_step_time:
        step_time_study(repeats=25)
    if CURVES:
        title = f"LAMB vs AdamW at batch 32 and {32 * args.factor}"
        labels = {"xlabel": "training samples", "ylabel": "held-out MLM accuracy"}
        figure("curves", "convergence", title, CURVES, reference=args.target, **labels)
    if study.get("noise"):
        rows = study["noise"]["rows"]
        title = "Gradient noise scale; dashed: what a 1.3x samples ratio at the large batch needs"
        series = [{"label": "B_simple", "x": [r["samples"] for r in rows], "y": [r["b_simple"] for r in rows]}]
        labels = {"xlabel": "training samples (batch 32, AdamW)", "ylabel": "B_simple (sequences)"}
        figure("curves", "noise_scale", title, series, reference=study["noise"]["needed"], **labels)
    columns = ["optimizer", "batch", "lr @ 32", "scaling", "warmup", "β₂", "seed", "samples to target", "best accuracy"]
    runs = f"2 ranks ZeRO 1, small BERT, seq {args.seq}, seeds {args.seeds}, {args.samples} samples per run"
    method = f"target {args.target}, MLPerf-style schedule, LR scaled from batch {REFERENCE_BATCH}, grid {args.grid}"
    tables = ["\n".join(md_table(columns, TABLE))] if TABLE else []
    record(args.record_as, f"{runs}, {method}", tables=tables, study=study)


if __name__ == "__main__":
    main()
