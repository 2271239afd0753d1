"""Build the BERT model for pretraining from the ``model`` section."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from ..errors import ConfigError
from ..log import print0
from .local import check_model_dir


def build_pretraining_model(model_cfg, tokenizer, max_seq_length: int):
    """``BertForMaskedLM`` (``objective: mlm``) or ``BertForPreTraining`` (``mlm_nsp``).

    Random init from the config's sizes, or ``init_checkpoint`` (a Hugging Face directory) whose
    vocabulary must match the tokenizer's and whose positions must cover ``max_seq_length``.
    """
    from transformers import BertConfig, BertForMaskedLM, BertForPreTraining

    cls = BertForPreTraining if model_cfg.objective == "mlm_nsp" else BertForMaskedLM
    vocab = len(tokenizer)
    if model_cfg.init_checkpoint:
        path = os.path.abspath(os.path.expanduser(model_cfg.init_checkpoint))
        check_model_dir(path, "model.init_checkpoint")  # an empty directory is not read as BERT's defaults
        config = BertConfig.from_pretrained(path)
        if config.vocab_size != vocab:
            raise ConfigError(
                f"model.init_checkpoint: the model's vocabulary has {config.vocab_size} entries but "
                f"the tokenizer has {vocab}; use the tokenizer the model was trained with"
            )
        if config.max_position_embeddings < max_seq_length:
            raise ConfigError(
                f"data.max_seq_length: {max_seq_length} exceeds the checkpoint's "
                f"max_position_embeddings {config.max_position_embeddings}"
            )
        return cls.from_pretrained(path, attn_implementation=model_cfg.attn_implementation)
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=model_cfg.hidden_size,
        num_hidden_layers=model_cfg.num_hidden_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        intermediate_size=model_cfg.intermediate_size,
        max_position_embeddings=model_cfg.max_position_embeddings,
        hidden_dropout_prob=model_cfg.hidden_dropout_prob,
        attention_probs_dropout_prob=model_cfg.attention_probs_dropout_prob,
        pad_token_id=tokenizer.pad_token_id,
    )
    config._attn_implementation = model_cfg.attn_implementation
    return cls(config)


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
    """Wraps ``BertForMaskedLM``/``BertForPreTraining`` so the MLM head runs only at masked positions.

    Hugging Face's heads project every position onto the vocabulary, though only the ~15 % masked
    ones have a label; gathering them first (as MLPerf BERT implementations do) removes most of the
    decoder's work: for the default 4 × 256 model with an 8k vocabulary that is a third of the
    step's FLOPs. Parameters are the wrapped model's (``.model``), so checkpoints and
    ``save_pretrained`` are unchanged.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.nsp = hasattr(model.cls, "seq_relationship")

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
        picks them, a host sync on accelerators (its result's size depends on the data)."""
        encoded = self.model.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        hidden = encoded.last_hidden_state
        if masked_positions is None:
            selected = labels != -100
            target, masked_hidden = labels[selected], hidden[selected]
        else:
            target = labels.reshape(-1).index_select(0, masked_positions)
            masked_hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, masked_positions)
        if self.nsp:
            logits = self.model.cls.predictions(masked_hidden)
        else:
            logits = self.model.cls(masked_hidden)
        token_losses = torch.nn.functional.cross_entropy(logits.float(), target, reduction="none")
        mean = token_losses.mean()
        loss = mean if loss_normalizer is None else token_losses.sum() / loss_normalizer
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
    zero3 = any(hasattr(p, "ds_id") for p in params)
    gather = deepspeed.zero.GatheredParameters(params, modifier_rank=None) if zero3 else contextlib.nullcontext()
    with gather:
        if is_main:
            state = {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}
            module.save_pretrained(path, state_dict=state)
    if is_main:
        if tokenizer is not None:
            tokenizer.save_pretrained(path)

        print0(f"final model written to {path}")
