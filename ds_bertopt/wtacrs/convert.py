"""Swapping linears of a (HF BERT-family, optionally PEFT-wrapped) model for sampled ones.

Which linears pay off was measured (MiniLM-L6, 64 × 128): the FFN output projection
(``layer.N.output.dense``) reads the 4h-wide GELU output that nothing else keeps, so sampling it
saves the most (288 → 87 MiB at ratio 0.3). The attention output projection reads the SDPA output,
which attention keeps anyway: sampling it would *add* k rows, so ``auto`` never picks it. q/k/v
and the FFN input projection read a LayerNorm output: worth sampling only when that LayerNorm
does not keep it already (``kit.layernorm_saves_output`` off); q/k/v share one selection.

Call order before ``deepspeed.initialize``: :func:`prepare_model` does LoRA → kit → :func:`convert`.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from torch import nn

from .config import TARGET_GROUPS, WtaCrsConfig
from .kit import OutputSavingLayerNorm, apply_kit, swap_modules
from .linear import SampledLinear, install_context


def _matches(name: str, pattern: str) -> bool:
    parts, wanted = name.split("."), pattern.split(".")
    if len(parts) < len(wanted):
        return False
    return all(w == "*" or w == p for w, p in zip(wanted, parts[-len(wanted):]))


def resolve_targets(targets: Sequence[str], model: nn.Module) -> tuple[str, ...]:
    """Expand group names and ``auto`` into module-name patterns for ``model``."""
    layernorm_keeps_input = not any(isinstance(m, OutputSavingLayerNorm) for m in model.modules())
    patterns: list[str] = []
    for target in targets:
        if target == "auto":
            groups = ["ffn_out"] + (["qkv", "ffn_in", "lora_A"] if layernorm_keeps_input else [])
            for group in groups:
                patterns.extend(TARGET_GROUPS[group])
        elif target in TARGET_GROUPS:
            patterns.extend(TARGET_GROUPS[target])
        else:
            patterns.append(target)
    return tuple(dict.fromkeys(patterns))


def convert(model: nn.Module, ratio: float = 0.3, targets: Iterable[str] = ("auto",), min_k: int = 32,
            cache_capacity: int = 0) -> list[str]:
    """Swap the trainable ``nn.Linear`` modules matching ``targets`` for :class:`SampledLinear`.

    Parameters are shared, not copied, so state dicts and optimizer references are unchanged. The
    padding mask and example ids are read from ``model``'s forward keywords (see
    :func:`~ds_bertopt.wtacrs.linear.install_context`). ``cache_capacity > 0`` turns on the
    gradient-norm cache. Returns the names of the swapped modules.
    """
    patterns = resolve_targets(tuple(targets), model)
    context = install_context(model)

    def choose(name: str, module: nn.Module):
        if type(module) is not nn.Linear or not module.weight.requires_grad:
            return None  # a frozen linear keeps no input for backward: nothing to sample
        if not any(_matches(name, pattern) for pattern in patterns):
            return None
        return SampledLinear.from_linear(module, ratio, min_k, context=context, cache_capacity=cache_capacity)

    return swap_modules(model, choose)


def apply_lora(model: nn.Module, lora) -> nn.Module:
    """Wrap ``model`` in PEFT LoRA adapters per ``lora`` (a :class:`~ds_bertopt.wtacrs.config.LoraConfig`)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import TaskType, get_peft_model

    task = TaskType.SEQ_CLS if hasattr(model, "classifier") else None
    peft_config = PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                 target_modules=list(lora.targets), task_type=task)
    return get_peft_model(model, peft_config)


def prepare_model(model: nn.Module, cfg: WtaCrsConfig) -> tuple[nn.Module, list[str]]:
    """LoRA (if on), the kit, then WTA-CRS conversion (if on). Returns the model and log lines."""
    lines = []
    if cfg.lora.enabled:
        model = apply_lora(model, cfg.lora)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        lines.append(f"LoRA r={cfg.lora.r} on {', '.join(cfg.lora.targets)}: {trainable:,} trainable parameters")
    lines.extend(apply_kit(model, cfg.kit))
    if cfg.enabled:
        names = convert(model, cfg.ratio, cfg.targets, cfg.min_k,
                        cfg.cache_capacity if cfg.grad_norm_cache else 0)
        kinds = sorted({".".join(n.split(".")[-2:]) for n in names})
        lines.append(f"WTA-CRS ratio {cfg.ratio}: {len(names)} linears sampled ({', '.join(kinds) or 'none'})")
    return model, lines
