"""Config of WTA-CRS and the fine-tuning memory kit (``"bertopt": {"wtacrs": {...}}``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Literal, Optional

from ..errors import ConfigError, check

TARGET_GROUPS = {
    # module-name patterns of the BERT family, matched on trailing dotted components ("*" matches one
    # component); each family has its own (ds_bertopt.wtacrs.families), these are the generic fallback
    "ffn_out": ("layer.*.output.dense",),
    "ffn_in": ("intermediate.dense",),
    "qkv": ("attention.self.query", "attention.self.key", "attention.self.value"),
    "attn_out": ("attention.output.dense",),
    "lora_A": ("lora_A.*",),
}
"""Named target groups (BERT patterns); ``"auto"`` picks among them (see
:func:`ds_bertopt.wtacrs.convert.resolve_targets`); a model's family supplies its own patterns."""


KIT_DEFAULTS = {
    "sdpa_attention": False,
    "dropout_mask": "float",
    "layernorm_saves_output": False,
    "recompute_gelu": False,
    "recompute_ffn": False,
    "recompute_qkv": False,
    "bf16_gelu": False,
    "checkpoint_every": 0,
}
"""Built-in values of the kit switches (a field left empty gets its preset's value, else this one)."""


def _fill(section, defaults: dict) -> None:
    """Record which of ``defaults``' fields were given (not ``None``) and fill the others with their defaults."""
    given = frozenset(name for name in defaults if getattr(section, name) is not None)
    for name, value in defaults.items():
        if getattr(section, name) is None:
            object.__setattr__(section, name, value)
    object.__setattr__(section, "_given", given)  # not a field: not in to_dict, equality or the CLI


@dataclass(frozen=True)
class KitConfig:
    sdpa_attention: Optional[bool] = None
    """Use SDPA attention with attention-probability dropout 0 (the flash kernel then saves q, k, v,
    out and the log-sum-exp only). Changes the model: attention dropout is switched off. Default false."""
    dropout_mask: Optional[Literal["float", "bool", "bits", "regenerate"]] = None
    """What hidden dropout keeps for backward: torch's fp32 noise (``float``, the default), a bool mask, a
    bit-packed mask, or only a seed to ``regenerate`` the same mask in backward. All exact."""
    layernorm_saves_output: Optional[bool] = None
    """LayerNorm keeps its output (already kept by the linears it feeds) instead of its input. Exact. Default
    false."""
    layernorm_min_abs_weight: float = 1e-3
    """A LayerNorm with some ``|γ_j|`` below this saves its input instead (backward divides by γ)."""
    recompute_gelu: Optional[bool] = None
    """Fuse the FFN input projection with its GELU; backward recomputes the GELU input from the
    projection's input (kept anyway) instead of storing it. Exact; one extra GEMM per layer. Default false."""
    recompute_ffn: Optional[bool] = None
    """Also rebuild the activation *output* (the FFN output projection's input, 4h wide) in backward from the FFN
    input, sharing the GEMM ``recompute_gelu`` already does: the FFN keeps only its input. Needs
    ``recompute_gelu``. Exact; no further GEMM. Default false."""
    recompute_qkv: Optional[bool] = None
    """The q, k, v that the attention kernel keeps are rebuilt in backward from the projections' input (the
    LayerNorm output, kept anyway): 3 × B·L·h fewer bytes per layer for three h×h GEMMs. Exact. Default false."""
    bf16_gelu: Optional[bool] = None
    """GELU keeps a bf16 copy of its input, derivative computed in place. Approximate (~1e-3
    relative gradient error), hence off by default. Has no effect where ``recompute_gelu`` applies."""
    checkpoint_every: Optional[int] = None
    """transformers' activation checkpointing of every n-th encoder layer
    (``PreTrainedModel.activation_checkpointing_enable(every_n_layers=n)``): those layers keep only their input
    and run their forward again in backward. 0 (the default): off. Exact; costs a forward of those layers."""

    def __post_init__(self) -> None:
        _fill(self, KIT_DEFAULTS)
        check(
            self.layernorm_min_abs_weight >= 0,
            f"layernorm_min_abs_weight: must be >= 0, got {self.layernorm_min_abs_weight}",
        )
        check(
            not self.recompute_ffn or self.recompute_gelu,
            "recompute_ffn: needs recompute_gelu (it rebuilds the output of the fused FFN projection)",
        )
        check(self.checkpoint_every >= 0, f"checkpoint_every: must be >= 0, got {self.checkpoint_every}")

    @property
    def any(self) -> bool:
        """Some part of the kit is on (ds_bertopt.integrations.hf reads this)."""
        return (
            self.sdpa_attention
            or self.dropout_mask != "float"
            or self.layernorm_saves_output
            or self.recompute_gelu
            or self.recompute_qkv
            or self.bf16_gelu
            or self.checkpoint_every > 0
        )


