"""``bench/optim.py``'s pieces: the study's points and results, the noise-scale study, presets, step time."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import bert_overrides, bert_sizes, checkpoint_weights, interleaved, median, ratio_line, say, status

DATA = ROOT.parent / "shared" / "data" / "wiki_sample.jsonl"
SMALL_MODEL = bert_overrides(128, 2, 2, 512)
CONFIGS = {"lamb": "bert_lamb.json", "adamw": "bert_adam.json"}
SHIPPED_LR = {"lamb": 5e-3, "adamw": 1e-3}
"""Peak LRs at batch 32 (``bert_lamb.json`` / ``bert_adam.json``, tuned at reference batch 32)."""
REFERENCE_BATCH = 32


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
        return (
            f"{self.optimizer} batch {self.batch}: lr {self.lr:g}@32 {self.scaling}, "
            f"warmup {self.warmup_fraction:g}, β₂ {self.beta2:g}"
        )

    def overrides(self, micro: int, world: int) -> list[str]:
        return [
            f"deepspeed.train_micro_batch_size_per_gpu={micro}",
            f"deepspeed.gradient_accumulation_steps={self.batch // (micro * world)}",
            f"optimizer.lr={self.lr!r}",
            f"optimizer.betas=[0.9, {self.beta2!r}]",
            f'schedule.scaling="{self.scaling}"',
            f"schedule.reference_batch={REFERENCE_BATCH}",
            f"schedule.warmup_fraction={self.warmup_fraction!r}",
            'schedule.type="poly"',
            "schedule.power=1.0",
            "schedule.end_lr_ratio=0.0",
            'schedule.decay_from="step0"',
        ]


def grid(optimizer: str, batch: int, kind: str) -> list[Point]:
    """The large-batch tuning grid: LR scaling rule × warmup × β₂ (``compact``: two (warmup, β₂) pairs)."""
    pairs = [(0.1, 0.999), (0.3, 0.95)] if kind == "compact" else [(w, b) for w in (0.1, 0.3) for b in (0.999, 0.95)]
    return [
        Point(optimizer, batch, SHIPPED_LR[optimizer], scaling, warmup, beta2)
        for scaling in ("sqrt", "linear")
        for warmup, beta2 in pairs
    ]


@dataclass
class Result:
    point: Point
    records: list
    diverged: bool
    minutes: float

    @property
    def evals(self) -> list[dict]:
        return [r for r in self.records if "eval_accuracy" in r]

    @property
    def best(self) -> float:
        return max((r["eval_accuracy"] for r in self.evals), default=0.0)

    def samples_to(self, target: float) -> float:
        """Samples at the first crossing of ``target``, linearly interpolated between evaluations; inf if never."""
        evals = self.evals
        for i, record in enumerate(evals):
            if record["eval_accuracy"] >= target:
                if i == 0:
                    return record["step"] * self.point.batch
                a0, a1 = evals[i - 1]["eval_accuracy"], record["eval_accuracy"]
                s0, s1 = evals[i - 1]["step"], record["step"]
                return (s0 + (target - a0) / (a1 - a0) * (s1 - s0)) * self.point.batch
        return math.inf


# ------------------------------------------------------------------------------------------------
# gradient noise scale
# ------------------------------------------------------------------------------------------------
def noise_scale(model, batches: list[dict], micro: int) -> tuple[float, float, float]:
    """``(B_simple, |G|², tr Σ)`` from per-micro-batch gradients (McCandlish et al. 2018, App. A.1): with
    ``|G_b|²`` the mean squared norm of single micro-batch gradients (``b`` sequences) and ``|G_B|²`` that of their
    mean (``B = K·b``), ``|G|² ≈ (B|G_B|² − b|G_b|²)/(B − b)`` and
    ``tr Σ ≈ (|G_b|² − |G_B|²)/(1/b − 1/B)``."""
    import torch

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
    k = len(batches)
    small_sq /= k
    big_sq = float((total / k) @ (total / k))
    b, big = float(micro), float(micro * k)
    g2 = (big * big_sq - b * small_sq) / (big - b)
    trace = (small_sq - big_sq) / (1 / b - 1 / big)
    return trace / g2, g2, trace


def noise_study(checkpoints: Path, reference: Result, args, small: int, large: int) -> Optional[dict]:
    """B_simple on the batch-32 AdamW run's checkpoints; the samples ratio it predicts for ``large`` vs ``small``."""
    import numpy as np
    import torch

    from ds_bertopt.config import load_config
    from ds_bertopt.data.collate import MLMCollator, step_generator
    from ds_bertopt.data.pipeline import build_pretrain_data
    from ds_bertopt.model.bert import build_pretraining_model

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    overrides = [*SMALL_MODEL, f"data.train_files={json.dumps([str(DATA)])}", f"data.max_seq_length={args.seq}"]
    cfg = load_config(str(ROOT / "ds_configs" / CONFIGS["adamw"]), overrides).bertopt
    data = build_pretrain_data(cfg)
    collator = MLMCollator(
        data.tokenizer,
        mlm_probability=cfg.data.mlm_probability,
        pad_multiple=8,
        max_length=cfg.model.max_position_embeddings,
    )
    rng = np.random.default_rng(0)
    batches = []
    for k in range(args.noise_micro_batches):
        rows = data.train[[int(i) for i in rng.choice(len(data.train), args.micro, replace=False)]]
        samples = [
            {"input_ids": ids, "token_type_ids": types} for ids, types in zip(rows["input_ids"], rows["token_type_ids"])
        ]
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
        rows.append(
            {
                "step": step,
                "samples": step * small,
                "b_simple": b_simple,
                "g2": g2,
                "trace": trace,
                "predicted_ratio": predicted,
                "accuracy": accuracy.get(near),
            }
        )
        print(
            f"  noise scale at step {step} ({step * small} samples, accuracy {accuracy.get(near, math.nan):.4f}): "
            f"B_simple {b_simple:,.0f} sequences (|G|² {g2:.3g}, tr Σ {trace:.3g}); predicted samples ratio batch "
            f"{large} / {small}: {predicted:.2f}",
            flush=True,
        )
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


