"""Where the parts the kit and WTA-CRS touch live in each BERT-family model of transformers.

One :class:`Family` per architecture (read from the ``modeling_*.py`` of transformers 5.24): which
module is the self-attention and how its attention-probability dropout is given (an ``nn.Dropout``
whose ``p`` is passed to ``ALL_ATTENTION_FUNCTIONS``, a float attribute, or a module called on the
probabilities of an eager-only attention), whether transformers can run it through SDPA at all,
the FFN's input projection + activation (a plain GELU-family activation or ModernBERT's GeGLU), and
the module-name patterns of the WTA-CRS target groups. LayerNorms (every ``nn.LayerNorm``) and
hidden dropouts (every other ``nn.Dropout``) need no per-family entry.

Patterns match trailing dotted components of a module name, ``*`` one component (as in
``wtacrs.targets``). A model type not listed here gets :data:`GENERIC` (the BERT patterns, used
where they match); :func:`detect` says so, and the kit names what it could not convert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn

GROUPS = ("ffn_out", "ffn_in", "qkv", "attn_out", "lora_A")
"""Target group names (``wtacrs.targets``); patterns come from the model's :class:`Family`."""


@dataclass(frozen=True)
class Attention:
    module: str
    """Pattern of the self-attention module (the one that holds q/k/v and calls the kernel)."""
    prob_dropout: Optional[str]
    """Attribute of that module giving the attention-probability dropout: an ``nn.Dropout`` (its ``p``
    is what counts) or a float; ``None`` if it has none."""
    prob_dropout_called: bool = False
    """The probability dropout module is *called* on the probabilities (eager-only attention), so the
    dropout kit part can give it a compact mask; otherwise only its ``p`` is read."""
    sdpa_blocker: Optional[str] = None
    """Why transformers cannot run this attention through SDPA; ``None``: it can (``set_attn_implementation``)."""
    config_dropout: tuple[str, ...] = ("attention_probs_dropout_prob",)
    """Config attributes holding the attention-probability dropout (zeroed with the modules)."""


@dataclass(frozen=True)
class Ffn:
    module: str
    """Pattern of the module owning the FFN input projection and its activation."""
    linear: str
    """Attribute of that module: the input projection (``nn.Linear``)."""
    activation: str
    """Attribute of that module: the activation applied to the projection's output."""
    gated: bool = False
    """GeGLU (ModernBERT): the projection's output splits into ``(input, gate)`` halves and the module
    returns ``output(dropout(act(input) * gate))``; the whole module is then swapped."""
    dropout: Optional[str] = None
    """Gated only: the dropout attribute applied to ``act(input) * gate``."""
    output: Optional[str] = None
    """Gated only: the FFN output projection attribute."""


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    """``config.model_type`` values of this family."""
    attention: Attention
    ffn: Ffn
    qkv: tuple[str, ...]
    attn_out: tuple[str, ...]
    ffn_in: tuple[str, ...]
    ffn_out: tuple[str, ...]
    lora_targets: tuple[str, ...]
    """PEFT ``target_modules`` for LoRA on the query and value projections (``lora.targets: ["auto"]``)."""
    note: str = ""

    def targets(self, group: str) -> tuple[str, ...]:
        """Module-name patterns of a target group."""
        if group == "lora_A":
            return ("lora_A.*",)
        return getattr(self, group)


_BERT_ATTENTION = Attention("attention.self", "dropout")
_BERT_FFN = Ffn("intermediate", "dense", "intermediate_act_fn")

BERT = Family(
    "bert",
    ("bert", "roberta", "xlm-roberta", "camembert", "electra"),
    _BERT_ATTENTION,
    _BERT_FFN,
    qkv=("attention.self.query", "attention.self.key", "attention.self.value"),
    attn_out=("attention.output.dense",),
    ffn_in=("intermediate.dense",),
    ffn_out=("layer.*.output.dense",),
    lora_targets=("query", "value"),
    note="BertSelfAttention and its RoBERTa/XLM-R/CamemBERT/ELECTRA copies call ALL_ATTENTION_FUNCTIONS",
)

DISTILBERT = Family(
    "distilbert",
    ("distilbert",),
    Attention("layer.*.attention", "dropout", config_dropout=("attention_dropout",)),
    Ffn("layer.*.ffn", "lin1", "activation"),
    qkv=("attention.q_lin", "attention.k_lin", "attention.v_lin"),
    attn_out=("attention.out_lin",),
    ffn_in=("ffn.lin1",),
    ffn_out=("ffn.lin2",),
    lora_targets=("q_lin", "v_lin"),
)

