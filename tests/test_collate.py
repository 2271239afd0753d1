"""Dynamic padding and MLM masking statistics."""

from __future__ import annotations

import torch

from ds_bertopt.data.collate import (
    IGNORE_INDEX,
    document_lengths,
    mask_tokens,
    pad_batch,
    padded_length,
    step_generator,
)


def test_padded_length_rounds_up_to_multiple_and_caps():
    assert padded_length([5, 17, 9], 8, 512) == 24
    assert padded_length([16], 8, 512) == 16
    assert padded_length([510], 8, 512) == 512


def test_document_lengths_cut_before_every_document_start_but_the_first_token():
    # a group_texts block: the end of one document, two whole ones, the start of a fourth (101 starts a document)
    assert document_lengths([7, 102, 101, 8, 9, 102, 101, 102, 101, 5], 101) == [2, 4, 2, 2]
    assert document_lengths([101, 8, 102], 101) == [3]  # one example, one document (line by line)
    assert document_lengths([101, 8, 101], None) == [3]  # no start token known: not cut


def test_pad_batch_masks_padding():
    samples = [
        {"input_ids": [2, 10, 3], "token_type_ids": [0, 0, 0]},
        {"input_ids": [2, 10, 11, 12, 13, 3], "token_type_ids": [0] * 6},
    ]
    batch = pad_batch(samples, pad_id=0, pad_multiple=8, cap=512)
    assert batch["input_ids"].shape == (2, 8)
    assert batch["attention_mask"].sum(1).tolist() == [3, 6]
    assert batch["input_ids"][0, 3:].eq(0).all()


def test_masking_rates_80_10_10_and_never_special():
    torch.manual_seed(0)
    ids = torch.randint(10, 1000, (400, 128))
    maskable = torch.ones_like(ids, dtype=torch.bool)
    maskable[:, 0] = maskable[:, -1] = False  # [CLS]/[SEP]
    maskable[:, 100:] = False  # padding
    masked, labels = mask_tokens(
        ids, maskable, mask_id=4, vocab_size=1000, probability=0.15, generator=step_generator(1, 2, 3)
    )
    selected = labels != IGNORE_INDEX
    assert not selected[~maskable].any()
    rate = selected.sum().item() / maskable.sum().item()
    assert abs(rate - 0.15) < 0.005
    n = selected.sum().item()
    as_mask = (masked[selected] == 4).sum().item() / n
    unchanged = (masked[selected] == ids[selected]).sum().item() / n
    assert abs(as_mask - 0.8) < 0.01
    assert abs(unchanged - 0.1) < 0.01 + 0.001  # random tokens equal to the original add ~0.01 %
    assert torch.equal(masked[~selected], ids[~selected])
    assert torch.equal(labels[selected], ids[selected])


def test_masking_is_deterministic_per_key_and_differs_across_keys():
    ids = torch.randint(10, 1000, (8, 64))
    maskable = torch.ones_like(ids, dtype=torch.bool)
    a = mask_tokens(ids, maskable, mask_id=4, vocab_size=1000, probability=0.15, generator=step_generator(7, 1))
    b = mask_tokens(ids, maskable, mask_id=4, vocab_size=1000, probability=0.15, generator=step_generator(7, 1))
    c = mask_tokens(ids, maskable, mask_id=4, vocab_size=1000, probability=0.15, generator=step_generator(7, 2))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], c[1])


def test_at_least_one_token_is_masked():
    ids = torch.tensor([[2, 50, 3]])
    maskable = torch.tensor([[False, True, False]])
    _, labels = mask_tokens(ids, maskable, mask_id=4, vocab_size=100, probability=1e-9, generator=step_generator(0))
    assert labels[0, 1] == 50
