"""Part of section ``lamb_equal``: apex's FusedLAMB, as ds_bertopt builds it for a run with bucket clipping, takes our
LAMB's step on the accelerator (``ds_bertopt.testing.apex_lamb.lamb_runs``; on the CPU dry run its reference stands
in for apex, as in ``tests/test_apex_lamb.py``)."""

from .runner import Ctx


def settings() -> dict:
    """LAMB settings compared: ours by default, and ``ds_configs/mlperf_bert_large.json``'s (no bias correction)."""
    from ds_bertopt.configlib import load_section
    from ds_bertopt.optim import OptimizerConfig

    mlperf = {"type": "lamb", "lr": 2.88293e-3, "betas": [0.88, 0.88], "weight_decay": 0.0166629}
    return {
        "default": load_section(OptimizerConfig, {"type": "lamb", "lr": 0.02}, "optimizer"),
        "mlperf": load_section(OptimizerConfig, {**mlperf, "bias_correction": False}, "optimizer"),
    }


def apex_checks(ctx: Ctx) -> list:
    """``(name, ok, detail)`` per check; empty on CUDA without apex (said in a detail line)."""
    from ds_bertopt import optim
    from ds_bertopt.testing.apex_lamb import lamb_runs, max_relative_gap
    from ds_bertopt.testing.gpu_paths import gradient_part

    if ctx.cuda and optim.apex_fused_lamb() is None:
        ctx.detail("apex: not importable here; apex FusedLAMB not compared (LAMB runs ours)")
        return []
    device = "cuda" if ctx.cuda else "cpu"
    what = "apex FusedLAMB" if ctx.cuda else "apex's CPU reference (no apex on a CPU)"
    out = []
    for label, cfg in settings().items():
        runs = lamb_runs(cfg, device)
        initial, built = runs["initial"], f"{label}: {what} as built (max_grad_norm inf)"
        gap = max_relative_gap(runs["apex"], runs["ours"], initial)
        out.append((f"{built} = ours (1e-4 of the update)", gap < 1e-4, f"gap {gap:.2g} of the largest update"))
        gap = max_relative_gap(runs["apex"], runs["reference"], initial)
        out.append((f"{label}: {what} = its CPU reference (1e-4)", gap < 1e-4, f"gap {gap:.2g}"))
        part = gradient_part(initial, runs["zero_bound"])
        name = f"{label}: control, the 0.0 bound trains on weight decay alone"
        out.append((name, part < 1e-3, f"gradient part {part:.2g}"))
        on_device, buffer = runs["apex_device"].startswith(device), f"overflow buffer on {runs['apex_device']}"
        out.append((f"{label}: apex built on the model's device", on_device, buffer))
    return out
