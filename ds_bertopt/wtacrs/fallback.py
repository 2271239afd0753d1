"""When a preset's recomputation does not pay: the estimated step peak and the preset fallback.

Presets ``exact`` and ``balanced`` rebuild activations in backward; that costs step time (bf16, MiniLM-L6,
16 × 64: 1.37× and 1.44× full) and only pays where activations are a large enough share of the step peak. At small
batches the peak is the optimizer step (weights, gradients, master copies and AdamW state), not the activations, and
recomputation saves nothing there (0.99× of full's peak in the same cell).

Pure part: :func:`activation_bytes` (what one forward keeps for backward, per setup, counted as
``saved_tensor_bytes`` counts it for BERT-family layers), :func:`estimate` (the whole-step peak of full fine-tuning
and of a preset on one device) and :func:`decide` (keep the preset or fall back to full: one rule, one threshold,
``wtacrs.fallback_min_saving``). Glue: :func:`model_shape` (the figures of a model) and :func:`apply_fallback`
and :func:`preset_decision` (what ``ds_bertopt.wtacrs.sizing.resolve_preset``, for the fine-tuning task and
``BertOptTrainer``, and ``ds-bertopt memory`` call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..compat.deepspeed import zero3_numel
from .config import WtaCrsConfig

GiB = 1024**3
FALLBACK_PRESETS = ("exact", "balanced", "auto")
"""The presets that fall back; ``max_saving`` (asked for the largest saving) and explicit kit fields never do."""
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
SETUPS = ("full", "exact", "balanced", "checkpointing", "max_saving")


@dataclass(frozen=True)
class ModelShape:
    """The figures of a BERT-family encoder the estimate needs."""

    hidden: int
    """Hidden width ``h``."""
    layers: int
    """Encoder layers."""
    intermediate: int
    """FFN width (``4h`` in BERT)."""
    heads: int
    """Attention heads."""
    params: int
    """Parameters of the whole model."""
    trainable: int
    """Parameters that get gradients and AdamW state."""
    largest: int
    """Elements of the largest trainable tensor (the word embeddings): AdamW's per-tensor temporaries."""


@dataclass(frozen=True)
class PeakEstimate:
    """Estimated whole-step peak (bytes, one device) of full fine-tuning and of one setup."""

    setup: str
    """The setup estimated against full (``exact``, ``balanced``, …)."""
    states: int
    """Held through the whole step: weights, master weights and AdamW moments."""
    activations: int
    """What full fine-tuning's forward keeps for backward."""
    setup_activations: int
    """What the setup keeps for backward, plus what its backward rebuilds at once (one layer)."""
    optimizer_phase: int
    """Held on top of ``states`` from the end of backward through the optimizer step: gradients (bf16/fp16: and
    their fp32 master copies) and AdamW's per-tensor temporaries."""

    @property
    def peak(self) -> int:
        """Full fine-tuning's peak: the larger of backward's start and the optimizer step."""
        return self.states + max(self.activations, self.optimizer_phase)

    @property
    def setup_peak(self) -> int:
        return self.states + max(self.setup_activations, self.optimizer_phase)

    @property
    def share(self) -> float:
        """Activations' share of full's peak."""
        return self.activations / self.peak

    @property
    def saving(self) -> int:
        """Bytes the setup takes off full's peak."""
        return self.peak - self.setup_peak


def activation_bytes(shape: ModelShape, batch: int, seq: int, precision: str, setup: str) -> int:
    """Bytes one training forward of ``batch`` × ``seq`` keeps for backward under ``setup`` (:data:`SETUPS`), for a
    BERT-family layer run as transformers runs it (eager attention, dropout noise in the activations' dtype): per
    layer 10 token×h tensors (q/k/v input and q, k, v; context; attention-output dropout; both LayerNorms' input and
    the first's output; FFN-output dropout), 2 token×FFN tensors (GELU input and output) and 3 heads×L² (scores,
    dropped probabilities, their noise). ``exact``/``balanced`` keep two LayerNorm outputs, the attention output and
    its log-sum-exp, and rebuild one layer's q/k/v and FFN activations in backward; checkpointing keeps each layer's
    input and rebuilds one whole layer."""
    if setup not in SETUPS:
        raise ValueError(f"activation_bytes: setup {setup!r} is not one of {', '.join(SETUPS)}")
    s, tokens, h = DTYPE_BYTES[precision], batch * seq, shape.hidden
    scores = batch * shape.heads * seq * seq
    full_layer = s * (10 * tokens * h + 2 * tokens * shape.intermediate + 3 * scores)
    kit_layer = s * 3 * tokens * h + 4 * batch * shape.heads * seq  # + the fp32 log-sum-exp
    rebuilt = s * (3 * tokens * h + 2 * tokens * shape.intermediate)  # one layer's q/k/v and FFN, in backward
    embeddings = s * 3 * tokens * h
    if setup == "full":
        return embeddings + shape.layers * full_layer
    if setup in ("exact", "balanced"):
        return s * tokens * h + shape.layers * kit_layer + rebuilt
    layer_input = s * tokens * h
    one_layer = kit_layer + rebuilt if setup == "max_saving" else full_layer
    return embeddings + shape.layers * layer_input + one_layer


