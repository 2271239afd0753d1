"""Unpadded ("packed") BERT pretraining forward: no padding token is ever computed on.

A micro-batch is packed into one row of ``T`` real tokens (``ds_bertopt.data.collate.pack_sequences``).
Every token-wise op
(embeddings + LayerNorm + dropout, all linears, LayerNorms, GELU, hidden dropout, the sparse MLM head)
runs on ``[T, hidden]``; attention alone needs sequence boundaries, and gets them from ``cu_seqlens``
(the prefix sums flash-attn's varlen kernels use). ``UnpaddedBert`` wraps a stock Hugging Face
``BertForMaskedLM``/``BertForPreTraining`` and calls its own submodules, so parameters, ZeRO-3
hooks, ``state_dict`` and ``save_pretrained`` are the wrapped model's, unchanged.

Attention backends (``packed_attention``):

* ``varlen`` (CUDA, fp16/bf16): ``torch.nn.attention.varlen.varlen_attn`` on the packed
  ``[T, heads, head_dim]`` tensors. That public API hard-codes ``dropout_p = 0``, so with attention
  dropout active (training, ``attention_probs_dropout_prob > 0``) we call the op it wraps,
  ``torch.ops.aten._flash_attention_forward``, with ``dropout_p`` (private, but differentiable through
  its ``derivatives.yaml`` entry). Each variant is probed once per (device, dtype, head_dim) with a tiny
  forward + backward (one host sync, once); a failure warns once and falls back to ``sdpa_loop``. ``UnpaddedBert``
  probes eagerly in ``choose_attention`` (the training loop calls it once the engine placed the model, and rank 0
  logs the choice), never inside a forward that may be checkpointed.
* ``sdpa_loop`` (CPU, and any CUDA case flash cannot take, e.g. fp32): one exact
  ``scaled_dot_product_attention`` call per sequence on ``split`` views of the packed tensors (no
  copies in, one ``cat`` out, no mask, no padding). On CPU this measured fastest among the exact
  forms (length-bucketed padded SDPA, one block-diagonal-masked SDPA, per-sequence loop): SDPA's
  per-call overhead is far below the cost of padding, masks and gathers; see ``bench/unpadded_attention.py``.

Host syncs: none in ``forward`` when the collator's host-side ``seq_lengths``, ``max_seqlen`` and
``masked_positions`` are passed (``ds_bertopt.data.collate.pack_sequences`` makes them). Without them they are recovered
from ``cu_seqlens``/``labels`` with ``.tolist()``/``nonzero`` (a sync each, free on CPU).
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from transformers import BertForMaskedLM, BertForPreTraining

from .bert import PretrainOutput

try:  # torch >= 2.10; CUDA only at run time
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

IGNORE_INDEX = -100
ATTENTION_BACKENDS = ("auto", "varlen", "sdpa_loop")


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
) -> torch.Tensor:
    """Exact bidirectional attention per sequence: ``[T, heads, head_dim]`` in and out.

    One ``F.scaled_dot_product_attention`` per sequence on ``split`` views (``split``'s backward is
    one concatenation, unlike per-slice indexing whose backward writes a full-size zero tensor per
    slice). No mask is needed as every key is real. ``dropout_p`` is SDPA's attention-probability
    dropout, as ``sdpa_attention_forward`` in transformers applies it for ``BertSelfAttention``.
    """
    lengths = list(seq_lengths)
    outputs = [
        F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), dropout_p=dropout_p, scale=scale
        ).transpose(0, 1)
        for q, k, v in zip(query.split(lengths), key.split(lengths), value.split(lengths))
    ]
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
) -> torch.Tensor:
    """Flash-attention varlen on CUDA: ``[T, heads, head_dim]`` fp16/bf16 in and out.

    ``torch.nn.attention.varlen.varlen_attn`` (torch 2.13) without dropout. It fixes ``dropout_p`` to 0,
    so with dropout we call the aten op it wraps, ``_flash_attention_forward(q, k, v, cu_q, cu_k, max_q,
    max_k, dropout_p, is_causal, return_debug_mask, *, scale)``, whose autograd formula replays the
    dropout mask from the returned philox ``rng_state``.
    """
    cu = cu_seqlens.to(torch.int32)
    if dropout_p > 0.0:
        return torch.ops.aten._flash_attention_forward(
            query, key, value, cu, cu, max_seqlen, max_seqlen, dropout_p, False, False, scale=scale
        )[0]
    if varlen_attn is None:
        raise ImportError("torch.nn.attention.varlen.varlen_attn is missing in this torch")
    return varlen_attn(query, key, value, cu, cu, max_seqlen, max_seqlen, scale=scale)


_VARLEN_PROBES: dict = {}


def varlen_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether flash varlen can take this case at all: CUDA, fp16/bf16, a head size flash takes."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256


def varlen_usable(device: torch.device, dtype: torch.dtype, head_dim: int, with_dropout: bool) -> bool:
    """Whether ``varlen_flash_attention`` runs here: :func:`varlen_supported`, and a tiny forward + backward that
    succeeds (probed once per combination; one host sync, once)."""
    if not varlen_supported(device, dtype, head_dim):
        return False
    probe_key = (str(device), dtype, head_dim, with_dropout)
    if probe_key not in _VARLEN_PROBES:
        _VARLEN_PROBES[probe_key] = probe_varlen(device, dtype, head_dim, with_dropout)
    return _VARLEN_PROBES[probe_key]


def probe_varlen(device: torch.device, dtype: torch.dtype, head_dim: int, with_dropout: bool) -> bool:
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
            out = varlen_flash_attention(q, k, v, cu, 4, dropout_p=0.1 if with_dropout else 0.0)
            out.float().square().sum().backward()
            return bool(torch.isfinite(q.grad).all())  # the once-only sync
    except (RuntimeError, AttributeError, ImportError, NotImplementedError, TypeError) as err:
        warnings.warn(
            f"varlen flash attention unusable on {device} ({dtype}, head_dim {head_dim}, "
            f"dropout {with_dropout}): {str(err).splitlines()[0]}; falling back to the SDPA loop",
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
) -> torch.Tensor:
    """Bidirectional attention of packed sequences, ``[T, heads, head_dim]`` -> same.

    ``backend``: ``"varlen"`` (must work, else a one-line error), ``"sdpa_loop"``, or ``"auto"`` (varlen
    where ``varlen_usable``, else the loop).
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"packed_attention: backend {backend!r} is not one of {ATTENTION_BACKENDS}")
    if backend != "sdpa_loop":
        usable = varlen_usable(query.device, query.dtype, query.shape[-1], dropout_p > 0.0)
        if usable:
            return varlen_flash_attention(query, key, value, cu_seqlens, max_seqlen, dropout_p=dropout_p, scale=scale)
        if backend == "varlen":
            raise RuntimeError(
                f"packed_attention: varlen flash attention is unusable for {query.dtype} on "
                f"{query.device} (needs CUDA, fp16/bf16, head_dim a multiple of 8 up to 256)"
            )
    return sdpa_loop_attention(query, key, value, seq_lengths, dropout_p=dropout_p, scale=scale)


