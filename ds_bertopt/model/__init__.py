"""The BERT models we pretrain: Hugging Face ``BertForMaskedLM``/``BertForPreTraining`` with the MLM head
run only at masked positions (:mod:`.bert`)."""

from .bert import PretrainOutput, SparseMLMHead, build_pretraining_model
from .config import ModelConfig

__all__ = ["ModelConfig", "PretrainOutput", "SparseMLMHead", "build_pretraining_model"]
