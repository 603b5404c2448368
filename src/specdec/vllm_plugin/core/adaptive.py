"""Adaptive speculation: draft only where it pays (never imports vLLM; unit-tested on CPU).

Mechanisms, all cheap per step:

1. **Cost-model confidence cut** (``StepCostModel``). Each engine step's period (time between proposer calls, so
   drafting is included) is fitted online as ``a + b * T``, T = tokens the step verified (rows + draft tokens).
   One fit per batch-size bucket. A draft token with path probability ``p`` (the drafter's estimate, calibrated
   per request by its observed accepted / predicted ratio) is worth sending iff it adds more expected tokens than
   it costs time at the current rate: ``p * calib >= b * tokens_per_second``. At batch 1 on a big GPU ``b`` is ~0 (draft
   everything); at batch 64 each token costs everyone, so only confident tokens go. ``min_path_prob`` (+
   ``min_path_prob_per_seq`` x running requests) is a fixed floor on top.

Requests and batches whose drafts are not accepted are the low-acceptance policy's (``backoff.py``), not this one's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_CUT = 0.9  # the confidence threshold never exceeds this


def bucket_of(num_running: int) -> int:
    """0 for 1 request, 1 for 2, 2 for 3-4, 3 for 5-8, ... (power-of-two buckets)."""
    return 0 if num_running <= 1 else int(math.ceil(math.log2(num_running)))


@dataclass
class AdaptiveController:
    """How much each request drafts and how confident a token must be (see the module docstring)."""

    enabled: bool = True
    min_path_prob: float = 0.0
    min_path_prob_per_seq: float = 0.0

    def cut(self, num_running: int, model_cut: float = 0.0) -> float:
        """Minimum path probability a draft token must have (fixed floor, per-seq term, cost model)."""
        base = self.min_path_prob
        if self.enabled:
            base = max(base + self.min_path_prob_per_seq * max(0, num_running - 1), model_cut)
        return min(base, MAX_CUT)


@dataclass
class StepCostModel:
    """Online fit of step period = a + b * verified tokens, with exponential forgetting (see the module doc).

    One per batch-size bucket. The slope keeps its last well-determined value while the verified-token counts
    stop varying (e.g. while the cut suppresses drafting), so the decision does not oscillate."""

    decay: float = 0.98
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    rate: float | None = None  # EMA of emitted tokens per second
    known_slope: float = 0.0

    def observe(self, seconds: float, verified_tokens: int, emitted: int) -> None:
        if seconds <= 0 or verified_tokens <= 0:
            return
        d = self.decay
        x, y = float(verified_tokens), seconds
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y
        r = emitted / seconds
        self.rate = r if self.rate is None else 0.9 * self.rate + 0.1 * r
        if self.n >= MIN_FIT_STEPS:
            var = self.sxx / self.n - (self.sx / self.n) ** 2
            if var >= MIN_FIT_VARIANCE:
                self.known_slope = max(0.0, (self.sxy / self.n - self.sx * self.sy / self.n**2) / var)

    @property
    def slope(self) -> float:
        """b: seconds per extra verified token (0 until the fit has had spread)."""
        return self.known_slope

    def token_cost(self) -> float:
        """Calibrated acceptance probability a draft token needs to pay for itself: b * tokens/s."""
        if self.rate is None:
            return 0.0
        return min(MAX_CUT, self.slope * self.rate)

    def as_dict(self) -> dict[str, float | None]:
        return {
            "slope_us_per_token": 1e6 * self.slope,
            "tokens_per_s": self.rate,
            "token_cost": self.token_cost(),
            "intercept_ms": 1e3 * (self.sy - self.slope * self.sx) / self.n if self.n else None,
        }


MIN_FIT_STEPS = 8  # steps before the fitted slope is used
MIN_FIT_VARIANCE = 4.0  # tokens^2: below it the verified-token counts did not vary enough to fit a slope
