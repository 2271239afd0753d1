"""Swapping linears of a (HF BERT-family, optionally PEFT-wrapped) model for sampled ones.

Which linears pay off was measured (MiniLM-L6, 64 × 128): the FFN output projection
(``layer.N.output.dense``) reads the 4h-wide GELU output that nothing else keeps, so sampling it
saves the most (288 → 87 MiB at ratio 0.3). The attention output projection reads the SDPA output,
which attention keeps anyway: sampling it would *add* k rows, so ``auto`` never picks it. q/k/v
and the FFN input projection read a LayerNorm output: worth sampling only when that LayerNorm
does not keep it already (``kit.layernorm_saves_output`` off); q/k/v share one selection.

Group names resolve to the module names of the model's family (:mod:`ds_bertopt.wtacrs.families`:
``ffn.lin2`` in DistilBERT, ``mlp.Wo`` in ModernBERT, …). Call order before ``deepspeed.initialize``:
:func:`prepare_model` does LoRA → kit → :func:`convert`.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

from torch import nn

from ..compat.transformers import attention_implementation
from ..errors import ConfigError
from .config import PRESETS
from .families import GROUPS, Detected, Family, detect, matches, pretrained_base, summarise
from .kit import OutputSavingLayerNorm, install_recompute, kit_parts, report_coverage, swap_modules
from .linear import SampledLinear, feed_context, install_context
from .recompute import feed_scope


def _auto_groups(model: nn.Module) -> list[str]:
    layernorm_keeps_output = any(isinstance(m, OutputSavingLayerNorm) for m in model.modules())
    return ["ffn_out"] + ([] if layernorm_keeps_output else ["qkv", "ffn_in", "lora_A"])


ALL_GROUPS = ("qkv", "attn_out", "ffn_in", "ffn_out", "lora_A")
"""What ``targets: ["all"]`` samples: every linear group (the paper samples every linear layer)."""


def _expand(targets: Sequence[str], model: nn.Module, family: Family) -> list[tuple[str, tuple[str, ...]]]:
    """``[(target as given or the auto/all group, its patterns)]``."""
    out = []
    for target in targets:
        if target == "auto":
            out.extend((f"auto:{group}", family.targets(group)) for group in _auto_groups(model))
        elif target == "all":
            out.extend((f"auto:{group}", family.targets(group)) for group in ALL_GROUPS)
        elif target in GROUPS:
            out.append((target, family.targets(target)))
        else:
            out.append((target, (target,)))
    return out


def resolve_targets(targets: Sequence[str], model: nn.Module) -> tuple[str, ...]:
    """Expand group names and ``auto`` into module-name patterns for ``model`` (per its family)."""
    patterns = [p for _, group in _expand(tuple(targets), model, detect(model).family) for p in group]
    return tuple(dict.fromkeys(patterns))


def _trainable_linears(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if type(m) is nn.Linear and m.weight.requires_grad]


def kept_groups(model: nn.Module, kit=None) -> frozenset:
    """Target groups whose input something else keeps (or rebuilds) for backward anyway, so that a sampled linear
    there keeps a reference to it (``keep: input``) instead of copying k rows: q/k/v, the FFN input projection and
    LoRA's A read a LayerNorm output that an output-saving LayerNorm keeps; the attention output projection reads
    the SDPA output that the flash kernel keeps (attention dropout 0); the FFN output projection reads the
    activation output that ``kit.recompute_ffn`` rebuilds. Read from ``kit`` when given, else from the model."""
    groups = set()
    if kit is not None:
        layernorm, sdpa, ffn = kit.layernorm_saves_output, kit.sdpa_attention, kit.recompute_ffn
    else:
        layernorm = any(isinstance(m, OutputSavingLayerNorm) for m in model.modules())
        sdpa, ffn = None, False
    base = pretrained_base(model)
    config = getattr(base, "config", None)
    if sdpa is None or sdpa:
        keys = detect(model).family.attention.config_dropout
        sdpa = attention_implementation(config) == "sdpa" and all(getattr(config, key, 0.0) == 0.0 for key in keys)
    if layernorm:
        groups |= {"qkv", "ffn_in", "lora_A"}
    if sdpa:
        groups.add("attn_out")
    if ffn:
        groups.add("ffn_out")
    return frozenset(groups)


def _group_of(name: str, family: Family) -> Optional[str]:
    return next((group for group in GROUPS if any(matches(name, p) for p in family.targets(group))), None)


def _convert(
    model: nn.Module,
    ratio: float,
    targets: Sequence[str],
    min_k: int,
    cache_capacity: int,
    detected: Detected,
    keep: str = "auto",
    kit=None,
) -> tuple[list[str], list[tuple[str, str]]]:
    """Swap; return the swapped names and the gaps. Explicit targets matching nothing raise ConfigError."""
    expanded = _expand(tuple(targets), model, detected.family)
    trainable = _trainable_linears(model)
    other_linears = {
        name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and name not in set(trainable)
    }  # frozen, fused or sampled
    gaps: list[tuple[str, str]] = []
    unmatched = []
    for target, patterns in expanded:
        if any(matches(name, p) for name in trainable for p in patterns):
            continue
        others = [name for name in other_linears if any(matches(name, p) for p in patterns)]
        if target.startswith("auto:"):
            group = target[len("auto:") :]
            if not others and group != "lora_A" and not detected.known:
                gaps.append((f"wtacrs.targets auto {group}", f"no linear named like {', '.join(patterns)}"))
            continue  # no LoRA, or the group's linears are frozen (LoRA base) or fused: nothing to sample there
        if others:
            kinds = sorted(
                {
                    type(other_linears[name]).__name__ if other_linears[name].weight.requires_grad else "frozen"
                    for name in others
                }
            )
            gaps.append((f"wtacrs.targets {target}", f"{summarise(others)} is {'/'.join(kinds)}, not sampled"))
            continue
        unmatched.append(target)
    if unmatched:
        raise ConfigError(
            f"wtacrs.targets: {', '.join(repr(t) for t in unmatched)} matched no trainable nn.Linear "
            f"of {type(model).__name__} ({detected.describe()}); its trainable linears: "
            f"{summarise(trainable) or 'none'}"
        )
    patterns = tuple(dict.fromkeys(p for _, group in expanded for p in group))
    context = install_context(model)
    kept = kept_groups(model, kit) if keep == "auto" else frozenset()

    def choose(name: str, module: nn.Module):
        if type(module) is not nn.Linear or not module.weight.requires_grad:
            return None  # a frozen linear keeps no input for backward: nothing to sample
        if not any(matches(name, pattern) for pattern in patterns):
            return None
        keep_input = keep == "input" or _group_of(name, detected.family) in kept
        return SampledLinear.from_linear(
            module, ratio, min_k, context=context, cache_capacity=cache_capacity, keep_input=keep_input
        )

    return swap_modules(model, choose), gaps


def convert(
    model: nn.Module,
    ratio: float = 0.3,
    targets: Iterable[str] = ("auto",),
    min_k: int = 32,
    cache_capacity: int = 0,
    keep: str = "auto",
) -> list[str]:
    """Swap the trainable ``nn.Linear`` modules matching ``targets`` for :class:`SampledLinear`.

    Parameters are shared, not copied, so state dicts and optimizer references are unchanged. The
    padding mask, the host count of non-padding rows and the example ids are read from ``model``'s
    forward keywords (see :func:`~ds_bertopt.wtacrs.linear.install_context`). ``cache_capacity > 0``
    turns on the gradient-norm cache. Returns the names of the swapped modules. A target (group or
    pattern) that matches no trainable linear raises :class:`~ds_bertopt.errors.ConfigError` listing
    the trainable linears of the model.
    """
    names, _ = _convert(model, ratio, tuple(targets), min_k, cache_capacity, detect(model), keep)
    return names


def apply_lora(model: nn.Module, lora) -> nn.Module:
    """Wrap ``model`` in PEFT LoRA adapters per ``lora`` (a :class:`~ds_bertopt.wtacrs.config.LoraConfig`)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import TaskType, get_peft_model

    # the task decides which head PEFT keeps trainable (modules_to_save): classifier, or qa_outputs
    name = type(model).__name__
    task = next(
        (
            t
            for suffix, t in (
                ("ForTokenClassification", TaskType.TOKEN_CLS),
                ("ForQuestionAnswering", TaskType.QUESTION_ANS),
            )
            if name.endswith(suffix)
        ),
        TaskType.SEQ_CLS if hasattr(model, "classifier") else None,
    )
    targets = list(detect(model).family.lora_targets if tuple(lora.targets) == ("auto",) else lora.targets)
    peft_config = PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        task_type=task,
        modules_to_save=task_head_modules(model) or None,
    )
    return get_peft_model(model, peft_config)


