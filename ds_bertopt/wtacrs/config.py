"""Config of WTA-CRS and the fine-tuning memory kit (``"bertopt": {"wtacrs": {...}}``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import check

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


@dataclass(frozen=True)
class KitConfig:
    sdpa_attention: bool = False
    """Use SDPA attention with attention-probability dropout 0 (the flash kernel then saves q, k, v,
    out and the log-sum-exp only). Changes the model: attention dropout is switched off."""
    dropout_mask: Literal["float", "bool", "bits", "regenerate"] = "float"
    """What hidden dropout keeps for backward: torch's fp32 noise (``float``), a bool mask, a
    bit-packed mask, or only a seed to ``regenerate`` the same mask in backward. All exact."""
    layernorm_saves_output: bool = False
    """LayerNorm keeps its output (already kept by the linears it feeds) instead of its input. Exact."""
    layernorm_min_abs_weight: float = 1e-3
    """A LayerNorm with some ``|γ_j|`` below this saves its input instead (backward divides by γ)."""
    recompute_gelu: bool = False
    """Fuse the FFN input projection with its GELU; backward recomputes the GELU input from the
    projection's input (kept anyway) instead of storing it. Exact; one extra GEMM per layer."""
    bf16_gelu: bool = False
    """GELU keeps a bf16 copy of its input, derivative computed in place. Approximate (~1e-3
    relative gradient error), hence off by default. Has no effect where ``recompute_gelu`` applies."""

    def __post_init__(self) -> None:
        check(self.layernorm_min_abs_weight >= 0,
              f"layernorm_min_abs_weight: must be >= 0, got {self.layernorm_min_abs_weight}")

    @property
    def any(self) -> bool:
        """Some part of the kit is on (ds_bertopt.integrations.hf reads this)."""
        return (self.sdpa_attention or self.dropout_mask != "float" or self.layernorm_saves_output
                or self.recompute_gelu or self.bf16_gelu)


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

    def __post_init__(self) -> None:
        check(self.r >= 1, f"r: must be at least 1, got {self.r}")
        check(self.alpha > 0, f"alpha: must be positive, got {self.alpha}")
        check(0.0 <= self.dropout < 1.0, f"dropout: must be in [0, 1), got {self.dropout}")
        check(len(self.targets) > 0, "targets: give at least one module name")
        check("auto" not in self.targets or len(self.targets) == 1,
              f"targets: 'auto' stands alone, got {list(self.targets)}")


@dataclass(frozen=True)
class WtaCrsConfig:
    enabled: bool = False
    """Swap the target linears for WTA-CRS sampled linears before ``deepspeed.initialize``."""
    ratio: float = 0.3
    """Fraction k/N of non-padding token rows kept for the weight gradient, in (0, 1]."""
    targets: tuple[str, ...] = ("auto",)
    """Which linears to sample: group names (``ffn_out``, ``ffn_in``, ``qkv``, ``attn_out``,
    ``lora_A``; their module names come from the model's family, see ``ds_bertopt.wtacrs.families``),
    module-name patterns (trailing dotted components, ``*`` for one component, e.g.
    ``layer.*.output.dense``), or ``auto``: ``ffn_out``, plus ``qkv``/``ffn_in``/``lora_A`` unless
    LayerNorms already keep their output (``kit.layernorm_saves_output``). Frozen linears are skipped;
    a group or pattern that matches no trainable linear is an error naming the linears there are."""
    min_k: int = 32
    """Keep at least this many rows."""
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

    def __post_init__(self) -> None:
        check(0.0 < self.ratio <= 1.0, f"ratio: must be in (0, 1], got {self.ratio}")
        check(self.min_k >= 1, f"min_k: must be at least 1, got {self.min_k}")
        check(len(self.targets) > 0, "targets: give at least one group name or module-name pattern")
        for target in self.targets:
            check(target == "auto" or target in TARGET_GROUPS or
                  (target and all(part for part in target.split("."))),
                  f"targets: {target!r} is neither auto, a group ({', '.join(TARGET_GROUPS)}) "
                  f"nor a dotted module-name pattern")
        check(self.cache_capacity >= 1, f"cache_capacity: must be at least 1, got {self.cache_capacity}")