@dataclass(frozen=True)
class LoraConfig:
    enabled: bool = False
    """Fine-tune LoRA adapters (PEFT) instead of all weights; the base model is frozen."""
    r: int = 8
    """Adapter rank."""
    alpha: float = 16.0
    """LoRA scaling numerator (update scaled by ``alpha / r``)."""
    dropout: float = 0.0
    """Dropout on the adapter input (0: none, nothing stored for it)."""
    targets: tuple[str, ...] = ("query", "value")
    """Module names (PEFT ``target_modules``) that get adapters; ``["auto"]``: the query and value
    projections of the model's family (``q_lin``/``v_lin`` in DistilBERT, ``Wqkv`` in ModernBERT, …)."""

    def dead_fields(self) -> dict[str, str]:
        if self.enabled:
            return {}
        return {name: "lora.enabled is false" for name in ("r", "alpha", "dropout", "targets")}

    def __post_init__(self) -> None:
        check(self.r >= 1, f"r: must be at least 1, got {self.r}")
        check(self.alpha > 0, f"alpha: must be positive, got {self.alpha}")
        check(0.0 <= self.dropout < 1.0, f"dropout: must be in [0, 1), got {self.dropout}")
        check(len(self.targets) > 0, "targets: give at least one module name")
        check(
            "auto" not in self.targets or len(self.targets) == 1,
            f"targets: 'auto' stands alone, got {list(self.targets)}",
        )


WTACRS_DEFAULTS = {"enabled": False, "ratio": 0.3, "targets": ("auto",), "min_k": 32}
"""Built-in values of the sampling fields a preset may set."""

_EXACT_KIT = {
    "sdpa_attention": True,
    "dropout_mask": "regenerate",
    "layernorm_saves_output": True,
    "recompute_gelu": True,
    "recompute_ffn": True,
    "recompute_qkv": True,
}
PRESETS: dict[str, dict] = {
    # every exact part: the layers keep their two LayerNorm outputs and the attention output, nothing else
    "exact": {"enabled": False, "kit": dict(_EXACT_KIT)},
    # + WTA-CRS at 0.3 on every linear; the sampled linears keep references to inputs the kit keeps anyway, so the
    # sampling costs no memory and makes the weight-gradient GEMMs 70 % smaller: it pays for the recomputation
    "balanced": {"enabled": True, "ratio": 0.3, "targets": ("all",), "kit": dict(_EXACT_KIT)},
    # + transformers' activation checkpointing of every layer
    "max_saving": {"enabled": True, "ratio": 0.3, "targets": ("all",), "kit": {**_EXACT_KIT, "checkpoint_every": 1}},
}
"""What each ``wtacrs.preset`` sets (measured in ``bench/wtacrs.py --sections frontier``, see docs/wtacrs.md)."""

FALLBACK_MIN_SAVING = 0.15
"""Default ``wtacrs.fallback_min_saving``: a preset must take an estimated 15 % off full fine-tuning's step peak to
be worth its recomputation (MiniLM-L6 16 × 64: 1 % in bf16, 8 % in fp32 measured, for 1.04–1.44× the step time;
64 × 128: 68–70 % for 0.67–0.75×)."""

AUTO_CANDIDATES = ("none", "checkpointing", "exact", "balanced", "max_saving")
"""What ``preset: "auto"`` chooses among: the fields as given without a preset (``none``: full fine-tuning unless
other fields say otherwise), the same with transformers' activation checkpointing of every layer
(``checkpointing``), and each preset (:data:`PRESETS`). Simplest first (how far each departs from full
fine-tuning's math: recomputation in the model's own modules, the kit's exact swaps, sampled gradients): within
``sizing.TIE_MARGIN`` of the fastest, the earlier is chosen (``sizing.choose``)."""


