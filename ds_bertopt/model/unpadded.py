"""Unpadded ("packed") masked-LM pretraining forward of every plain-attention BERT family: no padding token is
ever computed on.

A micro-batch is packed into one row of ``T`` real tokens (``ds_bertopt.data.collate.pack_sequences``). Every
token-wise op (embeddings, all linears, LayerNorms, activations, dropouts, the sparse MLM head) runs on the
``[1, T]`` row; attention alone needs sequence boundaries, and gets them from ``cu_seqlens`` (the prefix sums
flash-attn's varlen kernels use). :class:`UnpaddedMLM` wraps a stock Hugging Face masked-LM model of a family in
:mod:`.families` (BERT, RoBERTa / XLM-R / CamemBERT, DistilBERT, the ELECTRA generator, ModernBERT) and runs the
model's own base model on the packed row, so parameters, ZeRO-3 hooks, gradient checkpointing, ``state_dict``
and ``save_pretrained`` are the wrapped model's, unchanged. Only the attention core is replaced, through
transformers' public attention interface (``AttentionInterface.register``): the wrapped model's attention
implementation becomes :data:`PACKED_ATTENTION`, which every family's attention module calls with its own
projections, scaling, dropout probability and (ModernBERT) sliding window, and which attends per packed
sequence (:func:`packed_attention`). The packing travels as one keyword argument (:class:`PackedSequences`),
which transformers hands down to every layer, through its gradient checkpointing too. Called without it (a
padded batch), the implementation is transformers' SDPA with its mask: the wrapped model still runs padded.

What differs per family is only its position ids (RoBERTa's start at ``padding_idx + 1``), whether it takes
token types, and its MLM head, run at the masked positions only (:mod:`.families`).

Attention backends (``packed_attention``):

* ``varlen`` (CUDA, fp16/bf16): ``torch.nn.attention.varlen.varlen_attn`` on the packed ``[T, heads, head_dim]``
  tensors, with ModernBERT's local layers as its symmetric ``window_size``. That public API hard-codes
  ``dropout_p = 0``, so with attention dropout active (training) we call the op it wraps,
  ``torch.ops.aten._flash_attention_forward``, with ``dropout_p`` (private, but differentiable through its
  ``derivatives.yaml`` entry). Each variant is probed once per (device, dtype, head_dim, dropout, window) with a
  tiny forward + backward (one host sync, once); a failure warns once and falls back to ``sdpa_loop``.
  :class:`UnpaddedMLM` probes eagerly in ``choose_attention`` (the training loop calls it once the engine placed
  the model, and rank 0 logs the choice), never inside a forward that may be checkpointed.
* ``sdpa_loop`` (CPU, and any CUDA case flash cannot take, e.g. fp32): one exact
  ``scaled_dot_product_attention`` call per sequence on ``split`` views of the packed tensors (no copies in, one
  ``cat`` out, no padding; a local layer masks only the sequences longer than its window, with a band of
  ``|i - j| <= window``). On CPU this measured fastest among the exact forms (length-bucketed padded SDPA, one
  block-diagonal-masked SDPA, per-sequence loop): SDPA's per-call overhead is far below the cost of padding,
  masks and gathers; see ``bench/unpadded_attention.py``.

Host syncs: none in ``forward`` when the collator's host-side ``seq_lengths``, ``max_seqlen`` and
``masked_positions`` are passed (``ds_bertopt.data.collate.pack_sequences`` makes them). Without them they are
recovered from ``cu_seqlens``/``labels`` with ``.tolist()``/``nonzero`` (a sync each, free on CPU).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from . import fused
from .cpu_attention import PackedBitsAttention, band_mask
from .bert import IGNORE_INDEX, PretrainOutput, mlm_loss
from .families import MlmFamily, family_of
from .tied import sparse_rows, tie_sparse

try:  # torch >= 2.10; CUDA only at run time
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

ATTENTION_BACKENDS = ("auto", "varlen", "sdpa_loop")
PACKED_ATTENTION = "ds_bertopt_packed"
"""The attention implementation name :class:`UnpaddedMLM` gives the wrapped model."""
PACKING_KWARG = "ds_bertopt_packing"
"""The keyword argument that carries :class:`PackedSequences` down to the attention calls."""


def token_counts(seq_lengths: Sequence[int]) -> dict:
    """What a packed micro-batch computes, for benchmarks: ``real_tokens``; ``computed_tokens``, the rows
    the token-wise ops run on; ``attention_padding_tokens``, not-real rows inside attention sub-batches
    (0 for both backends here: ``varlen`` and ``sdpa_loop`` see exactly the real tokens);
    ``attention_scores``, the query-key pairs per head (sum of squared lengths); and
    ``padded_tokens``, what padding every sequence to the longest would compute."""
    lengths = [int(n) for n in seq_lengths]
    real = sum(lengths)
    return {
        "real_tokens": real,
        "computed_tokens": real,
        "attention_padding_tokens": 0,
        "attention_scores": sum(n * n for n in lengths),
        "padded_tokens": len(lengths) * max(lengths),
        "padding_fraction": 0.0,
    }


def sequence_lengths(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """Per-sequence lengths from ``cu_seqlens`` (a host sync on an accelerator: prefer the collator's)."""
    return tuple((cu_seqlens[1:] - cu_seqlens[:-1]).tolist())


# ----------------------------------------------------------------------------------------------------------------
# attention over packed sequences (pure functions)
# ----------------------------------------------------------------------------------------------------------------


def sdpa_loop_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seq_lengths: Sequence[int],
    *,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    window: Optional[int] = None,
    packed_bits: bool = False,
) -> torch.Tensor:
    """Exact bidirectional attention per sequence: ``[T, heads, head_dim]`` in and out.

    One ``F.scaled_dot_product_attention`` per sequence on ``split`` views (``split``'s backward is
    one concatenation, unlike per-slice indexing whose backward writes a full-size zero tensor per
    slice). No mask is needed as every key is real; with ``window`` (local attention, ``|i - j| <= window``) a
    sequence longer than ``window + 1`` gets a band mask. ``dropout_p`` is SDPA's attention-probability
    dropout, as transformers' ``sdpa_attention_forward`` applies it; with ``packed_bits`` (``model.fused_dropout``) on
    the CPU, that dropout draws packed bits instead, in :class:`.cpu_attention.PackedBitsAttention` (the same math by
    hand, one draw for the micro-batch, 5 bytes kept a score).
    """
    lengths = list(seq_lengths)
    if packed_bits and dropout_p > 0.0 and query.device.type == "cpu":
        return PackedBitsAttention.apply(
            query, key, value, tuple(lengths), dropout_p, scale, -1 if window is None else window
        )
    outputs = []
    for q, k, v in zip(query.split(lengths), key.split(lengths), value.split(lengths)):
        n = q.shape[0]
        mask = band_mask(n, window, q.device) if window is not None and n > window + 1 else None
        # [1, heads, n, d]: SDPA's fused CPU kernel (flash) takes batched 4-D inputs only; 3-D ones fall back to the
        # math path, which keeps every probability for backward (and runs ~1.4x slower)
        out = F.scaled_dot_product_attention(
            *(x.transpose(0, 1)[None] for x in (q, k, v)), attn_mask=mask, dropout_p=dropout_p, scale=scale
        )
        outputs.append(out[0].transpose(0, 1))
    return torch.cat(outputs)


