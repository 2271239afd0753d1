"""Config of WTA-CRS and the fine-tuning memory kit (``"bertopt": {"wtacrs": {...}}``)."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import check


@dataclass(frozen=True)
class WtaCrsConfig:
    enabled: bool = False
    """Swap the target linears for WTA-CRS sampled linears before ``deepspeed.initialize``."""
    ratio: float = 0.3
    """Fraction k/N of non-padding token rows kept for the weight gradient, in (0, 1]."""
    targets: tuple[str, ...] = ("output.dense",)
    """Module-name suffixes of the linears to swap."""
    min_k: int = 32
    """Keep at least this many rows."""

    def validate(self) -> None:
        check(0.0 < self.ratio <= 1.0, f"ratio: must be in (0, 1], got {self.ratio}")
        check(self.min_k >= 1, f"min_k: must be at least 1, got {self.min_k}")
        check(len(self.targets) > 0, "targets: give at least one module-name suffix")