def estimate(
    shape: ModelShape,
    batch: int,
    seq: int,
    precision: str,
    setup: str = "exact",
    zero_stage: int = 0,
    world: int = 1,
) -> PeakEstimate:
    """The whole step's peak on one device, full fine-tuning against ``setup``: ``states`` (fp32: weights and two
    AdamW moments; bf16/fp16 as DeepSpeed holds them: low-precision weights, fp32 master weights and moments) plus
    the larger of the forward's activations and the optimizer phase (gradients, bf16/fp16 their fp32 copies, and two
    temporaries of the largest tensor). ZeRO stage 1 partitions master weights and moments over ``world`` ranks,
    stage 2 also gradients, stage 3 also weights."""
    low = precision != "fp32"
    weight_bytes, grad_bytes = (2, 2) if low else (4, 4)
    master = 4 * shape.trainable if low else 0
    share = {stage: (1 / world if zero_stage >= stage else 1.0) for stage in (1, 2, 3)}
    states = weight_bytes * shape.params * share[3] + (master + 8 * shape.trainable) * share[1]
    optimizer_phase = (grad_bytes + (4 if low else 0)) * shape.trainable * share[2] + 2 * 4 * shape.largest * share[1]
    return PeakEstimate(
        setup,
        int(states),
        activation_bytes(shape, batch, seq, precision, "full"),
        activation_bytes(shape, batch, seq, precision, setup),
        int(optimizer_phase),
    )


def decide(estimated: PeakEstimate, min_saving: float) -> bool:
    """Keep the setup (``True``) when it takes at least ``min_saving`` of full's estimated peak off; else full
    fine-tuning is as good for memory and never slower."""
    return estimated.saving >= min_saving * estimated.peak


def decision_line(preset: str, estimated: PeakEstimate, keep: bool, min_saving: float) -> str:
    """The one line a run prints: ``"wtacrs: preset balanced: activations are 21 % of the estimated peak (0.51 GiB);
    recomputation would save ~0.00 GiB (0 % < fallback_min_saving 15 %), so running full"``."""
    fraction = estimated.saving / estimated.peak
    verdict = (
        f"({fraction:.0%} >= fallback_min_saving {min_saving:.0%}), so keeping it"
        if keep
        else f"({fraction:.0%} < fallback_min_saving {min_saving:.0%}), so running full"
        + (" if it fits the budget" if preset == "auto" else "")
    )
    return (
        f"wtacrs: preset {preset}: activations are {estimated.share:.0%} of the estimated peak "
        f"({estimated.peak / GiB:.2f} GiB); recomputation would save ~{estimated.saving / GiB:.2f} GiB {verdict}"
    )


# ---------------------------------------------------------------- glue
def model_shape(model, lora: bool = False) -> ModelShape:
    """The figures of a transformers model (its config's widths, its parameters; a meta-device model will do).
    ``lora``: adapters are trained instead of the weights (no gradient or AdamW state for the base)."""
    config = model.config

    def first(*names: str) -> int:
        return int(next(getattr(config, n) for n in names if getattr(config, n, None) is not None))

    params = list(model.parameters())
    trainable = [zero3_numel(p) for p in params if p.requires_grad and not lora]  # ZeRO-3 loaded: numel() is 0
    return ModelShape(
        hidden=first("hidden_size", "dim"),
        layers=first("num_hidden_layers", "n_layers"),
        intermediate=first("intermediate_size", "hidden_dim"),  # DistilBERT: dim, n_layers, hidden_dim, n_heads
        heads=first("num_attention_heads", "n_heads"),
        params=sum(zero3_numel(p) for p in params),
        trainable=sum(trainable),
        largest=max(trainable, default=0),
    )


def checkpoint_shape(model_dir: str, lora: bool = False) -> ModelShape:
    """:func:`model_shape` of a checkpoint directory's encoder, built on the meta device (no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModel

    with torch.device("meta"):
        return model_shape(AutoModel.from_config(AutoConfig.from_pretrained(model_dir)), lora)


def preset_decision(
    cfg: WtaCrsConfig, shape: ModelShape, batch: int, seq: int, precision: str, zero_stage: int = 0, world: int = 1
) -> Optional[tuple[bool, str]]:
    """``(keep the preset, the line saying why)`` for ``cfg``; ``None`` where nothing falls back (no preset,
    ``max_saving``, or ``fallback_min_saving: 0``). ``auto`` is judged by ``exact``'s saving."""
    if cfg.preset not in FALLBACK_PRESETS or cfg.fallback_min_saving == 0:
        return None
    setup = "exact" if cfg.preset == "auto" else cfg.preset
    estimated = estimate(shape, batch, seq, precision, setup, zero_stage, world)
    keep = decide(estimated, cfg.fallback_min_saving)
    return keep, decision_line(cfg.preset, estimated, keep, cfg.fallback_min_saving)