ALBERT = Family(
    "albert",
    ("albert",),
    Attention("albert_layers.*.attention", "attention_dropout"),
    Ffn("albert_layers.*", "ffn", "activation"),
    qkv=("attention.query", "attention.key", "attention.value"),
    attn_out=("attention.dense",),
    ffn_in=("albert_layers.*.ffn",),
    ffn_out=("albert_layers.*.ffn_output",),
    lora_targets=("query", "value"),
    note="one AlbertLayer runs at every depth: its swaps and its gradient-norm cache are shared by all depths",
)

MPNET = Family(
    "mpnet",
    ("mpnet",),
    Attention(
        "attention.attn",
        "dropout",
        prob_dropout_called=True,
        sdpa_blocker="eager only in transformers (MPNetSelfAttention.forward adds the relative position "
        "bias to its own score matmul)",
    ),
    _BERT_FFN,
    qkv=("attention.attn.q", "attention.attn.k", "attention.attn.v"),
    attn_out=("attention.attn.o",),
    ffn_in=("intermediate.dense",),
    ffn_out=("layer.*.output.dense",),
    lora_targets=("q", "v"),
)

DEBERTA_V2 = Family(
    "deberta-v2",
    ("deberta-v2",),
    Attention(
        "attention.self",
        "dropout",
        prob_dropout_called=True,
        sdpa_blocker="eager only in transformers (DisentangledSelfAttention.forward computes the "
        "disentangled c2p/p2c scores itself, no attention interface)",
    ),
    _BERT_FFN,
    qkv=("attention.self.query_proj", "attention.self.key_proj", "attention.self.value_proj"),
    attn_out=("attention.output.dense",),
    ffn_in=("intermediate.dense",),
    ffn_out=("layer.*.output.dense",),
    lora_targets=("query_proj", "value_proj"),
    note="query_proj/key_proj also project the relative-position embeddings (share_att_key); sampling them "
    "samples those rows too (unbiased, no padding mask)",
)

MODERNBERT = Family(
    "modernbert",
    ("modernbert",),
    Attention("layers.*.attn", "attention_dropout", config_dropout=("attention_dropout",)),
    Ffn("layers.*.mlp", "Wi", "act", gated=True, dropout="drop", output="Wo"),
    qkv=("attn.Wqkv",),
    attn_out=("attn.Wo",),
    ffn_in=("mlp.Wi",),
    ffn_out=("mlp.Wo",),
    lora_targets=("Wqkv",),
    note="Wqkv is one fused q/k/v projection; LoRA on it adapts q, k and v",
)

FAMILIES = (BERT, DISTILBERT, ALBERT, MPNET, DEBERTA_V2, MODERNBERT)
GENERIC = Family(
    "generic (BERT patterns)",
    (),
    _BERT_ATTENTION,
    _BERT_FFN,
    BERT.qkv,
    BERT.attn_out,
    BERT.ffn_in,
    BERT.ffn_out,
    BERT.lora_targets,
)
"""What a model type missing from :data:`FAMILIES` (or a plain ``nn.Module``) gets."""

_BY_MODEL_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}


@dataclass(frozen=True)
class Detected:
    family: Family
    model_type: Optional[str]
    """``config.model_type`` of the transformers model, ``None`` for a model without one."""
    known: bool
    """The model type is in the registry (else :data:`GENERIC` patterns are used)."""

    def describe(self) -> str:
        if self.known:
            return f"{self.family.name} (model_type {self.model_type})"
        what = f"model_type {self.model_type!r}" if self.model_type else "a model without a transformers config"
        return f"{what}, not in the family registry: {self.family.name}"


def pretrained_base(model: nn.Module):
    """The transformers ``PreTrainedModel`` inside ``model`` (PEFT wraps it), or ``None``."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    return base if hasattr(base, "set_attn_implementation") else None


def detect(model: nn.Module) -> Detected:
    """The :class:`Family` of ``model`` (a transformers model, a PEFT model around one, or any module)."""
    base = pretrained_base(model)
    model_type = getattr(getattr(base, "config", None), "model_type", None) if base is not None else None
    family = _BY_MODEL_TYPE.get(model_type)
    return Detected(family or GENERIC, model_type, family is not None)


def matches(name: str, pattern: str) -> bool:
    """``pattern`` matches the trailing dotted components of module name ``name`` (``*``: any one)."""
    parts, wanted = name.split("."), pattern.split(".")
    if len(parts) < len(wanted):
        return False
    return all(w == "*" or w == p for w, p in zip(wanted, parts[-len(wanted) :]))


def generalise(name: str) -> str:
    """``bert.encoder.layer.3.output.dense`` → ``bert.encoder.layer.*.output.dense`` (for messages)."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def summarise(names) -> str:
    """Distinct generalised names, in first-seen order, comma-separated."""
    return ", ".join(dict.fromkeys(generalise(name) for name in names))
