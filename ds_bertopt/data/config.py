"""Config of the length-aware batch planner (``"bertopt": {"sampler": {...}}``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import check

STRATEGIES = ("random", "sorted_megabatch", "global_sort", "stratified",
              "stratified_node_sort", "stratified_node_balance")


@dataclass(frozen=True)
class SamplerConfig:
    strategy: Literal["random", "sorted_megabatch", "global_sort", "stratified",
                      "stratified_node_sort", "stratified_node_balance"] = "random"
    """How samples are assigned to ranks and micro-batches each step."""
    pad_multiple: int = 8
    """Dynamic padding rounds each micro-batch's length up to a multiple of this."""

    def validate(self) -> None:
        check(self.pad_multiple >= 1, f"pad_multiple: must be at least 1, got {self.pad_multiple}")
