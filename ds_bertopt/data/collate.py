"""Dynamic padding and MLM masking for one micro-batch (pure functions, explicit RNG).

Each micro-batch is padded to its own longest sample rounded up to ``pad_multiple`` (never beyond
the longest allowed sequence), not to ``max_seq_length``. Masking selects ``mlm_probability`` of
the non-special tokens; of those 80 % become ``[MASK]``, 10 % a random token, 10 % stay. The RNG
is a ``torch.Generator`` the caller seeds from (seed, epoch, step, rank), so masks are
reproducible and a resumed run sees exactly the masks an uninterrupted run would.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional, Sequence

import numpy as np
import torch

from ..errors import ConfigError
from ..labels import IGNORE_INDEX


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


def mask_tokens(
    input_ids: torch.Tensor,
    maskable: torch.Tensor,
    *,
    mask_id: int,
    vocab_size: int,
    probability: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
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
            batch["input_ids"],
            maskable,
            mask_id=self.mask_id,
            vocab_size=self.vocab_size,
            probability=self.mlm_probability,
            generator=generator,
        )
        # flat indices of the masked tokens, found here on the host so the model's gather needs no device sync
        batch["masked_positions"] = torch.nonzero(batch["labels"].reshape(-1) != IGNORE_INDEX).flatten()
        return batch


# --- packed (unpadded) micro-batches, for ``ds_bertopt.model.unpadded.UnpaddedBert`` -----------------------
def pack_sequences(samples: Sequence[dict]) -> dict:
    """Concatenate a micro-batch's samples into one padding-free batch for ``UnpaddedBert``.

    Each sample is a dict with ``input_ids`` and ``token_type_ids`` (lists or 1-D tensors of equal
    length), optionally ``labels`` (same length; ``-100`` where not masked: i.e. ids already masked
    by the caller) and ``next_sentence_label`` (int; all samples or none). MLM masking is not done
    here: either pass already-masked ids with per-sample ``labels``, or pack unmasked ids, mask the
    packed ``input_ids`` (e.g. ``mask_tokens`` in ``ds_bertopt.data.collate`` works on any shape) and
    attach the result with :func:`with_mlm_labels`.

    Returns tensors ``input_ids``, ``token_type_ids``, ``position_ids`` (restart at 0 per
    sequence), all ``[T]`` int64; ``cu_seqlens`` ``[S+1]`` int32; ``labels`` ``[T]`` and
    ``masked_positions`` ``[M]`` int64 when labels are given; ``next_sentence_label`` ``[S]``; and the
    host-side ``max_seqlen`` (int) and ``seq_lengths`` (tuple of ints) that let the forward run
    without host syncs. Keep the last two Python objects when moving the batch to a device.
    """
    if not samples:
        raise ValueError("pack_sequences: no samples")
    lengths = tuple(len(s["input_ids"]) for s in samples)
    for i, s in enumerate(samples):
        if len(s["token_type_ids"]) != lengths[i] or ("labels" in s and len(s["labels"]) != lengths[i]):
            raise ValueError(f"pack_sequences: sample {i} has input_ids, token_type_ids, labels of unequal lengths")
    if min(lengths) == 0:
        raise ValueError("pack_sequences: a sample has no tokens")
    cat = lambda key: torch.cat([torch.as_tensor(s[key], dtype=torch.long) for s in samples])  # noqa: E731
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(torch.as_tensor(lengths), 0)
    batch = {
        "input_ids": cat("input_ids"),
        "token_type_ids": cat("token_type_ids"),
        "position_ids": torch.cat([torch.arange(n) for n in lengths]),
        "cu_seqlens": cu_seqlens,
        "max_seqlen": max(lengths),
        "seq_lengths": lengths,
    }
    has_labels = ["labels" in s for s in samples]
    if any(has_labels):
        if not all(has_labels):
            raise ValueError("pack_sequences: some samples have labels and some not")
        batch = with_mlm_labels(batch, batch["input_ids"], cat("labels"))
    has_nsp = ["next_sentence_label" in s for s in samples]
    if any(has_nsp):
        if not all(has_nsp):
            raise ValueError("pack_sequences: some samples have next_sentence_label and some not")
        batch["next_sentence_label"] = torch.as_tensor([s["next_sentence_label"] for s in samples], dtype=torch.long)
    return batch


def document_lengths(input_ids: Sequence[int], start_id: Optional[int]) -> list[int]:
    """The lengths of the documents one example holds, cut before every ``start_id`` (the token a document starts
    with: the tokenizer's ``[CLS]`` / ``<s>``) after its first token; ``[len(input_ids)]`` without ``start_id``.

    ``group_texts`` (transformers' ``run_mlm.py`` without ``--line_by_line``) concatenates documents, each tokenized
    with its special tokens, and cuts the stream into blocks of ``max_seq_length``: a block holds the end of one
    document and the starts of others. Packed as one sequence per document (:func:`pack_sequences`: one
    ``cu_seqlens`` segment each, positions restarting at 0), no token attends across a document boundary, as the
    launcher's sequences never mix two documents (:func:`ds_bertopt.data.sequences.mlm_sequences`)."""
    ids = np.asarray(input_ids)
    if start_id is None or ids.size == 0:
        return [int(ids.size)]
    bounds = np.concatenate([[0], np.flatnonzero(ids[1:] == start_id) + 1, [ids.size]])
    return np.diff(bounds).tolist()


def with_mlm_labels(batch: dict, input_ids: torch.Tensor, labels: torch.Tensor) -> dict:
    """A copy of a packed ``batch`` with (masked) ``input_ids``, ``labels`` ``[T]`` and the host-computed
    ``masked_positions`` (indices where ``labels != -100``), so the forward's gather needs no sync."""
    if input_ids.shape != batch["position_ids"].shape or labels.shape != input_ids.shape:
        raise ValueError(
            f"with_mlm_labels: input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} "
            f"must both be [T] = {tuple(batch['position_ids'].shape)}"
        )
    out = dict(batch)
    out["input_ids"] = input_ids.long()
    out["labels"] = labels.long()
    out["masked_positions"] = torch.nonzero(labels != IGNORE_INDEX).flatten()
    return out


class PackedMLMCollator(MLMCollator):
    """Packs a list of samples into one padding-free row (:func:`pack_sequences`) and masks it."""

    def __call__(self, samples: Sequence[dict], generator: torch.Generator) -> dict[str, torch.Tensor]:
        batch = pack_sequences(samples)
        maskable = ~torch.isin(batch["input_ids"], self.special_ids)
        ids, labels = mask_tokens(
            batch["input_ids"],
            maskable,
            mask_id=self.mask_id,
            vocab_size=self.vocab_size,
            probability=self.mlm_probability,
            generator=generator,
        )
        return with_mlm_labels(batch, ids, labels)


def step_generator(*keys: int) -> torch.Generator:
    """A generator seeded deterministically from integer keys (seed, epoch, step, rank, …)."""
    seed = 0
    for key in keys:
        seed = (seed * 1_000_003 + int(key) + 1) % (2**63 - 1)
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


def padded_positions(lengths: Sequence[int], width: int) -> torch.Tensor:
    """Each packed token's flat position ``row × width + position`` in the padded ``[len(lengths), width]`` layout
    (``ds_bertopt.model.heads.to_padded`` lays packed values out with it)."""
    return torch.cat([torch.arange(n) + row * width for row, n in enumerate(lengths)])


def collate_task_batch(samples: Sequence[dict], task: str, *, packed: bool, pad_id: int, pad_multiple: int = 1) -> dict:
    """One fine-tuning micro-batch, packed (:func:`pack_sequences`) or padded (:func:`pad_batch`).

    ``samples``: dicts with ``input_ids``, ``token_type_ids`` and the task's target: ``label`` (classification: an
    int, regression: a float), ``labels`` (token classification: one per token, ``-100`` where not labelled) or
    ``start_position``/``end_position`` (question answering: token indices within the sample). The batch carries
    ``labels`` ``[S]`` (token classification: ``[P]``, the labelled tokens only, at ``label_positions``: flat indices
    into the packed row or the padded ``[S, L]`` batch), ``start_positions``/``end_positions`` ``[S]``, ``pad_index``
    (packed: each token's flat position in ``[S, max_seqlen]``), and the host ints ``num_tokens`` (real tokens) and
    ``num_targets`` (sequences; token classification: labelled tokens)."""
    tokens = [{"input_ids": s["input_ids"], "token_type_ids": s["token_type_ids"]} for s in samples]
    if task == "token_classification":
        for sample, kept in zip(samples, tokens):
            kept["labels"] = sample["labels"]
    if packed:
        batch = pack_sequences(tokens)
        batch["pad_index"] = padded_positions(batch["seq_lengths"], batch["max_seqlen"])
        num_tokens = int(batch["input_ids"].numel())
    else:
        batch = pad_batch(tokens, pad_id, pad_multiple, cap=1 << 30)
        num_tokens = int(batch["attention_mask"].sum())
        if task == "token_classification":
            labels = torch.full(batch["input_ids"].shape, IGNORE_INDEX, dtype=torch.long)
            for row, sample in enumerate(samples):
                labels[row, : len(sample["labels"])] = torch.as_tensor(sample["labels"], dtype=torch.long)
            batch["labels"] = labels.reshape(-1)
    if task == "token_classification":
        positions = torch.nonzero(batch.pop("labels") != IGNORE_INDEX).flatten()
        flat = torch.cat([torch.as_tensor(s["labels"], dtype=torch.long) for s in samples])
        batch.pop("masked_positions", None)
        batch["labels"] = flat[flat != IGNORE_INDEX]
        batch["label_positions"] = positions
        num_targets = len(positions)
    else:
        num_targets = len(samples)
    if task in ("classification", "regression"):
        dtype = torch.float32 if task == "regression" else torch.long
        batch["labels"] = torch.as_tensor([s["label"] for s in samples], dtype=dtype)
    elif task == "question_answering":
        batch["start_positions"] = torch.as_tensor([s["start_position"] for s in samples], dtype=torch.long)
        batch["end_positions"] = torch.as_tensor([s["end_position"] for s in samples], dtype=torch.long)
    return {**batch, "num_tokens": num_tokens, "num_targets": num_targets}


# --- a Trainer-style collator: features in, one packed row out --------------------------------------------------
TARGET_KEYS = {
    "classification": ("labels",),
    "regression": ("labels",),
    "token_classification": ("labels",),
    "question_answering": ("start_positions", "end_positions"),
}


def _real_tokens(feature: Mapping, index: int) -> int:
    """The feature's token count: all of ``input_ids``, or the leading ones its ``attention_mask`` keeps."""
    mask = feature.get("attention_mask")
    length = len(feature["input_ids"])
    if mask is None:
        return length
    mask = [int(m) for m in mask]
    n = sum(mask)
    if mask != [1] * n + [0] * (length - n):
        raise ConfigError(
            f"model.unpadded: feature {index} of the batch is not right-padded (its attention_mask is not ones then "
            "zeros); tokenize with padding_side='right'"
        )
    return n


def _label(feature: Mapping):
    for key in ("labels", "label", "label_ids"):
        if key in feature and feature[key] is not None:
            return feature[key]
    return None


class PackedTaskFeatures:
    """A ``Trainer`` collator for ``task``: features (mappings with ``input_ids``, optionally ``token_type_ids``,
    ``attention_mask`` and the task's targets ``labels``/``label``, or ``start_positions``/``end_positions``) → one
    packed row for ``ds_bertopt.model.heads.UnpaddedTaskWithLoss``: token-wise tensors ``[1, T]``, ``cu_seqlens``,
    the host ``max_seqlen`` and ``seq_lengths``, ``pad_index`` (token classification, question answering), and the
    targets, first (``Trainer`` counts examples by the first tensor's first dimension): ``labels [S]``, token
    classification's ``[S, L]`` padded with ``-100``, ``start_positions``/``end_positions [S]``. A feature padded up
    front (its ``attention_mask`` ones then zeros) is cut to its real tokens. Targets are given for every feature of a
    batch or for none (prediction)."""

    def __init__(self, task: str):
        self.task = task

    def __call__(self, features: list) -> dict:
        samples, targets = [], {key: [] for key in TARGET_KEYS[self.task]}
        for index, feature in enumerate(features):
            if not isinstance(feature, Mapping) or "input_ids" not in feature:
                raise ConfigError("model.unpadded: training examples must be mappings with input_ids")
            n = _real_tokens(feature, index)
            types = feature.get("token_type_ids")
            samples.append(
                {"input_ids": list(feature["input_ids"])[:n], "token_type_ids": list(types)[:n] if types else [0] * n}
            )
            for key in targets:
                value = _label(feature) if key == "labels" else feature.get(key)
                targets[key].append(list(value)[:n] if self.task == "token_classification" and value else value)
        packed = pack_sequences(samples)
        width = packed["max_seqlen"]
        batch = {}
        for key, values in targets.items():
            given = [v is not None for v in values]
            if any(given) and not all(given):
                raise ConfigError(f"model.unpadded: some examples of a batch have {key} and some not")
            if all(given):
                batch[key] = self._target(values, width)
        for key in ("input_ids", "token_type_ids", "position_ids"):
            batch[key] = packed[key][None]
        batch.update(cu_seqlens=packed["cu_seqlens"], max_seqlen=width, seq_lengths=packed["seq_lengths"])
        if self.task in ("token_classification", "question_answering"):
            batch["pad_index"] = padded_positions(packed["seq_lengths"], width)
        return batch

    def _target(self, values: list, width: int) -> torch.Tensor:
        if self.task == "token_classification":  # [S, L], -100 beyond each sequence
            out = torch.full((len(values), width), IGNORE_INDEX, dtype=torch.long)
            for row, labels in enumerate(values):
                out[row, : len(labels)] = torch.as_tensor(labels, dtype=torch.long)
            return out
        dtype = torch.float32 if self.task == "regression" else torch.long
        return torch.as_tensor(values, dtype=dtype).reshape(len(values))
