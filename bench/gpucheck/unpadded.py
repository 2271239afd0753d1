"""Section ``unpadded``: packed attention varlen vs sdpa_loop, and unpadded vs padded tokens/s."""

import itertools
import random

from .runner import TINY_BERT, Ctx, Result, brief, judged, timed


def packed_inputs(ctx: Ctx, dtype, lengths, heads: int, dim: int, count: int, seed: int) -> tuple:
    """``count`` random ``(tokens, heads, dim)`` tensors of packed sequences of ``lengths``, and their offsets."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    shape = (sum(lengths), heads, dim)
    tensors = [torch.randn(*shape, generator=gen).to(device=ctx.device, dtype=dtype) for _ in range(count)]
    return tensors, torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=ctx.device)


def attention_compare(ctx: Ctx, dtype, lengths, heads: int, dim: int) -> dict:
    """varlen and sdpa_loop vs an fp32 reference on the same rounded inputs: max error relative to max |ref|."""
    import torch

    from ds_bertopt.model.unpadded import packed_attention, sdpa_loop_attention

    (q, k, v, g), cu = packed_inputs(ctx, dtype, lengths, heads, dim, 4, seed=0)

    def run(backend, dt):
        inputs = [t.to(dt).requires_grad_() for t in (q, k, v)]
        if backend == "reference":
            out = sdpa_loop_attention(*inputs, lengths)
        else:
            out = packed_attention(*inputs, cu, max(lengths), lengths, backend=backend)
        grads = torch.autograd.grad(out, inputs, g.to(dt))
        return [out.detach().float(), *(x.float() for x in grads)]

    ref = run("reference", torch.float32)
    relative = lambda got: [float((a - r).abs().max() / r.abs().max().clamp_min(1e-30)) for a, r in zip(got, ref)]
    backends = ("varlen", "sdpa_loop") if ctx.cuda else ("sdpa_loop",)
    return {backend: relative(run(backend, dtype)) for backend in backends}


def attention_dropout(ctx: Ctx, dtype, lengths, heads: int, dim: int, p: float, draws: int) -> dict:
    """varlen with ``dropout_p``: applied, unbiased over draws, seed-reproducible, finite gradients."""
    import torch

    from ds_bertopt.model.unpadded import packed_attention

    (q, k, v), cu = packed_inputs(ctx, dtype, lengths, heads, dim, 3, seed=1)
    attend = lambda *qkv, p=p: packed_attention(*qkv, cu, max(lengths), lengths, dropout_p=p, backend="varlen")

    def seeded():  # the same seed twice: the same dropout mask
        torch.manual_seed(7)
        return attend(q, k, v)

    with torch.no_grad():
        plain = attend(q, k, v, p=0.0).float()
        stacked = torch.stack([attend(q, k, v).float() for _ in range(draws)])
        once, again = seeded(), seeded()
    se = stacked.std(0) / draws**0.5
    bias = ((stacked.mean(0) - plain).abs() - 6 * se).clamp_min(0)
    leaf = [t.clone().requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad(attend(*leaf).float().square().sum(), leaf)
    return {
        "applied": float((stacked[0] - plain).abs().max() / plain.abs().max()),
        "bias_beyond_6se": float(bias.max() / plain.abs().max()),
        "reproducible": bool(torch.equal(once, again)),
        "finite_grads": all(bool(torch.isfinite(x).all()) for x in grads),
    }


def make_samples(count: int, low: int, high: int, vocab: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        n = rng.randint(low, high)
        ids = [rng.randrange(5, vocab) for _ in range(n)]
        split = rng.randint(1, n)
        labels = [rng.randrange(5, vocab) if rng.random() < 0.15 else -100 for _ in range(n)]
        if all(x == -100 for x in labels):
            labels[rng.randrange(n)] = rng.randrange(5, vocab)
        samples.append({"input_ids": ids, "token_type_ids": [0] * split + [1] * (n - split), "labels": labels})
    return samples


def padded_batch(samples: list) -> dict:
    """``pad_batch`` of the data pipeline (pad id 0, to a multiple of 8), with the samples' MLM labels."""
    import torch

    from ds_bertopt.data.collate import pad_batch

    batch = pad_batch(samples, pad_id=0, pad_multiple=8, cap=1 << 30)
    batch["labels"] = torch.full_like(batch["input_ids"], -100)
    for row, s in enumerate(samples):
        batch["labels"][row, : len(s["labels"])] = torch.tensor(s["labels"])
    return batch