# ----------------------------------------------------------------------------------------------------------------
# the model wrapper (thin glue over the Hugging Face modules)
# ----------------------------------------------------------------------------------------------------------------


class UnpaddedBert(torch.nn.Module):
    """Runs a Hugging Face ``BertForMaskedLM``/``BertForPreTraining`` on a packed, padding-free batch.

    The wrapped model is ``.model``; its parameters are used in place (no copies), so its
    ``state_dict``/``save_pretrained`` are unchanged and load with stock ``from_pretrained``. The
    forward calls the model's own submodules (``BertEmbeddings``, the ``query``/``key``/``value``
    linears of ``BertSelfAttention``, ``BertSelfOutput``, ``BertLayer.feed_forward_chunk``,
    ``BertPooler``, ``BertLMPredictionHead``), each on ``[T, hidden]`` (or ``[1, T]`` ids), so ZeRO-3's
    per-module parameter gathering and dropout/train-mode flags work as in the stock model; only
    the attention core is replaced (``packed_attention``). The MLM head runs at masked positions only,
    as in ``ds_bertopt.model.SparseMLMHead``. ``activation_checkpointing_enable()`` on the wrapped
    model is honoured per layer with the checkpoint function it installed.
    """

    def __init__(self, model, attention: str = "auto"):
        super().__init__()
        if not isinstance(model, (BertForMaskedLM, BertForPreTraining)):
            raise TypeError(f"UnpaddedBert: expected BertForMaskedLM or BertForPreTraining, got {type(model).__name__}")
        config = model.config
        if config.is_decoder or config.add_cross_attention:
            raise ValueError(
                "UnpaddedBert: decoder / cross-attention BERT configs are not supported (bidirectional only)"
            )
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"UnpaddedBert: position_embedding_type {config.position_embedding_type!r} is not "
                f"supported (absolute only)"
            )
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"UnpaddedBert: attention {attention!r} is not one of {ATTENTION_BACKENDS}")
        self.model = model
        self.attention = attention
        self.nsp = isinstance(model, BertForPreTraining)
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self._backends: dict[tuple, str] = {}  # (device, dtype, with dropout) -> "varlen" | "sdpa_loop"

    def choose_attention(self, device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> str:
        """Decide the attention kernel for ``device``/``dtype`` (default: the parameters'), probing flash varlen
        now, eagerly and outside any autograd graph, never inside a (checkpointed) forward; returns one line for
        the log. Called once after the engine has placed the model; a forward in another dtype (autocast)
        decides for that dtype before its first layer."""
        param = next(self.model.parameters())
        device, dtype = device or param.device, dtype or param.dtype
        variants = (False, True) if self.model.config.attention_probs_dropout_prob > 0 else (False,)
        chosen = [self._backend(device, dtype, with_dropout) for with_dropout in variants]
        names = {"varlen": "flash varlen", "sdpa_loop": "exact per-sequence SDPA loop"}
        what = " / ".join(dict.fromkeys(names[c] for c in chosen))
        return (
            f"unpadded attention: {what} ({device.type}, {str(dtype).replace('torch.', '')}, head_dim {self.head_dim})"
        )

    def _backend(self, device: torch.device, dtype: torch.dtype, with_dropout: bool) -> str:
        key = (str(device), dtype, with_dropout)
        if key not in self._backends:
            if self.attention == "sdpa_loop":
                backend = "sdpa_loop"
            elif varlen_usable(device, dtype, self.head_dim, with_dropout):
                backend = "varlen"
            elif self.attention == "varlen":
                raise RuntimeError(
                    f"UnpaddedBert: attention 'varlen' is unusable for {dtype} on {device} (needs CUDA, fp16/bf16, "
                    f"head_dim a multiple of 8 up to 256; see the warning above for a failed probe)"
                )
            else:
                backend = "sdpa_loop"
            self._backends[key] = backend
        return self._backends[key]

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        labels: torch.Tensor,
        max_seqlen: Optional[int] = None,
        next_sentence_label: Optional[torch.Tensor] = None,
        loss_normalizer: Optional[Union[torch.Tensor, float]] = None,
        nsp_normalizer: Optional[Union[torch.Tensor, float]] = None,
        seq_lengths: Optional[Sequence[int]] = None,
        masked_positions: Optional[torch.Tensor] = None,
    ) -> PretrainOutput:
        """Packed batch (all ``[T]`` unless said): ``input_ids``, ``token_type_ids``, ``position_ids``,
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
        if seq_lengths is None:
            seq_lengths = sequence_lengths(cu_seqlens)  # host sync
        if max_seqlen is None:
            max_seqlen = max(seq_lengths)
        if masked_positions is None:
            masked_positions = torch.nonzero(labels != IGNORE_INDEX).flatten()  # host sync (data-dependent shape)
        bert = self.model.bert
        # BertEmbeddings.forward expects [batch, seq]: the packed row is a batch of one
        hidden = bert.embeddings(
            input_ids=input_ids[None], token_type_ids=token_type_ids[None], position_ids=position_ids[None]
        )[0]
        dropout = self.training and self.model.config.attention_probs_dropout_prob > 0
        device_type = hidden.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
        backend = self._backend(hidden.device, dtype, dropout)  # decided here, before any checkpointed layer
        for layer in bert.encoder.layer:
            if getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
                # the function activation_checkpointing_enable() set (its kwargs, offload, every_n_layers), as
                # GradientCheckpointingLayer uses it; hidden is positional so use_reentrant=True works too
                checkpoint = getattr(layer, "_gradient_checkpointing_func", None) or functools.partial(
                    torch.utils.checkpoint.checkpoint, use_reentrant=False
                )
                hidden = checkpoint(
                    self._layer_forward, layer, hidden, cu_seqlens, max_seqlen, tuple(seq_lengths), backend
                )
            else:
                hidden = self._layer_forward(layer, hidden, cu_seqlens, max_seqlen, seq_lengths, backend)

        target = labels.index_select(0, masked_positions)
        mlm_logits = self.model.cls.predictions(hidden.index_select(0, masked_positions))
        token_losses = F.cross_entropy(mlm_logits.float(), target, reduction="none")
        mean_loss = token_losses.mean()
        loss = mean_loss if loss_normalizer is None else token_losses.sum() / loss_normalizer
        nsp_logits = None
        if self.nsp:
            # BertPooler takes hidden_states[:, 0]: give it each sequence's first token as [S, 1, hidden]
            first_tokens = hidden.index_select(0, cu_seqlens[:-1].long())[:, None]
            nsp_logits = self.model.cls.seq_relationship(bert.pooler(first_tokens))
            if next_sentence_label is not None:
                nsp_losses = F.cross_entropy(nsp_logits.float(), next_sentence_label, reduction="none")
                mean_loss = mean_loss + nsp_losses.mean()
                loss = loss + (nsp_losses.mean() if nsp_normalizer is None else nsp_losses.sum() / nsp_normalizer)
        return PretrainOutput(
            loss=loss, mean_loss=mean_loss, mlm_logits=mlm_logits, mlm_labels=target, nsp_logits=nsp_logits
        )

    def _layer_forward(
        self,
        layer,
        hidden: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        seq_lengths: Sequence[int],
        backend: str,
    ) -> torch.Tensor:
        """``BertLayer.forward`` on ``[T, hidden]``: ``BertSelfAttention``'s projections (heads split as
        its ``view(*input_shape, -1, head_size)``), packed attention with its ``scaling`` and, in
        training, its dropout probability, then ``BertSelfOutput`` and ``feed_forward_chunk``
        (``BertIntermediate`` + ``BertOutput``; ``apply_chunking_to_forward`` only splits that math)."""
        self_attn = layer.attention.self
        tokens = hidden.shape[0]
        heads = (tokens, self.num_heads, self.head_dim)
        query = self_attn.query(hidden).view(heads)
        key = self_attn.key(hidden).view(heads)
        value = self_attn.value(hidden).view(heads)
        dropout_p = self_attn.dropout.p if self_attn.training else 0.0
        context = packed_attention(
            query,
            key,
            value,
            cu_seqlens,
            max_seqlen,
            seq_lengths,
            dropout_p=dropout_p,
            scale=self_attn.scaling,
            backend=backend,
        )
        attention_output = layer.attention.output(context.reshape(tokens, -1), hidden)
        return layer.feed_forward_chunk(attention_output)


__all__ = [
    "ATTENTION_BACKENDS",
    "IGNORE_INDEX",
    "UnpaddedBert",
    "packed_attention",
    "probe_varlen",
    "sdpa_loop_attention",
    "sequence_lengths",
    "token_counts",
    "varlen_flash_attention",
    "varlen_supported",
    "varlen_usable",
]
