"""Section ``wtacrs``: the sampled linear's fp32/bf16/fp16 paths (unbiased, no host sync, finite steps)."""

import contextlib
import json
import math
import statistics
import sys

from .recorder import SyncRecorder
from .runner import ROOT, SCRIPTS, TINY_BERT, Ctx, Job, Result, brief, judged, run_jobs, test_script


def shipped_wtacrs(**changes):
    """The ``wtacrs`` section of ``ds_configs/finetune_zero0.json`` (kit + WTA@0.3), optionally changed."""
    from ds_bertopt.configlib import load_section, set_dotted
    from ds_bertopt.wtacrs.config import WtaCrsConfig

    raw = json.loads((ROOT / "ds_configs" / "finetune_zero0.json").read_text())["bertopt"]["wtacrs"]
    for key, value in changes.items():
        set_dotted(raw, key, value)
    return load_section(WtaCrsConfig, raw, "wtacrs")


def wtacrs_unbiased(ctx: Ctx, mode: str, draws: int) -> tuple:
    """(bias statistic, finite) of ``SampledLinear``'s weight gradient in ``mode``: fp32, bf16/fp16 autocast over
    fp32 weights, or fp16 weights and inputs (the fp16 path stores rows raw and weights them in fp32)."""
    import torch
    from torch import nn

    from ds_bertopt.wtacrs import SampledLinear

    device = torch.device(ctx.device)
    torch.manual_seed(1)
    d_in, d_out = 48, 40
    sampled = SampledLinear.from_linear(nn.Linear(d_in, d_out).to(device), ratio=0.25, min_k=8)
    gen = torch.Generator().manual_seed(1)
    scale = (1.0 - torch.rand(4, 32, 1, generator=gen)) ** (-1 / 1.3)  # heavy-tailed row norms
    x = (torch.randn(4, 32, d_in, generator=gen) * scale).to(device)
    grad = torch.randn(4, 32, d_out, generator=torch.Generator().manual_seed(2)).to(device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp16-weights": torch.float16}[mode]
    if mode == "fp16-weights":
        sampled, x = sampled.half(), x.half()
    autocast = torch.autocast(device.type, dtype=dtype) if mode in ("bf16", "fp16") else contextlib.nullcontext()
    # exact gradient of the same computation: the inputs as the layer sees them, summed in float64
    exact = grad.to(dtype).double().reshape(-1, d_out).t() @ x.to(dtype).double().reshape(-1, d_in)
    estimates = []
    for _ in range(draws):
        sampled.weight.grad = None
        with autocast:
            out = sampled(x)
        out.backward(grad.to(out.dtype))
        estimates.append(sampled.weight.grad.double())
    stacked = torch.stack(estimates)
    # ‖mean − exact‖² / (Σ elementwise variance / T): about 1 for an unbiased estimator; the tests bound it by 4
    return test_script("wtacrs_common").bias_statistic(stacked, exact), bool(torch.isfinite(stacked).all())


def wtacrs_selection_syncs(ctx: Ctx) -> int:
    """Host syncs of ``SampledLinear`` forward + backward on CUDA (the module claims none)."""
    import torch
    from torch import nn

    from ds_bertopt.wtacrs import SampledLinear

    layer = SampledLinear.from_linear(nn.Linear(64, 64).cuda(), ratio=0.3, min_k=8)
    x = torch.randn(8, 128, 64, device="cuda", requires_grad=True)

    def steps():
        for dtype in (torch.bfloat16, torch.float16, None):
            with torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext():
                layer(x).float().sum().backward()

    steps()  # warm-up: lazy initialisations (cuBLAS handles, kernels) are not what is counted
    recorder = SyncRecorder(cuda=True)
    recorder.start()
    try:
        steps()
    finally:
        recorder.stop()
    for event in recorder.events:
        ctx.detail(f"    sync in SampledLinear step: {event['site']}: {event['line']}")
    return len(recorder.events) + recorder.unattributed


def wtacrs_training(ctx: Ctx, precision: str, steps: int) -> dict:
    """A kit + WTA@0.3 BERT (the shipped finetune_zero0.json section) trained ``steps`` AdamW steps:
    fp16 autocast with ``torch.amp.GradScaler``, or bf16 autocast. A learnable label: first token's parity."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    from bench._common import bert_sizes
    from ds_bertopt.wtacrs import SampledLinear, prepare_model

    hf_logging.set_verbosity_error()
    device = torch.device(ctx.device)
    torch.manual_seed(0)
    sizes = TINY_BERT if ctx.tiny else bert_sizes(256, 4, 4, 1024, vocab_size=2000, max_position_embeddings=128)
    model, _ = prepare_model(BertForSequenceClassification(BertConfig(num_labels=2, **sizes)), shipped_wtacrs(min_k=8))
    sampled = sum(isinstance(m, SampledLinear) for m in model.modules())
    model = model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    batch_size, seq = (4, 16) if ctx.tiny else (32, 96)
    gen = torch.Generator().manual_seed(3)
    losses, scales = [], []
    for _ in range(steps):
        ids = torch.randint(5, sizes["vocab_size"], (batch_size, seq), generator=gen)
        mask = torch.ones_like(ids)
        mask[batch_size // 2 :, seq * 3 // 4 :] = 0  # some padding
        batch = {"input_ids": ids, "attention_mask": mask, "labels": ids[:, 1] % 2}  # a learnable label
        with torch.autocast(device.type, dtype=dtype):
            loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
    values = [float(v) for v in losses]  # one read at the end
    finite_params = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return {"losses": values, "scales": scales, "sampled": sampled, "finite_params": finite_params}


def section_wtacrs(ctx: Ctx) -> Result:
    problems, figures = [], []
    skipped = [] if ctx.cuda else ["fp16", "fp16-weights", "fp16 training"]
    draws = 300 if ctx.tiny else 2000
    for mode in ("fp32", "bf16", "fp16", "fp16-weights") if ctx.cuda else ("fp32", "bf16"):
        try:
            stat, finite = wtacrs_unbiased(ctx, mode, draws)
        except Exception as exc:  # noqa: BLE001 - report and go on
            problems.append(f"{mode} unbiasedness: {brief(exc)}")
            continue
        ok = finite and stat < 4.0
        ctx.detail(
            f"unbiased weight gradient, {mode}: bias statistic {stat:.2f} over {draws} draws (about 1 if unbiased; "
            f"bound 4){'' if finite else ', NON-FINITE estimates'} -> {'ok' if ok else 'FAIL'}"
        )
        figures.append(f"{mode} {stat:.2f}")
        if not ok:
            problems.append(f"{mode}: bias statistic {stat:.2f}{'' if finite else ' (non-finite)'}")
    if ctx.cuda:
        try:
            syncs = wtacrs_selection_syncs(ctx)
            ctx.detail(f"host syncs in SampledLinear forward+backward (bf16, fp16, fp32): {syncs}")
            figures.append(f"{syncs} syncs")
            if syncs:
                problems.append(f"{syncs} host syncs in SampledLinear forward+backward")
        except Exception as exc:  # noqa: BLE001
            problems.append(f"sync check: {brief(exc)}")
    steps = 6 if ctx.tiny else 30
    for precision in ("fp16", "bf16") if ctx.cuda else ("bf16",):
        try:
            run = wtacrs_training(ctx, precision, steps)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{precision} training: {brief(exc)}")
            continue
        losses, scales = run["losses"], run["scales"]
        finite = all(math.isfinite(v) for v in losses) and run["finite_params"]
        # GradScaler: an overflowing step is skipped (its loss may still be finite); a few at the start are normal
        drops = sum(1 for a, b in zip(scales, scales[1:]) if b < a)
        ctx.detail(
            f"{precision} training, {run['sampled']} sampled linears, {steps} steps: loss {losses[0]:.3f} -> "
            f"{statistics.mean(losses[-3:]):.3f} (mean of last 3), all finite {finite}"
            + (f", loss scale {scales[0]:g} -> {scales[-1]:g} ({drops} reductions)" if scales else "")
        )
        figures.append(f"{precision} training {'finite' if finite else 'NON-FINITE'}")
        if not (finite and drops <= 3):
            problems.append(f"{precision} training: finite {finite}, {drops} loss-scale reductions")
    script = SCRIPTS / "wtacrs_cuda_sync_check.py"
    if ctx.cuda and script.exists():
        job = Job(script.stem, [sys.executable, "-u", script], ctx.env(), ctx.dir(f"{script.stem}.log"), 90)
        run_jobs(ctx, [job])
        ctx.detail(f"tests/scripts/wtacrs_cuda_sync_check.py: {job.status()}")
        for line in job.output().splitlines()[-12:]:
            if line.strip():
                ctx.detail(f"    {line.strip()[:200]}")
        if job.started and not job.ok:
            problems.append(f"wtacrs_cuda_sync_check.py {job.status()}")
        figures.append(f"sync script {'ok' if job.ok else job.status()}")
    text = ", ".join(figures) + (f"; SKIPPED(no CUDA): {', '.join(skipped)}" if skipped else "")
    return judged(problems, text, f"bias statistics (bound 4) {text}")