def varlen_flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    window: Optional[int] = None,
) -> torch.Tensor:
    """Flash-attention varlen on CUDA: ``[T, heads, head_dim]`` fp16/bf16 in and out; ``window``: local attention
    (``|i - j| <= window``, flash's symmetric ``window_size``).

    ``torch.nn.attention.varlen.varlen_attn`` (torch 2.13) without dropout. It fixes ``dropout_p`` to 0,
    so with dropout we call the aten op it wraps, ``_flash_attention_forward(q, k, v, cu_q, cu_k, max_q,
    max_k, dropout_p, is_causal, return_debug_mask, *, scale, window_size_left, window_size_right)``, whose
    autograd formula replays the dropout mask from the returned philox ``rng_state``.
    """
    cu = cu_seqlens.to(torch.int32)
    side = -1 if window is None else int(window)
    if dropout_p > 0.0:
        return torch.ops.aten._flash_attention_forward(
            query,
            key,
            value,
            cu,
            cu,
            max_seqlen,
            max_seqlen,
            dropout_p,
            False,
            False,
            scale=scale,
            window_size_left=None if window is None else side,
            window_size_right=None if window is None else side,
        )[0]
    if varlen_attn is None:
        raise ImportError("torch.nn.attention.varlen.varlen_attn is missing in this torch")
    return varlen_attn(query, key, value, cu, cu, max_seqlen, max_seqlen, scale=scale, window_size=(side, side))