@dataclass(frozen=True)
class WtaCrsConfig:
    preset: Optional[Literal["exact", "balanced", "max_saving", "auto"]] = None
    """A named setting of the sampling and kit fields (``ds_bertopt.wtacrs.config.PRESETS`` lists what each sets):
    ``exact`` — every exact kit part (SDPA without attention dropout, regenerated dropout masks, output-saving
    LayerNorms, FFN and q/k/v rebuilt in backward), no sampling; ``balanced`` — ``exact`` + WTA-CRS at 0.3 on every
    linear (meant to save at least what transformers' activation checkpointing saves at no more than 1.10× the
    step time of full fine-tuning); ``max_saving`` — ``balanced`` + activation checkpointing of every layer (the
    largest saving within 1.35× the step time). A field given next to a preset overrides the preset's value for
    that field (``null`` or leaving it out takes the preset's); fields the preset does not set keep their built-in
    defaults. ``auto`` (needs ``memory_budget``): at start-up each of ``auto_candidates`` is measured at the run's
    micro-batch, sequence length and precision (peak memory and step time), and the fastest whose peak fits the
    budget is used, or a simpler one (``auto_candidates``' order) whose rate is within the tie margin of it
    (``ds_bertopt.wtacrs.sizing.TIE_MARGIN``, 30 %: the run-to-run spread of a measured rate); the log says what
    each measured and why the choice. Empty: no preset."""
    memory_budget: Optional[float] = None
    """Peak memory per device, in GiB, that ``preset: "auto"`` must fit: a fresh process's RSS high-water mark
    above the bare interpreter on CPUs (Linux), ``torch.cuda.max_memory_allocated`` on GPUs; one device running the
    whole model with AdamW (ZeRO only lowers it). Only with ``preset: "auto"``."""
    budget_seq_length: Optional[int] = None
    """Sequence length ``preset: "auto"`` measures at and presets ``exact``/``balanced`` estimate their saving at
    (``fallback_min_saving``). Default: ``finetune.max_seq_length`` in ds_bertopt's own
    fine-tuning; under Hugging Face ``Trainer`` (which does not know its longest batch) the model's
    ``max_position_embeddings``, the safe upper bound — give your longest tokenised length to size tighter."""
    auto_candidates: tuple[str, ...] = AUTO_CANDIDATES
    """The setups ``preset: "auto"`` measures and chooses among: ``none`` (the fields as given, no preset),
    ``checkpointing`` (the same with activation checkpointing of every layer), ``exact``, ``balanced``,
    ``max_saving``, simplest first whatever order they are given in (within the tie margin the simplest wins).
    Fields given next to ``auto`` apply to every candidate (e.g. ``lora.enabled``). Drop ``balanced`` and
    ``max_saving`` to keep gradients exact."""
    fallback_min_saving: float = FALLBACK_MIN_SAVING
    """Presets ``exact``, ``balanced`` and ``auto`` fall back to full fine-tuning (the fields given next to them
    kept) where their estimated saving is below this fraction of full's estimated step peak: there activations are
    too small a share of the peak (at small batches the optimizer step's gradients and AdamW state set it) to pay
    for recomputing them. ``auto`` then measures ``none`` first and takes it if it fits the budget. The estimate:
    ``ds_bertopt.wtacrs.fallback``; the run logs it in one line. 0: never fall back. Kit fields without a preset
    and ``max_saving`` are never overridden."""
    enabled: Optional[bool] = None
    """Swap the target linears for WTA-CRS sampled linears before ``deepspeed.initialize``. Default false."""
    ratio: Optional[float] = None
    """Fraction k/N of non-padding token rows kept for the weight gradient, in (0, 1]. Default 0.3."""
    targets: Optional[tuple[str, ...]] = None
    """Which linears to sample: group names (``ffn_out``, ``ffn_in``, ``qkv``, ``attn_out``,
    ``lora_A``; their module names come from the model's family, see ``ds_bertopt.wtacrs.families``),
    ``all`` (every linear group: the paper's setting), module-name patterns (trailing dotted components, ``*``
    for one component, e.g. ``layer.*.output.dense``), or ``auto`` (the default): ``ffn_out``, plus
    ``qkv``/``ffn_in``/``lora_A`` unless LayerNorms already keep their output (``kit.layernorm_saves_output``).
    Frozen linears are skipped; a group or pattern that matches no trainable linear is an error naming the
    linears there are (``auto`` and ``all`` skip groups the kit fused or LoRA froze)."""
    min_k: Optional[int] = None
    """Keep at least this many rows. Default 32."""
    keep: Literal["auto", "rows", "input"] = "auto"
    """What a sampled linear keeps for backward: a copy of its ``k`` rows (``rows``, the paper's), or a reference
    to its whole input, from which backward gathers the same rows (``input``: free when something else keeps that
    input anyway, the whole input otherwise). ``auto``: ``input`` where the kit keeps or rebuilds the input anyway
    (q/k/v, FFN input and LoRA A behind an output-saving LayerNorm, the attention output projection behind SDPA, the
    FFN output projection under ``recompute_ffn``), ``rows`` elsewhere. Same gradient either way."""
    grad_norm_cache: bool = False
    """Weight row probabilities by ‖∇y_i‖ from the example's previous visit (the paper's cache);
    needs ``wtacrs_example_ids`` in the forward call (the fine-tuning loop passes it)."""
    cache_capacity: int = 16384
    """Examples the gradient-norm cache holds per sampled layer (bf16, × longest sequence)."""
    kit: KitConfig = field(default_factory=KitConfig)
    """The exact (and approximate) memory-saving module swaps (see ``ds_bertopt.wtacrs.kit``)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters via PEFT."""
    strict: bool = False
    """Coverage is an error: a module that the kit or WTA-CRS cannot convert in this model's family
    (an attention without an SDPA path, a non-``nn.LayerNorm`` norm, an unknown family, …) raises a
    ``ConfigError`` instead of the one ``warning:`` line naming it."""

    def dead_fields(self) -> dict[str, str]:
        """Fields nothing reads under the rest of the section, judged after the preset filled it (with ``preset:
        "auto"`` every candidate's settings count)."""
        dead = {}
        auto = self.preset == "auto"
        if not auto:
            dead["auto_candidates"] = f'only preset "auto" measures candidates (preset is {json.dumps(self.preset)})'
        if self.preset not in ("exact", "balanced", "auto"):
            why = f'only presets "exact", "balanced" and "auto" fall back (preset is {json.dumps(self.preset)})'
            dead.update(budget_seq_length=why, fallback_min_saving=why)
        if not self.enabled and not auto:
            for name in ("ratio", "targets", "min_k", "keep", "grad_norm_cache", "cache_capacity"):
                dead[name] = "wtacrs.enabled is false: no linear is sampled"
        elif not self.grad_norm_cache:
            dead["cache_capacity"] = "grad_norm_cache is false"
        if not self.kit.layernorm_saves_output and not auto:
            dead["kit.layernorm_min_abs_weight"] = "kit.layernorm_saves_output is false"
        return dead

    def __post_init__(self) -> None:
        preset = PRESETS.get(self.preset, {}) if self.preset is not None else {}
        check(
            self.preset in (None, "auto") or self.preset in PRESETS,
            f"preset: {self.preset!r} is not one of {', '.join(PRESETS)}, auto",
        )
        given = frozenset(name for name in WTACRS_DEFAULTS if getattr(self, name) is not None)
        for name, value in preset.items():  # the preset fills what was not given
            if name != "kit" and getattr(self, name) is None:
                object.__setattr__(self, name, value)
        _fill(self, WTACRS_DEFAULTS)
        object.__setattr__(self, "_given", given)  # as the user gave them (the fallback keeps only these)
        if preset.get("kit"):
            kit_given = getattr(self.kit, "_given", frozenset())
            merged = {f.name: getattr(self.kit, f.name) for f in fields(KitConfig)}
            merged.update({name: value for name, value in preset["kit"].items() if name not in kit_given})
            try:
                kit = KitConfig(**merged)
            except ConfigError as exc:
                raise ConfigError(f"kit.{exc} (with preset {self.preset!r})") from None
            object.__setattr__(kit, "_given", kit_given)
            object.__setattr__(self, "kit", kit)
        check(0.0 < self.ratio <= 1.0, f"ratio: must be in (0, 1], got {self.ratio}")
        check(self.min_k >= 1, f"min_k: must be at least 1, got {self.min_k}")
        check(len(self.targets) > 0, "targets: give at least one group name or module-name pattern")
        for target in self.targets:
            check(
                target in ("auto", "all")
                or target in TARGET_GROUPS
                or (target and all(part for part in target.split("."))),
                f"targets: {target!r} is neither auto, all, a group ({', '.join(TARGET_GROUPS)}) "
                f"nor a dotted module-name pattern",
            )
        check(
            len(self.targets) == 1 or not {"auto", "all"} & set(self.targets),
            f"targets: 'auto' and 'all' stand alone, got {list(self.targets)}",
        )
        check(self.cache_capacity >= 1, f"cache_capacity: must be at least 1, got {self.cache_capacity}")
        if self.preset == "auto":
            check(
                self.memory_budget is not None,
                'preset: "auto" needs memory_budget (GiB per device) to size the setup to',
            )
        else:
            check(
                self.memory_budget is None,
                f'memory_budget: only used with preset "auto" (preset is {self.preset!r})',
            )
        check(
            self.memory_budget is None or self.memory_budget > 0,
            f"memory_budget: must be a positive number of GiB, got {self.memory_budget}",
        )
        check(
            self.budget_seq_length is None or self.budget_seq_length >= 1,
            f"budget_seq_length: must be at least 1, got {self.budget_seq_length}",
        )
        check(
            0.0 <= self.fallback_min_saving < 1.0,
            f"fallback_min_saving: must be in [0, 1), got {self.fallback_min_saving}",
        )
        check(len(self.auto_candidates) > 0, "auto_candidates: give at least one")
        for name in self.auto_candidates:
            check(name in AUTO_CANDIDATES, f"auto_candidates: {name!r} is not one of {', '.join(AUTO_CANDIDATES)}")
