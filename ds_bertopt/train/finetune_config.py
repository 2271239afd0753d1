"""Config of sequence-classification fine-tuning (``"bertopt": {"finetune": {...}}``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import check


@dataclass(frozen=True)
class FinetuneConfig:
    model_name_or_path: Optional[str] = None
    """Directory of a Hugging Face BERT-family checkpoint (e.g. MiniLM, or our pretraining's ``final/``)."""
    train_file: Optional[str] = None
    """Labelled training data: ``.csv`` or ``.jsonl``."""
    validation_file: Optional[str] = None
    """Labelled evaluation data, same format."""
    text_column: str = "text"
    """Column holding the input text."""
    label_column: str = "label"
    """Column holding the integer class label."""
    max_seq_length: int = 128
    """Inputs are truncated to this many tokens."""
    epochs: int = 2
    """Passes over the training data."""

    def validate(self) -> None:
        check(self.max_seq_length >= 8, f"max_seq_length: must be at least 8, got {self.max_seq_length}")
        check(self.epochs >= 1, f"epochs: must be at least 1, got {self.epochs}")