_VARLEN_PROBES: dict = {}


def varlen_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether flash varlen can take this case at all: CUDA, fp16/bf16, a head size flash takes."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256


def varlen_usable(
    device: torch.device, dtype: torch.dtype, head_dim: int, with_dropout: bool, windowed: bool = False
) -> bool:
    """Whether ``varlen_flash_attention`` runs here: :func:`varlen_supported`, and a tiny forward + backward that
    succeeds (probed once per combination; one host sync, once)."""
    if not varlen_supported(device, dtype, head_dim):
        return False
    probe_key = (str(device), dtype, head_dim, with_dropout, windowed)
    if probe_key not in _VARLEN_PROBES:
        _VARLEN_PROBES[probe_key] = probe_varlen(device, dtype, head_dim, with_dropout, windowed)
    return _VARLEN_PROBES[probe_key]


def probe_varlen(
    device: torch.device, dtype: torch.dtype, head_dim: int, with_dropout: bool, windowed: bool = False
) -> bool:
    """Run ``varlen_flash_attention`` forward + backward on two tiny sequences; False (and a warning naming
    the error) where it fails. ``enable_grad``: the first call may come from an evaluation under
    ``no_grad``; ``fork_rng``: probing must not shift the run's random streams."""
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            q, k, v = (
                torch.linspace(-1, 1, 6 * 2 * head_dim, device=device)
                .view(6, 2, head_dim)
                .to(dtype)
                .roll(i)
                .requires_grad_()
                for i in range(3)
            )
            cu = torch.tensor([0, 2, 6], dtype=torch.int32, device=device)
            out = varlen_flash_attention(
                q, k, v, cu, 4, dropout_p=0.1 if with_dropout else 0.0, window=1 if windowed else None
            )
            out.float().square().sum().backward()
            return bool(torch.isfinite(q.grad).all())  # the once-only sync
    except (RuntimeError, AttributeError, ImportError, NotImplementedError, TypeError) as err:
        warnings.warn(
            f"varlen flash attention unusable on {device} ({dtype}, head_dim {head_dim}, "
            f"dropout {with_dropout}{', windowed' if windowed else ''}): {str(err).splitlines()[0]}; falling back "
            "to the SDPA loop",
            stacklevel=2,
        )
        return False


def packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    seq_lengths: Sequence[int],
    *,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    backend: str = "auto",
    window: Optional[int] = None,
    packed_bits: bool = False,
) -> torch.Tensor:
    """Bidirectional attention of packed sequences, ``[T, heads, head_dim]`` -> same; ``window``: local attention;
    ``packed_bits``: the CPU loop's attention dropout draws packed bits (:func:`sdpa_loop_attention`).

    ``backend``: ``"varlen"`` (must work, else a one-line error), ``"sdpa_loop"``, or ``"auto"`` (varlen
    where ``varlen_usable``, else the loop).
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"packed_attention: backend {backend!r} is not one of {ATTENTION_BACKENDS}")
    if backend != "sdpa_loop":
        usable = varlen_usable(query.device, query.dtype, query.shape[-1], dropout_p > 0.0, window is not None)
        if usable:
            return varlen_flash_attention(
                query, key, value, cu_seqlens, max_seqlen, dropout_p=dropout_p, scale=scale, window=window
            )
        if backend == "varlen":
            raise RuntimeError(
                f"packed_attention: varlen flash attention is unusable for {query.dtype} on "
                f"{query.device} (needs CUDA, fp16/bf16, head_dim a multiple of 8 up to 256)"
            )
    return sdpa_loop_attention(
        query, key, value, seq_lengths, dropout_p=dropout_p, scale=scale, window=window, packed_bits=packed_bits
    )


@dataclass(frozen=True)
class PackedSequences:
    """What every attention call of one packed forward needs, handed down by transformers as ``ds_bertopt_packing``."""

    cu_seqlens: torch.Tensor
    """``[S+1]`` int32 prefix sums of the sequence lengths."""
    max_seqlen: int
    """The longest sequence (host int)."""
    seq_lengths: tuple[int, ...]
    """Every sequence's length (host ints)."""
    backend: str
    """``varlen`` or ``sdpa_loop``, decided before the forward (never probed inside a checkpointed layer)."""
    scores: Optional[torch.Tensor] = None
    """``[sum(n^2)]`` with stride 0 (no storage): the query-key pair count as a tensor dimension, which a compiled
    layer reads as a dynamic size (:mod:`.compiled`'s attention op keeps that many probabilities for backward)."""
    packed_bits: bool = False
    """Attention dropout on the CPU draws packed bits (``model.fused_dropout``; :mod:`.cpu_attention`)."""


def hf_packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    **kwargs,
):
    """transformers' attention-interface signature: ``[1, heads, T, head_dim]`` in, ``([1, T, heads, head_dim],
    None)`` out. ``sliding_window`` is what ModernBERT's local layers pass: their half window + 1, flash-attention's
    inclusive bound (transformers' ``sliding_window_bidirectional_overlay``: ``|i - j| <= sliding_window - 1``)."""
    packing = kwargs.get(PACKING_KWARG)
    window = None if sliding_window is None else sliding_window - 1
    if packing is not None and torch.compiler.is_compiling():  # a compiled layer (model.compile): one opaque op
        from .compiled import compiled_attention

        out = compiled_attention(
            *(x[0].transpose(0, 1) for x in (query, key, value)), packing, dropout, scaling, window
        )
        return out[None], None
    if packing is None:  # a padded call of the wrapped model: transformers' own SDPA, with its mask
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    out = packed_attention(
        *(x[0].transpose(0, 1) for x in (query, key, value)),
        packing.cu_seqlens,
        packing.max_seqlen,
        packing.seq_lengths,
        dropout_p=dropout,
        scale=scaling,
        backend=packing.backend,
        window=window,
        packed_bits=packing.packed_bits,
    )
    return out[None], None


def register_packed_attention() -> None:
    """Register :data:`PACKED_ATTENTION` with transformers (its attention, and SDPA's mask for padded calls)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(PACKED_ATTENTION, hf_packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)


# ----------------------------------------------------------------------------------------------------------------
# the model wrapper (thin glue over the Hugging Face model)
# ----------------------------------------------------------------------------------------------------------------


def local_window(config) -> Optional[int]:
    """ModernBERT's local-attention half window (``|i - j| <= window``), when some layer is local; else ``None``."""
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return int(config.sliding_window)
    return None


class UnpaddedEncoder(torch.nn.Module):
    """The packed forward shared by every unpadded model: a Hugging Face model of a :mod:`.families` family (or a PEFT
    model around one) whose base model runs on the packed row with :data:`PACKED_ATTENTION`. ``.model`` is the model
    given (its parameters, state dict and ``save_pretrained`` unchanged); ``.hf`` the transformers model in it.
    Subclasses add their heads: :class:`UnpaddedMLM` (pretraining), :class:`~.heads.UnpaddedTaskModel` (fine-tuning)."""

    def __init__(
        self, model, family: MlmFamily, attention: str = "auto", fused_dropout: bool = False, compile: bool = False
    ):
        super().__init__()
        get_base = getattr(model, "get_base_model", None)  # PEFT wraps the transformers model
        hf = get_base() if callable(get_base) else model
        if family.unpadded_blocker:
            raise ValueError(f"{type(self).__name__}: {family.name} cannot run unpadded ({family.unpadded_blocker})")
        config = hf.config
        if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
            raise ValueError(
                f"{type(self).__name__}: decoder / cross-attention configs are not supported (bidirectional attention "
                "only)"
            )
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"{type(self).__name__}: attention {attention!r} is not one of {ATTENTION_BACKENDS}")
        register_packed_attention()
        hf.set_attn_implementation(PACKED_ATTENTION)
        self.model = model
        object.__setattr__(self, "hf", hf)  # the same modules as .model: not registered twice
        self.family = family
        self.attention = attention
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.position_offset = family.position_offset(config)
        self.window = local_window(config)
        self.dropout_p = float(getattr(config, family.attention_dropout, 0.0) or 0.0)
        self._backends: dict[tuple, str] = {}  # (device, dtype, with dropout) -> "varlen" | "sdpa_loop"
        self.fused = fused.fuse_encoder(hf, family) if fused_dropout else None  # None: HF's own modules
        self.compiled = None  # model.compile: the log line of .compiled.compile_layers
        if compile:
            from .compiled import compile_layers  # imports torch's compiler stack only when asked for

            self.compiled = compile_layers(hf)

    @property
    def config(self):
        """The wrapped model's config (``Trainer`` and DeepSpeed's ``"auto"`` values read it)."""
        return self.hf.config

    def activation_checkpointing_enable(self, *args, **kwargs):
        """The wrapped model's own (transformers checkpoints its layers; ``Trainer`` calls this)."""
        return self.model.activation_checkpointing_enable(*args, **kwargs)

    def choose_attention(self, device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> str:
        """Decide the attention kernel for ``device``/``dtype`` (default: the parameters'), probing flash varlen
        now, eagerly and outside any autograd graph, never inside a (checkpointed) forward; returns one line for
        the log. Called once after the engine has placed the model; a forward in another dtype (autocast)
        decides for that dtype before its first layer."""
        param = next(self.model.parameters())
        device, dtype = device or param.device, dtype or param.dtype
        variants = (False, True) if self.dropout_p > 0 else (False,)
        chosen = [self._backend(device, dtype, with_dropout) for with_dropout in variants]
        names = {"varlen": "flash varlen", "sdpa_loop": "exact per-sequence SDPA loop"}
        what = " / ".join(dict.fromkeys(names[c] for c in chosen))
        local = f", local layers |i-j| <= {self.window}" if self.window is not None else ""
        fused_what = f"; fused: {', '.join(self.fused) or 'nothing'}" if self.fused is not None else ""
        compiled_what = f"; {self.compiled}" if self.compiled else ""
        return (
            f"unpadded attention: {what} ({device.type}, {str(dtype).replace('torch.', '')}, head_dim "
            f"{self.head_dim}{local}){fused_what}{compiled_what}"
        )

    def _backend(self, device: torch.device, dtype: torch.dtype, with_dropout: bool) -> str:
        key = (str(device), dtype, with_dropout)
        if key not in self._backends:
            windowed = self.window is not None
            if self.attention == "sdpa_loop":
                backend = "sdpa_loop"
            elif varlen_usable(device, dtype, self.head_dim, with_dropout, windowed):
                backend = "varlen"
            elif self.attention == "varlen":
                raise RuntimeError(
                    f"{type(self).__name__}: attention 'varlen' is unusable for {dtype} on {device} (needs CUDA, "
                    "fp16/bf16, head_dim a multiple of 8 up to 256; see the warning above for a failed probe)"
                )
            else:
                backend = "sdpa_loop"
            self._backends[key] = backend
        return self._backends[key]

    def encode(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        token_type_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        max_seqlen: Optional[int] = None,
        seq_lengths: Optional[Sequence[int]] = None,
    ) -> tuple[torch.Tensor, tuple[int, ...]]:
        """``(hidden [T, hidden], seq_lengths)`` of a packed batch (see :meth:`UnpaddedMLM.forward` for the inputs)."""
        if seq_lengths is None:
            seq_lengths = sequence_lengths(cu_seqlens)  # host sync
        if max_seqlen is None:
            max_seqlen = max(seq_lengths)
        if position_ids is None:
            position_ids = torch.cat([torch.arange(n, device=input_ids.device) for n in seq_lengths])
        device_type = input_ids.device.type
        dtype = (
            torch.get_autocast_dtype(device_type)
            if torch.is_autocast_enabled(device_type)
            else self.hf.get_input_embeddings().weight.dtype
        )
        backend = self._backend(input_ids.device, dtype, self.training and self.dropout_p > 0)  # before any layer
        scores = cu_seqlens.new_empty(()).expand(sum(n * n for n in seq_lengths))
        packing = PackedSequences(
            cu_seqlens, int(max_seqlen), tuple(seq_lengths), backend, scores, packed_bits=self.fused is not None
        )
        inputs = {
            "input_ids": input_ids[None],
            "position_ids": (position_ids + self.position_offset if self.position_offset else position_ids)[None],
            PACKING_KWARG: packing,
        }
        if self.family.token_types and token_type_ids is not None:
            inputs["token_type_ids"] = token_type_ids[None]
        if self.family.layer_type_masks:  # no mask to build for any layer type (ModernBERT builds one per type)
            inputs["attention_mask"] = dict.fromkeys(self.hf.config.layer_types)
        else:
            # A 4-D mask is taken as already built (masking_utils._preprocess_mask_arguments returns it at once), so
            # transformers neither builds a [T, T] mask our attention ignores nor, from 5.25 on, reads the restarting
            # position_ids back on the host to detect packing (find_packed_sequence_indices). hf_packed_attention
            # ignores it: the packing carries the sequence bounds.
            inputs["attention_mask"] = input_ids.new_ones((1, 1, 1, 1), dtype=torch.bool)
        return self.hf.base_model(**inputs).last_hidden_state[0], tuple(seq_lengths)


class UnpaddedMLM(UnpaddedEncoder):
    """Runs a Hugging Face masked-LM model of a :mod:`.families` family on a packed, padding-free batch.

    The wrapped model is ``.model``; its parameters are used in place (no copies), so its ``state_dict`` /
    ``save_pretrained`` are unchanged and load with stock ``from_pretrained`` (the attention implementation is
    not saved). The forward runs the model's base model on the packed row with the attention implementation
    :data:`PACKED_ATTENTION` and the MLM head at the masked positions only; ``BertForPreTraining`` adds NSP from
    each sequence's first token. ``gradient_checkpointing_enable()`` / ``activation_checkpointing_enable()`` on
    the wrapped model work as in the stock model (transformers checkpoints its own layers).
    ``fused_dropout``: the model's dropout from packed random bits, fused with the residual add
    (:func:`.fused.fuse_encoder`, ``model.fused_dropout``).
    """

    def __init__(self, model, attention: str = "auto", fused_dropout: bool = False, compile: bool = False):
        super().__init__(model, family_of(model), attention, fused_dropout, compile)
        self.nsp = type(model).__name__ == self.family.pretraining_class
        self.tied = tie_sparse(self.hf)  # sparse in forward only, where the head runs too: see .tied

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        max_seqlen: Optional[int] = None,
        next_sentence_label: Optional[torch.Tensor] = None,
        loss_normalizer: Optional[Union[torch.Tensor, float]] = None,
        nsp_normalizer: Optional[Union[torch.Tensor, float]] = None,
        seq_lengths: Optional[Sequence[int]] = None,
        masked_positions: Optional[torch.Tensor] = None,
    ) -> PretrainOutput:
        """Packed batch (all ``[T]`` unless said): ``input_ids``, ``token_type_ids`` (ignored by families without
        token types), ``position_ids`` (restarting at 0 per sequence; the family's offset is added here),
        ``cu_seqlens`` ``[S+1]`` int32, ``labels`` (``-100`` where not masked), ``max_seqlen`` (int),
        ``next_sentence_label`` ``[S]``; host-side ``seq_lengths`` and ``masked_positions`` ``[M]`` avoid
        syncs (see ``ds_bertopt.data.collate.pack_sequences``).

        Loss normalizers: with ``loss_normalizer`` (float or tensor) the MLM loss is the sum of token
        losses divided by it, not their mean over this micro-batch: pass the masked-token count of the
        whole optimizer step (all ranks and micro-batches) and the micro-batches' gradients add up to
        the big batch's mean-loss gradient however samples are dealt. ``nsp_normalizer`` does the same
        for NSP with a sequence count; without it NSP is the mean over this micro-batch's sequences,
        which is already exact when every micro-batch holds equally many sequences (our samplers'
        contract) and the engine averages micro-batches and ranks equally. Under DeepSpeed, whose
        ``backward`` divides by the accumulation steps and whose gradient reduction averages ranks,
        pass the global count divided by ``grad_accum × dp_world`` (as ``ds_bertopt.train.loop`` does).
        """
        if masked_positions is None:
            masked_positions = torch.nonzero(labels != IGNORE_INDEX).flatten()  # host sync (data-dependent shape)
        with sparse_rows(self.hf):  # the tied decoder runs below, in this same forward
            hidden, _ = self.encode(input_ids, cu_seqlens, token_type_ids, position_ids, max_seqlen, seq_lengths)
        target = labels.index_select(0, masked_positions)
        mlm_logits = self.family.head(self.model, hidden.index_select(0, masked_positions))
        loss, mean_loss = mlm_loss(mlm_logits, target, loss_normalizer)
        nsp_logits = None
        if self.nsp:
            # BertPooler takes hidden_states[:, 0]: give it each sequence's first token as [S, 1, hidden]
            first_tokens = hidden.index_select(0, cu_seqlens[:-1].long())[:, None]
            nsp_logits = self.model.cls.seq_relationship(self.model.bert.pooler(first_tokens))
            if next_sentence_label is not None:
                nsp_losses = F.cross_entropy(nsp_logits.float(), next_sentence_label, reduction="none")
                mean_loss = mean_loss + nsp_losses.mean()
                loss = loss + (nsp_losses.mean() if nsp_normalizer is None else nsp_losses.sum() / nsp_normalizer)
        return PretrainOutput(
            loss=loss, mean_loss=mean_loss, mlm_logits=mlm_logits, mlm_labels=target, nsp_logits=nsp_logits
        )


UnpaddedBert = UnpaddedMLM
"""The name this wrapper had when it took BERT only (benches and tests use it)."""


__all__ = [
    "ATTENTION_BACKENDS",
    "IGNORE_INDEX",
    "PACKED_ATTENTION",
    "PackedSequences",
    "UnpaddedBert",
    "UnpaddedEncoder",
    "UnpaddedMLM",
    "band_mask",
    "hf_packed_attention",
    "local_window",
    "packed_attention",
    "probe_varlen",
    "register_packed_attention",
    "sdpa_loop_attention",
    "sequence_lengths",
    "token_counts",
    "varlen_flash_attention",
    "varlen_supported",
    "varlen_usable",
]