# ------------------------------------------------------------------------------------------------
# presets
# ------------------------------------------------------------------------------------------------
def preset(point: Point, args) -> dict:
    """The DeepSpeed JSON of a large-batch preset: the study's model, data and chosen optimizer/schedule."""
    base = json.loads((ROOT / "ds_configs" / CONFIGS[point.optimizer]).read_text())
    accumulation = point.batch // (args.micro * 2)
    name = f"bert_large_batch_{point.optimizer}"
    config = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": accumulation,
        **{k: base[k] for k in ("gradient_clipping", "zero_allow_untested_optimizer") if k in base},
        "steps_per_print": 1000000,
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": 1},
        "csv_monitor": {"enabled": True, "job_name": name},
    }
    optimizer = {**base["bertopt"]["optimizer"], "lr": point.lr, "betas": [0.9, point.beta2]}
    config["bertopt"] = {
        "model": bert_sizes(128, 2, 2, 512, max_position_embeddings=512, objective="mlm"),
        "data": {"max_seq_length": args.seq},
        "train": {
            "max_steps": max(1, args.samples // point.batch),
            "eval_every": max(1, args.eval_samples // point.batch),
            "log_every": 1,
            "output_dir": f"runs/{name}",
        },
        "optimizer": optimizer,
        "schedule": {
            "type": "poly",
            "warmup_fraction": point.warmup_fraction,
            "power": 1.0,
            "end_lr_ratio": 0.0,
            "decay_from": "step0",
            "scaling": point.scaling,
            "reference_batch": REFERENCE_BATCH,
        },
    }
    return config


def format_config(config: dict, width: int = 116) -> str:
    """The house layout of ds_configs/*.json: one line per top-level key and per ``bertopt`` section, long
    sections wrapped under their first key."""
    lines = ["{"]
    items = list(config.items())
    for i, (key, value) in enumerate(items):
        comma = "," if i < len(items) - 1 else ""
        if key != "bertopt":
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}{comma}")
            continue
        lines.append('  "bertopt": {')
        sections = list(value.items())
        for j, (section, body) in enumerate(sections):
            head = f"    {json.dumps(section)}: {{"
            line, indent = head, " " * len(head)
            fields = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in body.items()]
            for n, text in enumerate(fields):
                text += "," if n < len(fields) - 1 else "}" + ("," if j < len(sections) - 1 else "")
                if line not in (head,) and len(line) + 1 + len(text) > width:
                    lines.append(line)
                    line = indent + text
                else:
                    line += ("" if line == head else " ") + text
            lines.append(line)
        lines.append(f"  }}{comma}")
    return "\n".join(lines + ["}"]) + "\n"


