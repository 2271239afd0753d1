"""The masked-LM models we pretrain: Hugging Face models of the BERT families (:mod:`.families`) with the MLM head
run only at masked positions, padded (:mod:`.bert`) or unpadded (:mod:`.unpadded`), loaded strictly from a
checkpoint into their own architecture (:mod:`.pretrained`)."""

from .bert import PretrainOutput, SparseMLMHead, build_pretraining_model
from .config import ModelConfig

__all__ = ["ModelConfig", "PretrainOutput", "SparseMLMHead", "build_pretraining_model"]
