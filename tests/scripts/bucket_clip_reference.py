"""Shared by ``tests/test_bucket_clip_engine.py`` and ``tests/scripts/bucket_clip_train.py``: a tiny
BERT-like model and the reference result of bucket clipping, computed from the formula alone.

The reference gathers every rank's local gradient (recomputed on a plain copy of the model),
clips it per bucket in float64 with thresholds recomputed from scratch, and averages over ranks.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist

from ds_bertopt.compat import deepspeed as ds_compat

VOCAB, DIM, SEQ, MICRO = 50, 32, 6, 4
BUCKET = 1500  # elements: the tied embedding (1600) gets a bucket of its own, the layers share


class TinyLM(torch.nn.Module):
    """Embedding tied to the output projection (as in BERT), a few layers, optionally an unused parameter."""

    def __init__(self, unused: bool = False):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(DIM, DIM),
            torch.nn.Tanh(),
            torch.nn.Linear(DIM, DIM),
            torch.nn.Tanh(),
            torch.nn.Linear(DIM, DIM),
        )
        self.norm = torch.nn.LayerNorm(DIM)
        self.unused = torch.nn.Parameter(torch.zeros(7)) if unused else None

    def forward(self, batch):
        tokens, targets = batch
        hidden = self.norm(self.layers(self.embed(tokens)))
        logits = hidden @ self.embed.weight.t()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


def micro_batches(rank: int, count: int, step: int = 0):
    gen = torch.Generator().manual_seed(1000 + 100 * step + 10 * rank)
    return [
        (torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen), torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen))
        for _ in range(count)
    ]


def ds_config(stage: int, gas: int, clip: dict | None, bf16: bool = False, extra: dict | None = None) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True},
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
        if ds_compat.version_at_least("0.17"):  # the key came with 0.17 (0.16's config parser refuses it)
            cfg["bf16"]["check_grad_overflow"] = True
    # precision pinned: "auto" would pick bf16 on CPUs with native bf16 and miss the fp32 tolerances
    cfg["bertopt"] = {"train": {"precision": "bf16" if bf16 else "fp32"}}
    if clip is None:
        cfg["gradient_clipping"] = 0.0
    else:
        cfg["bertopt"]["bucket_clip"] = {"enabled": True, "bucket_size": BUCKET, **clip}
    for key, value in (extra or {}).items():  # top-level DeepSpeed keys; dicts merge one level deep
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    return cfg


def local_micro_grads(reference, batches, dtype) -> list[dict[str, torch.Tensor]]:
    """This rank's gradient of each micro-batch (already divided by the accumulation steps)."""
    model = copy.deepcopy(reference).to(dtype)
    out = []
    for batch in batches:
        model.zero_grad(set_to_none=True)
        (model(batch) / len(batches)).backward()
        out.append(
            {n: (p.grad if p.grad is not None else torch.zeros_like(p)).double() for n, p in model.named_parameters()}
        )
    return out


def all_gather_dicts(grads: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    names = list(grads)
    flat = torch.cat([grads[n].reshape(-1) for n in names])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    out = []
    for tensor in gathered:
        pieces, offset = {}, 0
        for n in names:
            pieces[n] = tensor[offset : offset + grads[n].numel()].view_as(grads[n])
            offset += grads[n].numel()
        out.append(pieces)
    return out


def formula_thresholds(bucket_numels, max_norm, mode):
    if mode == "uniform":
        return [max_norm / math.sqrt(len(bucket_numels))] * len(bucket_numels)
    total = sum(bucket_numels)
    return [max_norm * math.sqrt(n / total) for n in bucket_numels]


def clip_by_buckets(grads, layout, thresholds, eps):
    out = dict(grads)
    for names, tau in zip(layout, thresholds):
        norm = torch.sqrt(sum((grads[n] ** 2).sum() for n in names))
        coef = min(1.0, tau / (float(norm) + eps)) if math.isfinite(norm) else 1.0
        for n in names:
            out[n] = grads[n] * coef
    return out


def reference_reduced(micro: list[dict], layout, thresholds, eps, per_micro: bool) -> dict[str, torch.Tensor]:
    """Gather all ranks' local gradients, clip per bucket, average over ranks.

    ``per_micro`` (ZeRO 2): each micro-batch's gradient is clipped to tau_b / GAS, then summed.
    """
    gas, world = len(micro), dist.get_world_size()
    if per_micro:
        ranks = [all_gather_dicts(m) for m in micro]  # [micro][rank]
        clipped = [
            [clip_by_buckets(ranks[m][r], layout, [t / gas for t in thresholds], eps) for m in range(gas)]
            for r in range(world)
        ]
        per_rank = [{n: sum(c[n] for c in clipped[r]) for n in micro[0]} for r in range(world)]
    else:
        local = {n: sum(m[n] for m in micro) for n in micro[0]}
        per_rank = [clip_by_buckets(g, layout, thresholds, eps) for g in all_gather_dicts(local)]
    return {n: sum(g[n] for g in per_rank) / world for n in micro[0]}


def layout_names(engine, layout):
    names = {id(p): n for n, p in engine.module.named_parameters()}
    return [[names[id(p)] for p in bucket] for bucket in layout]


def expected_reduced(engine, reference, batches, *, stage, max_norm, mode, dtype=torch.float32, eps=1e-6):
    """The reduced gradient the engine should hold after the last micro-batch of a step, and the
    layout (parameter names per bucket) it was computed for."""
    adapter = engine.bucket_clip
    names = layout_names(engine, adapter.layout())
    params = dict(engine.module.named_parameters())
    thresholds = formula_thresholds([sum(params[n].numel() for n in b) for b in names], max_norm, mode)
    micro = local_micro_grads(reference, batches, dtype)
    return reference_reduced(micro, names, thresholds, eps, per_micro=(stage == 2 and len(batches) > 1)), names


def build_engine(stage, gas, clip, *, bf16=False, unused=False, extra=None):
    from ds_bertopt.engine import initialize

    torch.manual_seed(0)
    model = TinyLM(unused=unused)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    engine, *_ = initialize(config=ds_config(stage, gas, clip, bf16, extra), model=model, optimizer=optimizer)
    return engine, reference


def train_micro_batches(engine, batches):
    """All micro-batches of one step; the last ``engine.step()`` is left to the caller."""
    for index, batch in enumerate(batches):
        engine.backward(engine(batch))
        if index < len(batches) - 1:
            engine.step()


def reduced_grads(engine) -> dict[str, torch.Tensor]:
    """Every rank's view of the reduced gradient (collective at ZeRO 1/2)."""
    from deepspeed.utils import safe_get_full_grad

    return {name: safe_get_full_grad(p).detach().double().clone() for name, p in engine.module.named_parameters()}