def write_preset(point: Point, args) -> Path:
    path = ROOT / "ds_configs" / f"bert_large_batch_{point.optimizer}.json"
    path.write_text(format_config(preset(point, args)))
    return path


STEP_TARGET = 1.45
"""The issue's target: our LAMB step ≤ 1.45× torch's fused AdamW on CPU, near the traffic limit of two passes
(40 bytes an element against AdamW's 28: 1.43×)."""


def cache_bytes() -> int:
    """The last-level cache of this CPU (bytes; 0 when the system does not say)."""
    for name in ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            size = os.sysconf(name)
        except (ValueError, OSError):
            size = 0
        if size > 0:
            return size
    for index in (3, 2):
        try:
            text = Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        return int(text.rstrip("KMG")) * unit
    return 0


def multi_tensor_ops(lamb) -> list[str]:
    """The launching torch ops of one step of ``lamb`` (its multi-tensor path, the step on CUDA without apex), counted
    as CUDA runs it: without the CPU's reused scratch buffers, which take ``λw`` tensor by tensor."""
    from ds_bertopt.testing.measure import VIEW_OPS, torch_ops

    lamb._scratch_for = lambda params: None  # shadows the method for this count only
    try:
        return [name for name, _ in torch_ops(lamb.step) if name not in VIEW_OPS]
    finally:
        del lamb._scratch_for


