"""SampledLinear and convert(): exact forward/∇X, unbiased ∇W through autograd, padding, cache, sharing."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from wtacrs_common import bias_statistic, tiny_batch, tiny_bert  # noqa: E402

from ds_bertopt.wtacrs import (
    NUM_VALID_ROWS_KWARG,
    SampledLinear,
    convert,
    estimate_saving,  # noqa: E402
    saved_tensor_bytes,
)
from ds_bertopt.wtacrs.estimator import budget  # noqa: E402

BIAS_BOUND = 4.0


class Wrapper(nn.Module):
    """A model whose forward takes ``attention_mask`` like a HF model, around q/k/v-like linears."""

    def __init__(self, d_in=8, d_out=6, heads=1):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(d_in, d_out) for _ in range(heads))

    def forward(self, x, attention_mask=None):
        return sum(head(x) for head in self.heads)


def heavy_input(batch=4, seq=16, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scale = (1.0 - torch.rand(batch, seq, 1, generator=gen)) ** (-1 / 1.3)
    return torch.randn(batch, seq, d, generator=gen) * scale


def test_forward_and_input_grad_identical_to_linear():
    torch.manual_seed(0)
    plain = nn.Linear(8, 6)
    sampled = SampledLinear.from_linear(copy.deepcopy(plain), ratio=0.3, min_k=4)
    x1 = heavy_input().requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    y1, y2 = plain(x1), sampled(x2)
    assert torch.equal(y1, y2)
    grad = torch.randn_like(y1)
    y1.backward(grad)
    y2.backward(grad)
    assert torch.equal(x1.grad, x2.grad)
    assert torch.equal(plain.bias.grad, sampled.bias.grad)
    assert not torch.equal(plain.weight.grad, sampled.weight.grad)  # sampled: an estimate


def test_ratio_one_reproduces_weight_grad():
    torch.manual_seed(0)
    plain = nn.Linear(8, 6)
    sampled = SampledLinear.from_linear(copy.deepcopy(plain), ratio=1.0, min_k=1)
    x = heavy_input()
    grad = torch.randn(4, 16, 6)
    plain(x).backward(grad)
    sampled(x).backward(grad)
    torch.testing.assert_close(sampled.weight.grad, plain.weight.grad, rtol=1e-6, atol=1e-6)


def test_ratio_one_draws_no_random_numbers():
    """At ratio 1 (k = N) every row is kept without a draw: the RNG stream (dropout masks) is as without sampling."""
    sampled = SampledLinear.from_linear(nn.Linear(8, 6), ratio=1.0, min_k=1)
    state = torch.get_rng_state()
    sampled(heavy_input()).sum().backward()
    assert torch.equal(torch.get_rng_state(), state)


def test_state_dicts_interchangeable():
    model = tiny_bert()
    reference = copy.deepcopy(model)
    names = convert(model, ratio=0.3, targets=("ffn_out", "qkv", "ffn_in"))
    assert len(names) == 2 * 5
    assert list(model.state_dict()) == list(reference.state_dict())
    model.load_state_dict(reference.state_dict())
    reference.load_state_dict(model.state_dict())
    model.eval(), reference.eval()
    batch = tiny_batch()
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, reference(**batch).logits, rtol=0, atol=0)


def test_auto_targets_skip_attention_output_and_respect_layernorm_kit():
    from ds_bertopt.wtacrs.config import KitConfig
    from ds_bertopt.wtacrs.kit import apply_kit

    names = convert(tiny_bert(), targets=("auto",))
    assert not any("attention.output" in n for n in names)
    assert sum(n.endswith("output.dense") for n in names) == 2 and sum("self.query" in n for n in names) == 2
    kit_model = tiny_bert()
    apply_kit(kit_model, KitConfig(layernorm_saves_output=True))
    names = convert(kit_model, targets=("auto",))
    assert sorted(names) == [f"bert.encoder.layer.{i}.output.dense" for i in range(2)]


@pytest.mark.parametrize("host_count", [True, False])
def test_weight_grad_unbiased_through_autograd_with_padding(host_count):
    """Mean of many ∇W from backward → exact ∇W over the non-padding rows; padding rows never stored.

    With the host count of real rows (``wtacrs_num_valid_rows``) k = ratio · N'; without it k comes from the
    tensor's row count (padding included): more rows, the same unbiased estimate.
    """
    torch.manual_seed(1)
    model = Wrapper()
    exact_model = copy.deepcopy(model)
    convert(model, ratio=0.25, targets=("heads.*",), min_k=4)
    x = heavy_input(seed=1)
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[2:, 10:] = 0
    x[mask == 0] *= 50  # padding rows with huge norms: selected only if the mask were ignored
    grad = torch.randn(4, 16, 6, generator=torch.Generator().manual_seed(2))
    grad[mask == 0] = 0  # as in BERT: padding positions never reach the loss
    exact_model(x, attention_mask=mask).backward(grad)
    exact = exact_model.heads[0].weight.grad
    kwargs = {NUM_VALID_ROWS_KWARG: int(mask.sum())} if host_count else {}

    saved_indices = []

    def pack(t):
        if t.dtype == torch.int64:
            saved_indices.append(t)
        return t

    estimates = []
    padding_rows = set(torch.nonzero(mask.flatten() == 0).flatten().tolist())
    for trial in range(1500):
        model.zero_grad()
        if trial < 20:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = model(x, attention_mask=mask, **kwargs)
        else:
            out = model(x, attention_mask=mask, **kwargs)
        out.backward(grad)
        estimates.append(model.heads[0].weight.grad.clone())
    assert saved_indices and not any(set(i.tolist()) & padding_rows for i in saved_indices)
    k = budget(int(mask.sum()) if host_count else mask.numel(), 0.25, 4)
    assert all(i.numel() == k for i in saved_indices)
    assert bias_statistic(torch.stack(estimates), exact) < BIAS_BOUND


def test_host_count_must_be_a_host_int():
    model = Wrapper()
    convert(model, ratio=0.5, targets=("heads.*",), min_k=1)
    x, mask = heavy_input(), torch.ones(4, 16, dtype=torch.long)
    model(x, attention_mask=mask, **{NUM_VALID_ROWS_KWARG: torch.tensor(64)})  # a CPU scalar is a host value
    for bad in (torch.tensor(64, device="meta"), -1, 2.5):
        with pytest.raises(ValueError, match=NUM_VALID_ROWS_KWARG):
            model(x, attention_mask=mask, **{NUM_VALID_ROWS_KWARG: bad})


def test_weight_grad_unbiased_with_grad_norm_cache():
    torch.manual_seed(3)
    model = Wrapper()
    exact_model = copy.deepcopy(model)
    convert(model, ratio=0.25, targets=("heads.*",), min_k=4, cache_capacity=8)
    layer = model.heads[0]
    x = heavy_input(seed=3)
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[3, 12:] = 0
    grad = torch.randn(4, 16, 6, generator=torch.Generator().manual_seed(4))
    grad[mask == 0] = 0
    grad[:, :3] *= 20  # a few positions carry most of the output gradient: the cache should find them
    exact_model(x, attention_mask=mask).backward(grad)
    exact = exact_model.heads[0].weight.grad
    ids = torch.tensor([5, 6, 7, 13])  # 13 % 8 == 5: evicts example 5 from its slot

    model(x, attention_mask=mask, wtacrs_example_ids=ids).backward(grad)
    assert layer.cache.tags.tolist().count(13) == 1 and 5 not in layer.cache.tags.tolist()
    assert float(layer.cache.values[7 % 8, :16].float().min()) > 0  # example 7 cached, all positions
    assert float(layer.cache.values[13 % 8, 12:16].abs().sum()) == 0  # padding positions not cached

    def collect(with_cache: bool, trials: int = 1500):
        out = []
        for _ in range(trials):
            model.zero_grad()
            kwargs = {"wtacrs_example_ids": ids} if with_cache else {}
            model(x, attention_mask=mask, **kwargs).backward(grad)
            out.append(layer.weight.grad.clone())
        return torch.stack(out)

    cached = collect(True)
    assert bias_statistic(cached, exact) < BIAS_BOUND
    plain = collect(False)
    mse = lambda e: float(((e - exact) ** 2).sum(dim=(1, 2)).mean())  # noqa: E731
    assert mse(cached) < mse(plain), "the gradient-norm cache should lower the variance here"


class PackedWrapper(Wrapper):
    """A packed (padding-free) row's model: ``max_seqlen`` is the width of the padded layout its index refers to."""

    def forward(self, x, max_seqlen=None):
        return sum(head(x) for head in self.heads)


def test_grad_norm_cache_keys_packed_tokens_by_example_and_position_as_padded_ones():
    """The same examples padded and packed (``wtacrs_packed_index``): one backward leaves the same cache entries, and
    the scores the next step reads at each packed token are the padded layout's at its (example, position)."""
    from ds_bertopt.data.collate import padded_positions

    torch.manual_seed(3)
    padded_model, packed_model = Wrapper(), PackedWrapper()
    packed_model.load_state_dict(padded_model.state_dict())
    for model in (padded_model, packed_model):
        convert(model, ratio=0.25, targets=("heads.*",), min_k=4, cache_capacity=8)
    lengths = (16, 9, 16, 5)
    mask = torch.zeros(4, 16, dtype=torch.bool)
    for row, n in enumerate(lengths):
        mask[row, :n] = True
    x, grad = heavy_input(seed=3), torch.randn(4, 16, 6, generator=torch.Generator().manual_seed(4))
    ids = torch.tensor([5, 6, 7, 13])
    padded_model(x, attention_mask=mask.long(), wtacrs_example_ids=ids).backward(grad * mask[..., None])
    index = padded_positions(lengths, 16)
    kwargs = {"wtacrs_example_ids": ids, "wtacrs_packed_index": index, "max_seqlen": 16}
    packed_model(x[mask], **kwargs).backward(grad[mask])
    padded_cache, packed_cache = padded_model.heads[0].cache, packed_model.heads[0].cache
    assert torch.equal(packed_cache.tags, padded_cache.tags)
    assert torch.equal(packed_cache.values, padded_cache.values) and float(packed_cache.values.sum()) > 0
    scores = padded_cache.scores(ids, mask).flatten()[index]
    context = packed_model.heads[0].context
    context.begin(None, ids, packed_index=index, packed_width=16)
    layout_index, layout = context.packed_layout(x[mask])
    torch.testing.assert_close(packed_cache.scores(ids, layout).flatten()[layout_index], scores)
    with pytest.raises(ValueError, match="wtacrs_packed_index: pass max_seqlen"):
        context.begin(None, ids, packed_index=index)


def test_shared_input_stores_one_selection():
    """q/k/v (or LoRA A projections) reading one tensor share one stored row set."""
    x = heavy_input(batch=8, seq=32, d=16).requires_grad_()
    mask = torch.ones(8, 32, dtype=torch.long)

    def saved_bytes(heads: int) -> int:
        model = Wrapper(d_in=16, heads=heads)
        convert(model, ratio=0.25, targets=("heads.*",), min_k=4)
        torch.manual_seed(5)  # the same draw for the first head either way
        return saved_tensor_bytes(model, {"x": x, "attention_mask": mask})["total"]

    one, three = saved_bytes(1), saved_bytes(3)
    assert one > 0
    assert three == one


def test_autocast_bf16_matches_linear():
    torch.manual_seed(0)
    plain = nn.Linear(8, 6)
    sampled = SampledLinear.from_linear(copy.deepcopy(plain), ratio=0.5, min_k=4)
    x = heavy_input()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y1, y2 = plain(x), sampled(x)
    assert y2.dtype == torch.bfloat16
    assert torch.equal(y1, y2)
    y2.float().sum().backward()
    assert sampled.weight.grad.dtype == torch.float32 and sampled.weight.grad.abs().sum() > 0


def test_autocast_bf16_weight_grad_is_unbiased():
    """bf16 autocast: rows pre-scaled and kept in bf16, ∇W (fp32) still centred on the exact bf16 product."""
    torch.manual_seed(0)
    sampled = SampledLinear.from_linear(nn.Linear(8, 6), ratio=0.25, min_k=2)
    x = heavy_input(batch=2, seq=16)
    grad = torch.randn(2, 16, 6, generator=torch.Generator().manual_seed(1)).bfloat16()
    exact = grad.double().reshape(-1, 6).t() @ x.bfloat16().double().reshape(-1, 8)  # what autocast multiplies
    estimates = []
    for _ in range(1500):
        sampled.weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = sampled(x)
        y.backward(grad)
        estimates.append(sampled.weight.grad.double())
    assert bias_statistic(torch.stack(estimates), exact) < BIAS_BOUND


def test_bert_grads_exact_except_sampled_weights():
    batch = tiny_batch(pad_from=10)
    reference = tiny_bert(hidden_dropout=0.0, attention_dropout=0.0)
    model = copy.deepcopy(reference)
    names = set(convert(model, ratio=0.3, targets=("ffn_out", "qkv"), min_k=4))
    reference(**batch).loss.backward()
    model(**batch).loss.backward()
    ref_params = dict(reference.named_parameters())
    differing = []
    for name, param in model.named_parameters():
        if name.rsplit(".", 1)[0] in names and name.endswith("weight"):
            continue
        torch.testing.assert_close(param.grad, ref_params[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    assert not differing


def test_saved_bytes_of_swapped_inputs_scale_with_k_over_n():
    model = tiny_bert(layers=2, hidden=64)
    batch, seq = 8, 32
    data = tiny_batch(batch=batch, seq=seq)
    result = estimate_saving(model, data, ratio=0.25, targets=("ffn_out",), min_k=4)
    n, k = batch * seq, budget(batch * seq, 0.25, 4)
    swapped_original = 2 * n * (4 * 64) * 4  # two layers' GELU outputs, fp32
    swapped_converted = result["converted"]["total"] - (result["original"]["total"] - swapped_original)
    per_row = 4 * 64 * 4 + 8  # a stored row plus its int64 index
    assert swapped_converted == 2 * k * per_row  # static shapes: exactly k slots per layer (duplicates included)
    assert result["converted"]["total"] < result["original"]["total"]


@pytest.mark.parametrize("ratio", [0.0, 1.5])
def test_config_rejects_bad_ratio(ratio):
    from ds_bertopt.configlib import load_section
    from ds_bertopt.errors import ConfigError
    from ds_bertopt.wtacrs.config import WtaCrsConfig

    with pytest.raises(ConfigError, match="wtacrs.ratio"):
        load_section(WtaCrsConfig, {"ratio": ratio}, "wtacrs")


def test_config_rejects_unknown_kit_key():
    from ds_bertopt.configlib import load_section
    from ds_bertopt.errors import ConfigError
    from ds_bertopt.wtacrs.config import WtaCrsConfig

    with pytest.raises(ConfigError, match="wtacrs.kit: unknown key 'sdpa'"):
        load_section(WtaCrsConfig, {"kit": {"sdpa": True}}, "wtacrs")


class _UnweightedFp16(SampledLinear):
    """The control: the fp16 path with its row weights replaced by 1 (what dropping them would do)."""

    def _select(self, x, dtype):
        stored, indices, row_weights, cache_update = super()._select(x, dtype)
        return stored, indices, torch.ones_like(row_weights), cache_update


@pytest.mark.parametrize("drop_weights", [False, True])
def test_fp16_weight_grad_is_unbiased_and_needs_its_row_weights(drop_weights):
    """fp16: rows stored unscaled, the weights applied to ∇Y rows in an fp32 GEMM — unbiased; without them not."""
    torch.manual_seed(0)
    plain = nn.Linear(8, 6).half()
    cls = _UnweightedFp16 if drop_weights else SampledLinear
    sampled = cls.from_linear(copy.deepcopy(plain), ratio=0.2, min_k=1)
    x = heavy_input(batch=2, seq=16).half()  # heavy-tailed row norms: winners and draws
    grad = torch.randn(2, 16, 6, generator=torch.Generator().manual_seed(1)).half()
    exact = grad.double().reshape(-1, 6).t() @ x.double().reshape(-1, 8)
    stored, indices, row_weights, _ = SampledLinear._select(sampled, x, torch.float16)  # the real fp16 path
    assert stored.dtype == torch.float16 and row_weights is not None and row_weights.dtype == torch.float32
    assert not torch.all(row_weights == 1)  # the draws do carry weights ≠ 1 here
    estimates = []
    for _ in range(1500):
        sampled.weight.grad = None
        sampled(x).backward(grad)
        assert sampled.weight.grad.dtype == torch.float16
        estimates.append(sampled.weight.grad.double())
    statistic = bias_statistic(torch.stack(estimates), exact)
    if drop_weights:
        assert statistic > 25 * BIAS_BOUND, statistic
    else:
        assert statistic < BIAS_BOUND, statistic


def test_fp16_keeps_weights_apart_and_stays_finite():
    """fp16 rows are stored unscaled (an importance weight × activation could overflow)."""
    torch.manual_seed(0)
    plain = nn.Linear(8, 6).half()
    sampled = SampledLinear.from_linear(copy.deepcopy(plain), ratio=0.05, min_k=1)
    x = torch.randn(64, 16, 8).half()
    x[0, 0] *= 200  # one dominant row: every other row's weight is large
    grad = torch.randn(64, 16, 6).half()
    sampled(x).backward(grad)
    assert torch.isfinite(sampled.weight.grad).all() and sampled.weight.grad.dtype == torch.float16
    exact = SampledLinear.from_linear(copy.deepcopy(plain), ratio=1.0, min_k=1)
    exact(x).backward(grad)
    plain(x).backward(grad)
    torch.testing.assert_close(exact.weight.grad, plain.weight.grad, rtol=2e-2, atol=2e-2)
