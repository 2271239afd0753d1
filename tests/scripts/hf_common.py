"""Shared helpers of the Hugging Face integration tests (imported by the tests and by hf_train.py)."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import torch

POSITIVE = "good great wonderful moving funny brilliant charming smart".split()
NEGATIVE = "bad awful boring dull tedious clumsy flat stupid".split()
FILLER = "the film movie story plot actors it is was a this and".split()

FIXED_TEXTS = (
    "A three-hour cinema master class.",
    "Dull, tedious and far too long for what it has to say.",
    "Funny.",
    "An ambitious, messy film that still moves you in its final act, mostly.",
)
"""The fixed batch on which saved-for-backward bytes are compared (different lengths: padding matters)."""

KIT = {"sdpa_attention": True, "dropout_mask": "regenerate", "layernorm_saves_output": True, "recompute_gelu": True}
WTACRS = {"enabled": True, "ratio": 0.3, "min_k": 8, "grad_norm_cache": True, "kit": KIT}
"""The ``"wtacrs"`` section of the launcher tests (the shipped finetune configs' kit; min_k for short batches)."""


def sentiment_csv(path: Path, n: int, seed: int) -> Path:
    """An easy two-class task: the label is which word list the snippet draws from."""
    rng = random.Random(seed)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["text", "label"])
        for i in range(n):
            label = i % 2
            words = [rng.choice(POSITIVE if label else NEGATIVE) for _ in range(rng.randint(3, 6))]
            words += [rng.choice(FILLER) for _ in range(rng.randint(0, 4))]
            rng.shuffle(words)
            writer.writerow([" ".join(words), label])
    return path


def balanced_subset_csv(source: Path, path: Path, per_label: int, seed: int) -> Path:
    """``per_label`` random rows of each label of ``source`` (text,label columns), shuffled."""
    with open(source, newline="", encoding="utf-8") as fh:
        rows = [(r["text"], int(r["label"])) for r in csv.DictReader(fh)]
    rng = random.Random(seed)
    picked = [
        row
        for label in sorted({r[1] for r in rows})
        for row in rng.sample([r for r in rows if r[1] == label], per_label)
    ]
    rng.shuffle(picked)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["text", "label"])
        writer.writerows(picked)
    return path


def deepspeed_json(path: Path, stage: int, bertopt: dict) -> Path:
    """A Trainer-style DeepSpeed config ("auto" batch values) with a ``"bertopt"`` section, fp32 pinned."""
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "steps_per_print": 1_000_000,
        "bertopt": bertopt,
    }
    path.write_text(json.dumps(config, indent=1), encoding="utf-8")
    return path


def fixed_batch(tokenizer) -> dict:
    """:data:`FIXED_TEXTS` padded to the longest, with labels."""
    batch = dict(tokenizer(list(FIXED_TEXTS), padding=True, return_tensors="pt"))
    batch["labels"] = torch.tensor([1, 0, 1, 1])
    return batch


def saved_bytes_on_fixed_batch(model, tokenizer, seed: int = 1234) -> dict:
    """Saved-for-backward bytes of one training forward on :func:`fixed_batch`, the RNG seeded first: WTA-CRS
    stores each drawn row once, so the byte count depends on the draws (same weights + seed: same draws)."""
    from ds_bertopt.wtacrs.memory import saved_tensor_bytes

    batch = fixed_batch(tokenizer)
    torch.manual_seed(seed)
    return saved_tensor_bytes(model, batch)
