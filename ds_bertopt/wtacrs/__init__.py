"""WTA-CRS sampled linears and the fine-tuning memory kit (see ``docs/wtacrs.md``).

* :mod:`.estimator` — the pure estimator (row probabilities, winner rule, sampling, weights).
* :mod:`.linear` — :class:`SampledLinear` (drop-in ``nn.Linear``) and its batch context.
* :mod:`.kit` — exact memory-saving module swaps (SDPA, compact dropout masks, LayerNorm saving its
  output, recomputed / bf16-stored GELU input, fused GeGLU).
* :mod:`.families` — where those parts live in each BERT-family architecture of transformers.
* :mod:`.convert` — :func:`convert` (swap target linears), :func:`prepare_model` (LoRA → kit → convert).
* :mod:`.memory` — saved-for-backward accounting and step-peak measurement.
"""

from .convert import apply_lora, convert, prepare_model, resolve_targets, run_from
from .estimator import RowSelection, budget, row_probabilities, select_rows, weight_gradient
from .families import FAMILIES, Family, detect
from .kit import (
    Bf16InputGelu,
    CompactDropout,
    GammaGuard,
    GatedFfn,
    GatedLinear,
    GeluLinear,
    OutputSavingLayerNorm,
    apply_kit,
    fuse_gelu_linears,
)
from .linear import (
    EXAMPLE_IDS_KWARG,
    NUM_VALID_ROWS_KWARG,
    PACKED_INDEX_KWARG,
    BatchContext,
    SampledLinear,
    install_context,
)
from .memory import estimate_saving, saved_tensor_bytes

__all__ = [
    "EXAMPLE_IDS_KWARG",
    "FAMILIES",
    "NUM_VALID_ROWS_KWARG",
    "PACKED_INDEX_KWARG",
    "BatchContext",
    "Bf16InputGelu",
    "CompactDropout",
    "Family",
    "GammaGuard",
    "GatedFfn",
    "GatedLinear",
    "GeluLinear",
    "OutputSavingLayerNorm",
    "RowSelection",
    "SampledLinear",
    "apply_kit",
    "apply_lora",
    "budget",
    "convert",
    "detect",
    "estimate_saving",
    "fuse_gelu_linears",
    "install_context",
    "prepare_model",
    "resolve_targets",
    "run_from",
    "row_probabilities",
    "saved_tensor_bytes",
    "select_rows",
    "weight_gradient",
]
