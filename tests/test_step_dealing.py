"""Variable micro-batch sizes keep the big batch's gradient: the same global batch dealt to 2 ranks × 2
micro-batches in two different ways, through the real ``deepspeed.initialize`` and the loop's
``step_loss_normalizer``, reduces to the same gradient, which is the one-process mean over every masked token.
Padded (``SparseMLMHead``) and unpadded (``UnpaddedBert``) models, ZeRO 0 and 2."""

from __future__ import annotations

import pytest
import torch

from ds_bertopt.testing.distributed import spawn_ranks

WORLD, ACCUM, VOCAB = 2, 2, 60
# 8 sequences of mixed lengths; two dealings of them: rank -> its micro-batches
LENGTHS = [5, 17, 9, 12, 3, 20, 7, 14]
DEALINGS = {
    "uneven": [[[0, 1, 2], [3]], [[4], [5, 6, 7]]],
    "shuffled": [[[7, 0], [5, 2]], [[1, 3], [4, 6]]],
}


def _samples():
    gen = torch.Generator().manual_seed(0)
    out = []
    for n in LENGTHS:
        ids = torch.randint(5, VOCAB, (n,), generator=gen)
        labels = torch.where(torch.rand(n, generator=gen) < 0.4, ids, torch.full_like(ids, -100))
        labels[0] = ids[0]  # at least one target per sequence
        out.append({"input_ids": ids.tolist(), "token_type_ids": [0] * n, "labels": labels.tolist()})
    return out


def _model(unpadded: bool):
    from transformers import BertConfig, BertForMaskedLM

    from ds_bertopt.model import SparseMLMHead
    from ds_bertopt.model.unpadded import UnpaddedBert

    torch.manual_seed(0)
    model = BertForMaskedLM(
        BertConfig(
            vocab_size=VOCAB,
            hidden_size=24,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=48,
            max_position_embeddings=32,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )
    return UnpaddedBert(model) if unpadded else SparseMLMHead(model)


def _batch(samples: list[dict], unpadded: bool) -> dict:
    from ds_bertopt.data.collate import pack_sequences, pad_batch

    if unpadded:
        return pack_sequences(samples)
    batch = pad_batch(samples, pad_id=0, pad_multiple=1, cap=32)
    labels = torch.full_like(batch["input_ids"], -100)
    for row, s in enumerate(samples):
        labels[row, : len(s["labels"])] = torch.tensor(s["labels"])
    batch["labels"] = labels
    return batch


def _reduced_gradients(rank: int, world: int, unpadded: bool, stage: int) -> dict:
    from ds_bertopt import optim
    from ds_bertopt.configlib import load_section
    from ds_bertopt.config import BertOptConfig
    from ds_bertopt.engine import initialize
    from ds_bertopt.train.loop import step_loss_normalizer

    samples = _samples()
    out = {}
    for name, dealing in DEALINGS.items():
        model = _model(unpadded)
        bertopt = load_section(BertOptConfig, {"train": {"max_steps": 2, "precision": "fp32"}}, "bertopt")
        optimizer, scheduler = optim.build(model, bertopt, global_batch=8, zero_stage=stage)
        ds = {
            "train_batch_size": 8,
            "gradient_accumulation_steps": ACCUM,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage},
            "steps_per_print": 10**9,
            "bertopt": {"train": {"precision": "fp32"}},
        }
        engine, *_ = initialize(config=ds, model=model, optimizer=optimizer, lr_scheduler=scheduler)
        batches = [_batch([samples[i] for i in micro], unpadded) for micro in dealing[rank]]
        targets = sum(int((b["labels"] != -100).sum()) for b in batches)
        normalizer = step_loss_normalizer(targets, ACCUM, world, engine.device)
        for index, batch in enumerate(batches):
            engine.backward(engine(**batch, loss_normalizer=normalizer).loss)
            if index < len(batches) - 1:
                engine.step()
        from deepspeed.utils import safe_get_full_grad

        # numpy: tensors would cross the process boundary as shared memory that dies with the rank
        out[name] = {n: safe_get_full_grad(p).detach().double().numpy() for n, p in engine.module.named_parameters()}
    return out


def _reference(unpadded: bool) -> dict:
    """One process, one forward over all 8 sequences, the plain mean over every masked token."""
    model = _model(unpadded)
    batch = _batch(_samples(), unpadded)
    model(**batch).loss.backward()
    return {n: p.grad.double() for n, p in model.named_parameters()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "unpadded, stage", [(True, 0), (True, 2), (False, 0)], ids=["unpadded-zero0", "unpadded-zero2", "padded-zero0"]
)
def test_two_dealings_give_the_big_batch_gradient(unpadded, stage):
    results = spawn_ranks(_reduced_gradients, WORLD, unpadded, stage, timeout=280)
    reference = _reference(unpadded)
    for rank_result in results:
        for name in DEALINGS:
            for key, want in reference.items():
                torch.testing.assert_close(
                    torch.from_numpy(rank_result[name][key]),
                    want,
                    rtol=1e-4,
                    atol=1e-6,
                    msg=lambda m, k=key, d=name: f"{d} {k}: {m}",
                )
    moved = max(float(g.abs().max()) for g in reference.values())
    assert moved > 1e-3  # the gradients are not trivially zero
