"""Bounded per-example cache of output-gradient row norms, the optional ``s_i`` of WTA-CRS.

The paper's refinement of ``p_i ∝ ‖x_i‖`` is ``p_i ∝ ‖x_i‖ · ‖∇y_i‖``; ``∇y_i`` is unknown in forward,
so the norm seen the last time the same example went through the layer stands in for it. Any
positive ``s_i`` keeps the estimator unbiased (see :mod:`ds_bertopt.wtacrs.estimator`), so a stale,
missing or evicted entry only costs variance, never correctness.

Memory is bounded: ``capacity`` slots × the longest sequence seen, in bf16 (example ``e`` lives in
slot ``e % capacity``; a tag array detects a slot taken over by another example). Rows without an
entry get the mean score of the cached rows of the batch (or 1); every score is floored at
``SCORE_FLOOR`` × that mean so a row whose gradient was ~0 last time keeps a usable probability.
Lookups and updates are device-only (masks and index writes, no host sync).
"""

from __future__ import annotations

from typing import Optional

import torch

SCORE_FLOOR = 0.05
"""Lowest score, as a fraction of the batch's mean cached score (bounds the importance weights)."""


class GradNormCache:
    """``capacity`` examples × positions of ``‖∇y_i‖`` for one sampled layer (or one shared-input group)."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"cache capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.tags: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None

    def _ensure(self, length: int, device: torch.device) -> None:
        if self.values is None:
            self.tags = torch.full((self.capacity,), -1, dtype=torch.int64, device=device)
            self.values = torch.zeros((self.capacity, length), dtype=torch.bfloat16, device=device)
        elif self.values.shape[1] < length:  # a longer batch than any before: widen, keep entries
            wider = torch.zeros((self.capacity, length), dtype=torch.bfloat16, device=device)
            wider[:, : self.values.shape[1]] = self.values
            self.values = wider

    @property
    def nbytes(self) -> int:
        if self.values is None:
            return 0
        return self.values.numel() * self.values.element_size() + self.tags.numel() * 8

    def scores(self, example_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """``s`` of shape ``valid.shape`` (``B × L``, float32, positive on valid rows)."""
        batch, length = valid.shape
        self._ensure(length, valid.device)
        slots = example_ids.to(valid.device) % self.capacity
        hit = self.tags[slots] == example_ids.to(valid.device)
        cached = self.values[slots, :length].float()
        known = hit.unsqueeze(1) & valid & (cached > 0)
        # mean over the known entries, 1 when there are none: a masked sum, no boolean indexing (no host sync)
        count = known.sum()
        total = torch.where(known, cached, torch.zeros((), device=cached.device)).sum()
        mean = torch.where(count > 0, total / count.clamp_min(1), torch.ones((), device=cached.device))
        scores = torch.where(known, cached, mean)
        return torch.maximum(scores, SCORE_FLOOR * mean)

    @torch.no_grad()
    def update(self, example_ids: torch.Tensor, valid: torch.Tensor, row_norms: torch.Tensor) -> None:
        """Store ``row_norms`` (``B × L``) of the valid positions of each example."""
        batch, length = valid.shape
        self._ensure(length, valid.device)
        ids = example_ids.to(valid.device)
        slots = ids % self.capacity
        self.tags[slots] = ids
        fresh = torch.where(valid, row_norms.float(), torch.zeros((), device=valid.device))
        self.values[slots, :length] = fresh.to(torch.bfloat16)
        self.values[slots, length:] = 0
