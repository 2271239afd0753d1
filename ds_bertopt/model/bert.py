"""The masked-LM models we pretrain (from the ``model`` section) and their padded forward with the MLM head at the
masked positions only; the unpadded forward is :mod:`.unpadded`."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from ..compat.deepspeed import is_zero3_param
from ..compat.transformers import set_attention_implementation
from ..labels import IGNORE_INDEX
from ..log import print0
from .families import family_of
from .tied import sparse_rows, tie_sparse


def build_pretraining_model(model_cfg, tokenizer, max_seq_length: int):
    """The masked-LM model: ``init_checkpoint``'s own architecture (:func:`.pretrained.load_pretrained`: BERT,
    RoBERTa, …, strictly loaded, its vocabulary covering the tokenizer's and its positions ``max_seq_length``), or
    a random ``BertForMaskedLM`` (``objective: mlm``) / ``BertForPreTraining`` (``mlm_nsp``) of the config's sizes.
    """
    from transformers import BertConfig, BertForMaskedLM, BertForPreTraining

    nsp = model_cfg.objective == "mlm_nsp"
    if model_cfg.init_checkpoint:
        from .pretrained import load_pretrained

        model, _, lines = load_pretrained(
            model_cfg.init_checkpoint,
            nsp=nsp,
            vocab_size=len(tokenizer),
            max_seq_length=max_seq_length,
            attn_implementation=model_cfg.attn_implementation,
        )
        for line in lines:
            print0(line)
        return model
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=model_cfg.hidden_size,
        num_hidden_layers=model_cfg.num_hidden_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        intermediate_size=model_cfg.intermediate_size,
        max_position_embeddings=model_cfg.max_position_embeddings,
        hidden_dropout_prob=model_cfg.hidden_dropout_prob,
        attention_probs_dropout_prob=model_cfg.attention_probs_dropout_prob,
        pad_token_id=tokenizer.pad_token_id,
    )
    set_attention_implementation(config, model_cfg.attn_implementation)
    return (BertForPreTraining if nsp else BertForMaskedLM)(config)


def mlm_loss(logits: torch.Tensor, target: torch.Tensor, loss_normalizer=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, mean)`` of the masked tokens' cross-entropy (in fp32): ``loss`` is their mean, or their sum divided by
    ``loss_normalizer`` (a tensor or number; see :class:`SparseMLMHead`); ``mean`` is always the mean (reported)."""
    token_losses = torch.nn.functional.cross_entropy(logits.float(), target, reduction="none")
    mean = token_losses.mean()
    return (mean if loss_normalizer is None else token_losses.sum() / loss_normalizer), mean


@dataclass
class PretrainOutput(ModelOutput):
    """A ``ModelOutput`` (a dict underneath), so DeepSpeed's ZeRO-3 hooks see its tensors
    (``apply_to_tensors_only`` walks dicts, not arbitrary objects)."""

    loss: "torch.Tensor" = None
    """MLM loss (mean over masked tokens, or their sum divided by ``loss_normalizer``), plus the NSP loss
    (mean over sequences) for ``mlm_nsp``."""
    mean_loss: "torch.Tensor" = None
    """The same with the MLM part as the mean over this micro-batch's masked tokens (what is reported)."""
    mlm_logits: "torch.Tensor" = None
    """``[masked tokens, vocab]`` logits at the masked positions only."""
    mlm_labels: "torch.Tensor" = None
    """``[masked tokens]`` their target ids."""
    nsp_logits: "torch.Tensor" = None
    """``[sequences, 2]`` next-sentence logits (``mlm_nsp`` only, unpadded path)."""


class SparseMLMHead(torch.nn.Module):
    """Wraps a masked-LM model of a :mod:`.families` family (padded batches) so its MLM head runs only at the
    masked positions.

    Hugging Face's heads project every position onto the vocabulary, though only the ~15 % masked
    ones have a label; gathering them first (as MLPerf BERT implementations do) removes most of the
    decoder's work: for the default 4 × 256 model with an 8k vocabulary that is a third of the
    step's FLOPs. Parameters are the wrapped model's (``.model``), so checkpoints and
    ``save_pretrained`` are unchanged. This is also how a family that cannot run unpadded (DeBERTa) trains.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.family = family_of(model)
        self.nsp = type(model).__name__ == self.family.pretraining_class
        self.tied = tie_sparse(model)  # sparse in forward only, where the head runs too: see .tied

    def forward(
        self,
        input_ids,
        attention_mask,
        token_type_ids,
        labels,
        next_sentence_label=None,
        loss_normalizer=None,
        masked_positions=None,
    ):
        """``loss_normalizer`` (a tensor or number): divide the summed MLM token losses by it instead of taking
        their mean, e.g. the step's masked-token count over all ranks and micro-batches (scaled for DeepSpeed's
        own averaging), so micro-batches of any size give the big batch's gradient. ``masked_positions``: the
        flat indices of the masked tokens, computed by the collator on the host; without them a boolean mask
        picks them, a host sync on accelerators (its result's size depends on the data). ``token_type_ids`` are
        ignored by families without token types; RoBERTa's copies derive their position ids from the padding."""
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self.family.token_types:
            inputs["token_type_ids"] = token_type_ids
        with sparse_rows(self.model):  # the tied decoder runs below, in this same forward
            encoded = self.model.base_model(**inputs)
        hidden = encoded.last_hidden_state
        if masked_positions is None:
            selected = labels != IGNORE_INDEX
            target, masked_hidden = labels[selected], hidden[selected]
        else:
            target = labels.reshape(-1).index_select(0, masked_positions)
            masked_hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, masked_positions)
        logits = self.family.head(self.model, masked_hidden)
        loss, mean = mlm_loss(logits, target, loss_normalizer)
        if self.nsp and next_sentence_label is not None:
            nsp_logits = self.model.cls.seq_relationship(encoded.pooler_output)
            nsp = torch.nn.functional.cross_entropy(nsp_logits.float(), next_sentence_label)
            loss, mean = loss + nsp, mean + nsp
        return PretrainOutput(loss=loss, mean_loss=mean, mlm_logits=logits, mlm_labels=target)


def save_hf_model(module: torch.nn.Module, path: str, *, is_main: bool, tokenizer=None) -> None:
    """Hugging Face format (``from_pretrained``-loadable, fp32; PEFT models: their adapter files), gathered under
    ZeRO-3. Collective: every rank calls it; rank 0 writes."""

    import deepspeed

    params = list(module.parameters())
    zero3 = any(is_zero3_param(p) for p in params)
    gather = deepspeed.zero.GatheredParameters(params, modifier_rank=None) if zero3 else contextlib.nullcontext()
    with gather:
        if is_main:
            state = {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}
            module.save_pretrained(path, state_dict=state)
    if is_main:
        if tokenizer is not None:
            tokenizer.save_pretrained(path)

        print0(f"final model written to {path}")