def task_head_modules(model: nn.Module) -> list[str]:
    """The modules a transformers task model adds to its base model, with parameters: they are new (or re-initialised)
    and must train under LoRA. PEFT's task types keep only their usual names trainable (``classifier``/``score``,
    ``qa_outputs``), which would leave DistilBERT's ``pre_classifier`` and ModernBERT's ``head`` (and its QA
    ``classifier``) frozen."""
    base = getattr(model, "base_model", None)
    if base is None or base is model:
        return []
    return [
        name for name, child in model.named_children() if child is not base and any(True for _ in child.parameters())
    ]


def run_from(outer: nn.Module, inner: nn.Module) -> None:
    """Let ``outer`` run the prepared ``inner`` without calling ``inner``'s forward (the unpadded wrappers run its base
    model on packed rows): ``outer``'s forward brackets what ``inner``'s would, the sampled linears' batch context
    (:func:`~ds_bertopt.wtacrs.linear.feed_context`) and the recompute scope
    (:func:`~ds_bertopt.wtacrs.recompute.feed_scope`)."""
    feed_context(outer, inner)
    feed_scope(outer, inner)


def prepare_model(model: nn.Module, cfg) -> tuple[nn.Module, list[str]]:
    """LoRA (if on), the kit, then WTA-CRS conversion (if on). Returns the model and log lines.

    Everything the kit or the sampling could not convert in this model's family is named in one
    ``warning:`` line (``cfg.strict``: a :class:`~ds_bertopt.errors.ConfigError` instead).
    """
    if cfg.preset == "auto":
        raise ConfigError(
            'wtacrs.preset: "auto" must be resolved to a setup before the model is prepared '
            "(ds_bertopt.wtacrs.sizing.resolve_auto; the fine-tuning task and BertOptTrainer do)"
        )
    detected = detect(model)
    lines = [f"wtacrs: model family {detected.describe()}"]
    if cfg.lora.enabled:
        model = apply_lora(model, cfg.lora)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        targets = detected.family.lora_targets if tuple(cfg.lora.targets) == ("auto",) else cfg.lora.targets
        lines.append(f"LoRA r={cfg.lora.r} on {', '.join(targets)}: {trainable:,} trainable parameters")
    if cfg.preset is not None:
        lines.append(f"wtacrs: preset {cfg.preset}" + _preset_overrides(cfg))
    kit_lines, gaps = kit_parts(model, cfg.kit, detected)
    lines.extend(kit_lines)
    if cfg.enabled:
        names, target_gaps = _convert(
            model,
            cfg.ratio,
            cfg.targets,
            cfg.min_k,
            cfg.cache_capacity if cfg.grad_norm_cache else 0,
            detected,
            cfg.keep,
            cfg.kit,
        )
        gaps += target_gaps
        kinds = sorted({".".join([part for part in n.split(".") if not part.isdigit()][-2:]) for n in names})
        by_reference = sum(getattr(model.get_submodule(n), "keep_input", False) for n in names)
        lines.append(
            f"WTA-CRS ratio {cfg.ratio}: {len(names)} linears sampled ({', '.join(kinds) or 'none'})"
            + (f"; {by_reference} keep a reference to an input kept anyway" if by_reference else "")
        )
    recompute_lines, recompute_gaps = install_recompute(model, cfg.kit, detected)  # hooks the final modules
    lines.extend(recompute_lines)
    gaps += recompute_gaps
    if cfg.enabled or cfg.kit.any:
        lines.extend(report_coverage(gaps, detected, cfg.strict))
    return model, lines


def _preset_overrides(cfg) -> str:
    """``"; overridden by the config: targets ['auto'] (preset: ['all']), ..."``: fields given next to the preset that
    differ from what it sets (a config file that spells out a field keeps it; the log must say so)."""
    preset = PRESETS[cfg.preset]
    top = {name: value for name, value in preset.items() if name != "kit"}
    differ = [
        (prefix + name, getattr(section, name), value)
        for prefix, section, values in (("", cfg, top), ("kit.", cfg.kit, preset.get("kit", {})))
        for name, value in values.items()
        if name in getattr(section, "_given", ()) and getattr(section, name) != value
    ]
    if not differ:
        return ""
    shown = ", ".join(f"{name} {_show(given)} (preset: {_show(value)})" for name, given, value in differ)
    return f"; overridden by the config: {shown}"


def _show(value) -> str:
    return repr(list(value)) if isinstance(value, tuple) else repr(value)
