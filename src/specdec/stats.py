"""Acceptance counters shared by library generation (``SpecStats``) and trace replay (``ReplayResult``).

Terms follow the glossary in ``specdec.verifiers.reference``: a step verifies one request's draft; MAT =
emitted tokens / steps (the recovered or bonus token included); acceptance rate = accepted / drafted.
``per_position_drafted[k]``: steps whose draft reached depth ``k + 1``; ``per_position_accepted[k]``: steps
that accepted at least ``k + 1`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceCounts:
    """Step, token and per-position counters with the derived rates."""

    steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    per_position_accepted: list[int] = field(default_factory=list)
    per_position_drafted: list[int] = field(default_factory=list)

    def observe(self, *, drafted: int, depth: int, accepted: int, emitted: int) -> None:
        """Count one step: ``drafted`` nodes reaching ``depth``, ``accepted`` of them, ``emitted`` tokens out."""
        self.steps += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.emitted_tokens += emitted
        grow = depth - len(self.per_position_drafted)
        if grow > 0:  # both lists always span the deepest draft seen
            self.per_position_drafted.extend([0] * grow)
            self.per_position_accepted.extend([0] * grow)
        for k in range(depth):
            self.per_position_drafted[k] += 1
        for k in range(accepted):
            self.per_position_accepted[k] += 1

    @property
    def mat(self) -> float:
        return self.emitted_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """[k] = per_position_accepted[k] / per_position_drafted[k] (0 where nothing was drafted)."""
        return [a / d if d else 0.0 for a, d in zip(self.per_position_accepted, self.per_position_drafted)]
