"""Dirty records: counted by reason, named by place, and capped (``data.max_skipped_fraction``).

A corpus record without usable text and a labelled row with empty text are skipped, never trained on
silently: :class:`Skipped` tallies them while the data is read, its :meth:`~Skipped.line` goes into the
data line of the log ("2 of 496 records skipped: no text field (line 4, line 5)"), and
:meth:`~Skipped.check` refuses the data, in one line, when more than the allowed fraction was skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import DataError

NAMED = 3
"""Places named per reason; the rest are counted."""


@dataclass
class Skipped:
    what: str = "records"
    """What is counted ("records", "rows"), for the line."""
    total: int = 0
    """Records read, skipped or not."""
    places: dict[str, list[str]] = field(default_factory=dict)
    """Reason → the first :data:`NAMED` places (``"line 4"``)."""
    counts: dict[str, int] = field(default_factory=dict)
    """Reason → how many."""

    def add(self, reason: str, place: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        named = self.places.setdefault(reason, [])
        if len(named) < NAMED:
            named.append(place)

    @property
    def count(self) -> int:
        return sum(self.counts.values())

    def line(self) -> str:
        """``"2 of 496 records skipped: no text field (line 4, line 5)"``, or ``""`` when none was."""
        if not self.count:
            return ""
        parts = []
        for reason, n in self.counts.items():
            named = ", ".join(self.places[reason]) + (", …" if n > len(self.places[reason]) else "")
            parts.append(f"{reason} ({named})" if len(self.counts) == 1 else f"{n} × {reason} ({named})")
        return f"{self.count} of {self.total} {self.what} skipped: {'; '.join(parts)}"

    def check(self, source: str, max_fraction: float) -> None:
        """Refuse the data when more than ``max_fraction`` of its records were skipped."""
        if self.count and self.count > max_fraction * self.total:
            raise DataError(
                f"{source}: {self.line()}; that is {self.count / self.total:.0%}, more than "
                f"data.max_skipped_fraction {max_fraction:g}: fix the data or raise data.max_skipped_fraction"
            )