def step_time_study(repeats: int) -> None:
    import torch
    from transformers import BertConfig, BertForMaskedLM

    from ds_bertopt.optim import lamb_kernel, param_groups
    from ds_bertopt.optim.lamb import Lamb

    torch.set_num_threads(1)
    started = time.perf_counter()
    ready = lamb_kernel.library() is not None
    print(
        f"fused CPU LAMB kernel: ready in {time.perf_counter() - started:.3f} s (built once per machine, then loaded)"
        if ready
        else f"fused CPU LAMB kernel: unavailable ({lamb_kernel.unavailable_reason()}); ours runs the multi-tensor path"
    )

    def model_with_grads():
        torch.manual_seed(0)
        model = BertForMaskedLM(BertConfig(**bert_sizes(256, 4, 4, 1024, vocab_size=8192)))
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-2
        return model

    n_params = sum(p.numel() for p in model_with_grads().parameters())

    def ours(max_grad_norm: float, kernel: str = "auto") -> Lamb:
        return Lamb(
            param_groups(model_with_grads(), 0.01, decay_extra={"adapt": True}, no_decay_extra={"adapt": False}),
            lr=1e-3,
            max_grad_norm=max_grad_norm,
            kernel=kernel,
        )

    # torch_optimizer.Lamb does no global-norm clipping: "ours" matches that work, "ours+clip" adds ours.
    # "ours (multi-tensor)": the step LAMB takes on CUDA without apex, here on torch's CPU fused Adam kernel.
    # "ours (foreach)": the torch._foreach_* path, the step before the fused kernels.
    variants = {
        "ours": ours(0.0),
        "ours+clip": ours(1.0),
        "ours (multi-tensor)": ours(0.0, "multi_tensor"),
        "ours (foreach)": ours(0.0, "foreach"),
        "adamw": torch.optim.AdamW(param_groups(model_with_grads(), 0.01), lr=1e-3, fused=True),
    }
    try:
        import torch_optimizer

        variants["torch_optimizer"] = torch_optimizer.Lamb(param_groups(model_with_grads(), 0.01), lr=1e-3)
    except ImportError:
        pass
    times = interleaved({name: opt.step for name, opt in variants.items()}, repeats=repeats, warmup=2)
    print(
        f"step time, BERT {n_params / 1e6:.1f}M parameters, 1 thread: "
        + ", ".join(f"{name} {median(t) * 1e3:.1f} ms" for name, t in times.items())
    )
    if "torch_optimizer" in times:
        say(
            ratio_line(
                "LAMB optimizer step time (ours)", times["ours"], times["torch_optimizer"], "torch_optimizer.Lamb"
            )
        )
    else:
        print(
            "LAMB optimizer step time (ours) vs torch_optimizer.Lamb: not available (torch_optimizer is not "
            "installed in this environment; see docs/optim.md for the separate bench venv)"
        )
    cache = cache_bytes()
    adapted = [p.numel() for g in variants["ours"].param_groups if g["adapt"] for p in g["params"]]
    plain = sum(p.numel() for g in variants["ours"].param_groups if not g["adapt"] for p in g["params"])
    ours_bytes = (lamb_kernel.traffic(adapted, cache) * sum(adapted) + lamb_kernel.ADAMW_BYTES * plain) / (
        sum(adapted) + plain
    )
    cached = sum(n for n in adapted if 12 * n <= cache)
    say(
        f"bytes moved to and from memory per fp32 element: torch fused AdamW {lamb_kernel.ADAMW_BYTES} (one pass); "
        f"ours {ours_bytes:.1f} on this model ({lamb_kernel.ADAMW_BYTES} for a layer whose p, m, v stay in the "
        f"{cache / 2**20:.0f} MiB last-level cache between its two passes: {cached / 1e6:.2f}M of the "
        f"{sum(adapted) / 1e6:.2f}M elements with the trust ratio; {lamb_kernel.TWO_PASS_BYTES} for the rest, and "
        f"under a ZeRO split); two passes' limit {lamb_kernel.TWO_PASS_BYTES / lamb_kernel.ADAMW_BYTES:.2f}x AdamW"
    )
    ratio = median(times["ours"]) / median(times["adamw"])
    kernel = "fused CPU kernel" if ready else "multi-tensor path: the fused kernel is unavailable"
    say(
        ratio_line(f"LAMB step ({kernel})", times["ours"], times["adamw"], "torch fused AdamW on CPU")
        + f"; target <= {STEP_TARGET}x: {status(ratio <= STEP_TARGET)}"
    )
    say(
        ratio_line(
            "LAMB step (ours, with global-norm clipping)", times["ours+clip"], times["adamw"], "torch fused AdamW"
        )
    )
    ops = multi_tensor_ops(variants["ours (multi-tensor)"])
    passes = [name for name in ops if name.startswith(("_foreach_", "_fused_"))]
    say(
        ratio_line(
            "LAMB step (ours, multi-tensor: the step on CUDA without apex, here on torch's CPU fused Adam kernel)",
            times["ours (multi-tensor)"],
            times["adamw"],
            "torch fused AdamW",
        )
        + f"; per step of the 2 param groups {len(ops)} launching ops, {len(passes)} of them over the parameters "
        f"({', '.join(passes)})"
    )
    say(
        ratio_line(
            "LAMB step (ours, foreach path: the step before the fused kernels, for reference)",
            times["ours (foreach)"],
            times["adamw"],
            "torch fused AdamW",
        )
    )