def unpadded_throughput(ctx: Ctx) -> str:
    """Padded (``SparseMLMHead``) vs unpadded (``UnpaddedBert``, auto attention) steps of one BERT, same samples:
    forward, backward, AdamW; bf16 weights on CUDA (as DeepSpeed's bf16 runs them), interleaved, medians. Prints the
    details, returns the figure."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    from bench._common import interleaved, median
    from ds_bertopt.compat.transformers import set_attention_implementation
    from ds_bertopt.data.collate import pack_sequences
    from ds_bertopt.model import SparseMLMHead
    from ds_bertopt.model.unpadded import UnpaddedBert, varlen_usable

    device = torch.device(ctx.device)
    sizes = TINY_BERT if ctx.tiny else dict(vocab_size=30522, max_position_embeddings=512)  # BERT-base otherwise
    count, low, high, rounds = (4, 4, 60, 2) if ctx.tiny else (32, 16, 512, 5)
    config = BertConfig(**sizes)
    set_attention_implementation(config, "sdpa")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    with torch.device(device):
        model = BertForMaskedLM(config)
    model = model.to(dtype=dtype).train()
    padded_model, unpadded_model = SparseMLMHead(model), UnpaddedBert(model, attention="auto")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    samples = make_samples(count, low, high, sizes["vocab_size"])
    real = sum(len(s["input_ids"]) for s in samples)
    padded = {k: v.to(device) for k, v in padded_batch(samples).items()}
    packed = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in pack_sequences(samples).items()}
    usable = varlen_usable(device, dtype, config.hidden_size // config.num_attention_heads, True)
    backend = "varlen" if usable else "sdpa_loop"

    def step(wrapper, batch) -> None:
        wrapper(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    variants = {"padded": (padded_model, padded), "unpadded": (unpadded_model, packed)}
    steps = {name: lambda v=v: timed(lambda: step(*v), device) for name, v in variants.items()}
    med = {name: median(t) for name, t in interleaved(steps, repeats=rounds, warmup=2).items()}
    computed = padded["input_ids"].numel()
    ctx.detail(
        f"{count} sequences of {low}..{high} tokens, {str(dtype).replace('torch.', '')}: "
        f"{real} real tokens, padded computes {computed} ({1 - real / computed:.0%} padding); "
        f"unpadded attention: {backend}"
    )
    speedup = med["padded"] / med["unpadded"]
    ctx.detail(
        f"tokens/s padded {real / med['padded']:.0f}, unpadded {real / med['unpadded']:.0f}: unpadded {speedup:.2f}x "
        f"(median step {med['padded'] * 1e3:.1f} vs {med['unpadded'] * 1e3:.1f} ms)"
    )
    return f"unpadded {speedup:.2f}x tokens/s of padded ({backend})"


def check_dropout(ctx: Ctx, dtype, lengths, heads: int, dim: int, tolerance: float) -> list:
    """The problems of varlen's dropout in ``dtype`` (:func:`attention_dropout`, 200 draws of p 0.1)."""
    name = str(dtype).replace("torch.", "")
    try:
        drop = attention_dropout(ctx, dtype, lengths, heads, dim, p=0.1, draws=200)
    except Exception as exc:  # noqa: BLE001
        return [f"{name} dropout: {brief(exc, first_line=True)}"]
    ok = drop["applied"] > 0.05 and drop["bias_beyond_6se"] <= tolerance
    ok = ok and drop["reproducible"] and drop["finite_grads"]
    ctx.detail(
        f"{name} varlen dropout 0.1: changes the output by {drop['applied']:.2f} of max |out|, mean "
        f"of 200 draws within 6 SE + {drop['bias_beyond_6se']:.1e}, same seed same output "
        f"{drop['reproducible']}, finite gradients {drop['finite_grads']} -> {'ok' if ok else 'FAIL'}"
    )
    return [] if ok else [f"{name} dropout: {drop}"]


def section_unpadded(ctx: Ctx) -> Result:
    import torch

    from ds_bertopt.model.unpadded import varlen_usable

    problems, figures = [], []
    heads, dim = (2, 16) if ctx.tiny else (12, 64)
    lengths = [3, 9, 1, 17] if ctx.tiny else [1, 7, 33, 64, 128, 200, 317, 512, 45, 2]
    tolerance = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-5}
    dtypes = (torch.bfloat16, torch.float16) if ctx.cuda else (torch.float32,)
    for dtype, dropout in itertools.product(dtypes if ctx.cuda else (), (False, True)):
        usable = varlen_usable(torch.device("cuda"), dtype, dim, dropout)
        ctx.detail(f"varlen_usable(cuda, {dtype}, head_dim {dim}, dropout {dropout}): {usable}")
    for dtype in dtypes:
        name = str(dtype).replace("torch.", "")
        try:
            errors = attention_compare(ctx, dtype, lengths, heads, dim)
        except Exception as exc:  # noqa: BLE001 - e.g. the varlen kernel refused: that is the finding
            problems.append(f"{name} forward/backward: {brief(exc, first_line=True)}")
            ctx.detail(f"{name}: {brief(exc, 300, first_line=True)}")
            continue
        for backend, errs in errors.items():
            ok = max(errs) <= tolerance[dtype]
            ctx.detail(
                f"{name} {backend} vs fp32 reference (max |err| / max |ref|): out {errs[0]:.2e}, dq "
                f"{errs[1]:.2e}, dk {errs[2]:.2e}, dv {errs[3]:.2e} (tolerance {tolerance[dtype]:g}) -> "
                f"{'ok' if ok else 'FAIL'}"
            )
            if not ok:
                problems.append(f"{name} {backend}: max error {max(errs):.2e} > {tolerance[dtype]:g}")
        figures.append(f"{name} " + " ".join(f"{b} {max(e):.1e}" for b, e in errors.items()))
    for dtype in dtypes if ctx.cuda else ():
        problems += check_dropout(ctx, dtype, lengths, heads, dim, tolerance[dtype])
    if not ctx.cuda:
        ctx.detail("varlen flash attention (fp16/bf16, dropout): SKIPPED(no CUDA); sdpa_loop checked in fp32")
    try:
        figures.append(unpadded_throughput(ctx))
    except Exception as exc:  # noqa: BLE001
        problems.append(f"throughput: {brief(exc, first_line=True)}")
    if problems or ctx.cuda:
        return judged(problems, "; ".join(figures))
    return Result(
        "SKIPPED(no CUDA)", "varlen needs CUDA; sdpa_loop and the throughput code ran on CPU: " + "; ".join(figures)
    )
