"""Dynamic padding and MLM masking for one micro-batch (pure functions, explicit RNG).

Each micro-batch is padded to its own longest sample rounded up to ``pad_multiple`` (never beyond
the longest allowed sequence), not to ``max_seq_length``. Masking selects ``mlm_probability`` of
the non-special tokens; of those 80 % become ``[MASK]``, 10 % a random token, 10 % stay. The RNG
is a ``torch.Generator`` the caller seeds from (seed, epoch, step, rank), so masks are
reproducible and a resumed run sees exactly the masks an uninterrupted run would.
"""
from __future__ import annotations

from typing import Sequence

import torch

IGNORE_INDEX = -100


def padded_length(lengths: Sequence[int], pad_multiple: int, cap: int) -> int:
    longest = max(lengths)
    return min(cap, -(-longest // pad_multiple) * pad_multiple) if longest <= cap else longest


def pad_batch(samples: Sequence[dict], pad_id: int, pad_multiple: int, cap: int) -> dict[str, torch.Tensor]:
    """Stack ``input_ids``/``token_type_ids`` (and NSP labels when present) with dynamic padding."""
    length = padded_length([len(s["input_ids"]) for s in samples], pad_multiple, cap)
    batch = len(samples)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    token_type_ids = torch.zeros((batch, length), dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        input_ids[row, :n] = torch.as_tensor(sample["input_ids"], dtype=torch.long)
        token_type_ids[row, :n] = torch.as_tensor(sample["token_type_ids"], dtype=torch.long)
        attention_mask[row, :n] = 1
    out = {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": attention_mask}
    if "next_sentence_label" in samples[0]:
        out["next_sentence_label"] = torch.as_tensor([s["next_sentence_label"] for s in samples], dtype=torch.long)
    return out


def mask_tokens(input_ids: torch.Tensor, maskable: torch.Tensor, *, mask_id: int, vocab_size: int,
                probability: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(masked_input_ids, labels)``; labels are ``IGNORE_INDEX`` except at selected positions.

    ``maskable`` is a bool tensor, False at padding and special tokens. At least one token per
    batch is selected so the loss is always defined.
    """
    draw = torch.rand(input_ids.shape, generator=generator)
    selected = (draw < probability) & maskable
    if not selected.any() and maskable.any():
        first = maskable.flatten().nonzero()[0]
        selected.view(-1)[first] = True
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    action = torch.rand(input_ids.shape, generator=generator)
    random_tokens = torch.randint(vocab_size, input_ids.shape, generator=generator)
    masked = input_ids.clone()
    masked[selected & (action < 0.8)] = mask_id
    use_random = selected & (action >= 0.8) & (action < 0.9)
    masked[use_random] = random_tokens[use_random]
    return masked, labels


class MLMCollator:
    """Pads a list of samples and masks it; ``collator(samples, generator)``."""

    def __init__(self, tokenizer, *, mlm_probability: float, pad_multiple: int, max_length: int):
        self.pad_id = tokenizer.pad_token_id
        self.mask_id = tokenizer.mask_token_id
        self.vocab_size = len(tokenizer)
        self.special_ids = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)
        self.mlm_probability = mlm_probability
        self.pad_multiple = pad_multiple
        self.max_length = max_length

    def __call__(self, samples: Sequence[dict], generator: torch.Generator) -> dict[str, torch.Tensor]:
        batch = pad_batch(samples, self.pad_id, self.pad_multiple, self.max_length)
        maskable = batch["attention_mask"].bool() & ~torch.isin(batch["input_ids"], self.special_ids)
        batch["input_ids"], batch["labels"] = mask_tokens(
            batch["input_ids"], maskable, mask_id=self.mask_id, vocab_size=self.vocab_size,
            probability=self.mlm_probability, generator=generator)
        return batch


def step_generator(*keys: int) -> torch.Generator:
    """A generator seeded deterministically from integer keys (seed, epoch, step, rank, …)."""
    seed = 0
    for key in keys:
        seed = (seed * 1_000_003 + int(key) + 1) % (2 ** 63 - 1)
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen
