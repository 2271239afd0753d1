"""How much work a sample, a micro-batch and a rank's step cost, and how balanced a plan is (pure numpy).

Per-sample work of a BERT layer is ``a·L + b·L²``: the dense GEMMs (QKV, output, feed-forward) cost
``24·L·h²`` FLOPs and the two attention products ``4·L²·h``, so ``b/a = 1/(6·h)``; the default
``b = 1/6144`` is BERT-large (h = 1024), the MLPerf model. Fused, unpadded kernels pay that per sample.
Un-fused kernels pay for padding: a micro-batch then costs ``micro × cost(padded length)``, the
padded length being its longest sample rounded up to ``pad_multiple`` (what :mod:`.collate` builds).

A step is synchronous, so its time is set by the busiest rank: the balance figure is, per step,
``max over ranks / mean over ranks`` of the rank's work (1.0 = perfect).

Plans may be ragged (the packed strategies: micro-batches of varying size, unused slots ``-1`` in
``Plan.indices``). The helpers here take *slot lengths* ``[steps, world, accum, slots]`` where an
unused slot has length 0 (:func:`slot_lengths`): a 0 costs nothing and is no sample, so a micro-batch
of ``n`` samples costs ``n × cost(padded length)`` whatever the number of slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BERT_LARGE_QUADRATIC = 1.0 / 6144.0


@dataclass(frozen=True)
class CostModel:
    linear: float = 1.0
    """``a``: work per token (dense layers)."""
    quadratic: float = BERT_LARGE_QUADRATIC
    """``b``: work per token pair (attention), ``1/(6·hidden)`` relative to ``a = 1``."""

    @classmethod
    def for_hidden_size(cls, hidden: int) -> "CostModel":
        return cls(linear=1.0, quadratic=1.0 / (6.0 * hidden))

    def sample(self, lengths: np.ndarray) -> np.ndarray:
        """Unpadded work of each sample (float64, same shape)."""
        lengths = np.asarray(lengths, dtype=np.float64)
        return self.linear * lengths + self.quadratic * lengths * lengths


def padded_lengths(max_lengths: np.ndarray, pad_multiple: int) -> np.ndarray:
    """Longest sample of each micro-batch rounded up to ``pad_multiple`` (as the collator pads)."""
    return -(-np.asarray(max_lengths, dtype=np.int64) // pad_multiple) * pad_multiple


def slot_lengths(indices: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Sample lengths at plan positions, 0 where a slot is unused (``-1``)."""
    indices = np.asarray(indices)
    return np.where(indices >= 0, np.asarray(lengths, dtype=np.int64)[np.maximum(indices, 0)], 0)


def micro_batch_work(
    plan_lengths: np.ndarray, model: CostModel, *, padded: bool = False, pad_multiple: int = 8
) -> np.ndarray:
    """Work of every micro-batch, ``[steps, world, accum]``, from slot lengths (0 = unused slot).

    ``padded``: ``samples × cost(padded length)`` instead of the sum over samples.
    """
    if not padded:
        return model.sample(plan_lengths).sum(axis=3)
    samples = (plan_lengths > 0).sum(axis=3)
    return samples * model.sample(padded_lengths(plan_lengths.max(axis=3), pad_multiple))


def rank_work(plan_lengths: np.ndarray, model: CostModel, *, padded: bool = False, pad_multiple: int = 8) -> np.ndarray:
    """Work of every rank in every step, ``[steps, world]``, from slot lengths ``[steps, world, accum, slots]``.

    ``padded``: every micro-batch costs ``samples × cost(padded length)`` instead of the sum over samples.
    """
    return micro_batch_work(plan_lengths, model, padded=padded, pad_multiple=pad_multiple).sum(axis=2)


def step_imbalance(work: np.ndarray) -> np.ndarray:
    """Per step ``max / mean`` of rank work (``[steps]``), from ``[steps, world]``."""
    return work.max(axis=1) / work.mean(axis=1)


def padded_tokens(plan_lengths: np.ndarray, pad_multiple: int) -> np.ndarray:
    """Token slots every micro-batch computes with dynamic padding, ``[steps, world, accum]``."""
    return (plan_lengths > 0).sum(axis=3) * padded_lengths(plan_lengths.max(axis=3), pad_multiple)


def padding_fraction(plan_lengths: np.ndarray, pad_multiple: int) -> float:
    """Share of padded token slots that are padding, with dynamic padding per micro-batch."""
    return float(1.0 - plan_lengths.sum() / padded_tokens(plan_lengths, pad_multiple).sum())


@dataclass(frozen=True)
class PlanFigures:
    """What the planner CLI prints for one strategy."""

    imbalance_mean: float
    """Per-step max/mean rank work (unpadded cost), mean over steps."""
    imbalance_p99: float
    """… its 99th percentile over steps."""
    padded_imbalance_mean: float
    """The same with the padded cost (un-fused kernels)."""
    padded_imbalance_p99: float
    padding: float
    """Padding fraction of the padded micro-batches."""
    tokens_per_rank: float
    """Real tokens per rank per step (mean)."""
    tokens_max_over_mean: float
    """Per-step max/mean of real tokens per rank, mean over steps."""
    step_time: float
    """Mean over steps of the busiest rank's unpadded work: a synchronous step's time, in cost units."""
    padded_step_time: float
    """… with the padded cost."""
    mean_work: float
    """Mean over steps of the mean rank's unpadded work: the step time of a perfectly balanced plan of the
    same samples on kernels that skip padding (no plan of a step's global batch can be faster)."""
    micro_imbalance_mean: float
    """Per micro-step (accumulation slot) max/mean rank work, unpadded, mean over steps and slots: what
    ZeRO 2/3 wait for at every micro-step (they reduce gradients after each)."""
    padded_micro_imbalance_mean: float
    """… with the padded cost."""
    samples_per_step: float
    """Samples in a step's global batch (mean over steps; fixed for every strategy of the planner)."""
    samples_per_step_min: int
    """… the fewest (other libraries' planners may vary it)."""
    samples_per_step_max: int
    """… the most."""
    micro_batch_samples_mean: float
    """Samples per micro-batch, mean over all micro-batches (the nominal micro-batch unless packed)."""
    micro_batch_samples_max: int
    """… the most in one micro-batch."""
    micro_batch_tokens_max: int
    """Most real tokens in one micro-batch (what unpadded kernels hold in memory)."""
    micro_batch_padded_tokens_max: int
    """Most padded token slots in one micro-batch (what padded kernels hold in memory)."""
    work_per_rank: np.ndarray
    """``[steps, world]`` unpadded work normalised by each step's mean (for plots)."""
    padded_work_per_rank: np.ndarray
    """… padded."""


def plan_figures(plan_lengths: np.ndarray, model: CostModel, pad_multiple: int) -> PlanFigures:
    """Figures of a plan from its slot lengths ``[steps, world, accum, slots]`` (0 = unused slot)."""
    micro_work = micro_batch_work(plan_lengths, model)
    padded_micro_work = micro_batch_work(plan_lengths, model, padded=True, pad_multiple=pad_multiple)
    work, padded = micro_work.sum(axis=2), padded_micro_work.sum(axis=2)
    imb, pimb = step_imbalance(work), step_imbalance(padded)
    tokens = plan_lengths.sum(axis=(2, 3)).astype(np.float64)
    samples = (plan_lengths > 0).sum(axis=3)  # [steps, world, accum]
    per_step = samples.sum(axis=(1, 2))
    slot_imbalance = lambda w: (w.max(axis=1) / w.mean(axis=1)).mean()
    return PlanFigures(
        imbalance_mean=float(imb.mean()),
        imbalance_p99=float(np.percentile(imb, 99)),
        padded_imbalance_mean=float(pimb.mean()),
        padded_imbalance_p99=float(np.percentile(pimb, 99)),
        padding=padding_fraction(plan_lengths, pad_multiple),
        tokens_per_rank=float(tokens.mean()),
        tokens_max_over_mean=float(step_imbalance(tokens).mean()),
        step_time=float(work.max(axis=1).mean()),
        padded_step_time=float(padded.max(axis=1).mean()),
        mean_work=float(work.mean()),
        micro_imbalance_mean=float(slot_imbalance(micro_work)),
        padded_micro_imbalance_mean=float(slot_imbalance(padded_micro_work)),
        samples_per_step=float(per_step.mean()),
        samples_per_step_min=int(per_step.min()),
        samples_per_step_max=int(per_step.max()),
        micro_batch_samples_mean=float(samples.mean()),
        micro_batch_samples_max=int(samples.max()),
        micro_batch_tokens_max=int(plan_lengths.sum(axis=3).max()),
        micro_batch_padded_tokens_max=int(padded_tokens(plan_lengths, pad_multiple).max()),
        work_per_rank=work / work.mean(axis=1, keepdims=True),
        padded_work_per_rank=padded / padded.mean(axis=1, keepdims=True),
    )
