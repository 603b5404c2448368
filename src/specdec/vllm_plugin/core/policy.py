"""``DraftingPolicy``: every decision of one engine's drafting, per request and per batch, with the state behind it
(never imports vLLM; unit-tested on CPU). ``ProposerCore`` keeps the bookkeeping and hands the rows to its drafting
engine; what gets drafted, how far and how it is padded is decided here, from these inputs:

- the **step-cost fit** (``adaptive.StepCostModel``, one per batch-size bucket): each step's period against the
  tokens it verified; it prices a verified draft token (``token_cost``);
- the **confidence cut** (``adaptive.AdaptiveController``): the path probability a draft token needs, from that price
  and the fixed floors; the native lane applies the same cut from the same numbers (``lane_decisions``);
- the **low-acceptance rule** (``backoff.BackOff``): who hands vLLM drafts when drafts are not accepted;
- **padding** (``should_pad``): every row to k for a uniform batch (FULL CUDA graphs) while the padded tokens' compute
  is a small share of the step, never for a batch whose drafts are not accepted.

- **slot widths** (``SlotWidths``, schedule mode): the uniform width a schedule's requests get, or per-request slots,
  from the running requests, the tokens a request gets per step (MAT) and the low-acceptance flag; and the growth of
  per-request slots while the extra slots pay (``growth_pays``). The slot book (``modes/slots.py``) holds their state
  in the scheduler's process (its own under TP > 1) and asks these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specdec.drafters.suffix_lane import LaneDecisions
from specdec.vllm_plugin.core.adaptive import AdaptiveController, StepCostModel, bucket_of
from specdec.vllm_plugin.core.backoff import BackOff
from specdec.vllm_plugin.core.engine import StepPlan
from specdec.vllm_plugin.core.user_options import CoreOptions
from specdec.vllm_plugin.internal import InternalSettings

ASSUMED_GPU_FLOPS = 1e15  # dense bf16 of an H100/H200 class GPU, for pad_drafts="auto"'s compute estimate
PAD_MAX_STEP_SHARE = 0.1  # pad_drafts="auto": pad while the padded tokens' compute is under this share of a step
PAD_DEFAULT_PERIOD_S = 1e-3  # step period assumed before any is measured
PERIOD_EMA = 0.9  # decay of the step-period average

# The slot widths (schedule mode, adaptive slots). A verify batch that is uniform (every request the same number of
# tokens) runs as one FULL CUDA graph; a ragged one as piecewise graphs whose launches keep the host busy, unless the
# ragged graphs are captured. Where drafts are often accepted (a high MAT: tokens a request gets per step, a moving
# average) long per-request slots pay; where they seldom are, a uniform narrow width pays more in launches saved
# than its filler costs in verification. Measured on an 8B-shaped target on H100/H200 (docs/results.md):
NARROW_FROM_ROWS = 16  # below this many running requests every row keeps k slots, padded (vLLM's own full graphs)
NARROW_BELOW_ROWS = 48  # from NARROW_FROM_ROWS up to this, steps are narrow (launch-bound mid-size batches)
NARROW_WIDTH = 6  # the mid-size narrow width
HIGH_MAT_WIDTH = 8  # ... while the MAT is at least HIGH_MAT (long accepted drafts pay for a wider batch)
HIGH_MAT = 4.0
LARGE_BATCH_WIDTH = 4  # from NARROW_BELOW_ROWS on (GPU-bound): narrow only while the MAT is at most LOW_MAT
LOW_MAT = 3.0
SLOT_GROWTH = 1.0  # a request's next step gets L + ceil(SLOT_GROWTH * L) slots for a latest draft of L tokens ...
SLOT_GROWTH_MIN_SHARE = 0.15  # ... while at least this share of the extra slots held an accepted token


class DraftingPolicy:
    """One engine's drafting decisions (see the module docstring)."""

    def __init__(self, options: CoreOptions, *, internal: InternalSettings, target_params: float = 0.0) -> None:
        """``internal``: the confidence floor (``min_path_prob``, ``min_path_prob_per_seq``); ``target_params``: the
        served model's parameter count (pad_drafts="auto" estimates the compute of padded tokens as 2 x params FLOPs
        each; 0 = unknown, then "auto" never pads)."""
        self.pad_mode = options.pad_mode
        self.adaptive = AdaptiveController(
            enabled=options.adaptive,
            min_path_prob=internal.min_path_prob,
            min_path_prob_per_seq=internal.min_path_prob_per_seq,
        )
        self.backoff = BackOff(enabled=options.adaptive)
        self.costs: dict[int, StepCostModel] = {}  # one step-cost fit per batch-size bucket
        self.token_s = 2.0 * target_params / ASSUMED_GPU_FLOPS  # GPU seconds per verified token (estimate)
        self.period_s = PAD_DEFAULT_PERIOD_S  # the step period, a moving average
        self.pad_below_rows = 0  # pad_drafts="auto" also pads below this many running requests (schedule mode)

    def use_adaptive_slots(self) -> None:
        """Schedule mode with adaptive slots: below ``NARROW_FROM_ROWS`` requests every row keeps k slots, so
        pad_drafts="auto" pads there too (vLLM's own uniform graphs)."""
        self.pad_below_rows = NARROW_FROM_ROWS

    def cost_model(self, running: int) -> StepCostModel:
        """The step-cost fit of batches of ``running`` requests."""
        bucket = bucket_of(running)
        cost = self.costs.get(bucket)
        if cost is None:
            cost = self.costs[bucket] = StepCostModel()
        return cost

    def token_cost(self, running: int) -> float:
        """The calibrated acceptance probability a verified draft token needs at ``running`` decoding rows (0 with
        the adaptive controller off)."""
        return self.cost_model(running).token_cost() if self.adaptive.enabled else 0.0

    def observe_step(self, seconds: float, *, running: int, verified: int, emitted: int) -> None:
        """A whole decoding step's period (``running`` rows, ``verified`` tokens, ``emitted`` tokens)."""
        self.cost_model(running).observe(seconds, verified, emitted)
        self.period_s = PERIOD_EMA * self.period_s + (1 - PERIOD_EMA) * seconds

    def should_pad(self, running: int, k: int) -> bool:
        """Pad this step's drafts to k? 'on'/'off' decide; 'auto' pads while the verify batch of running x (k+1)
        tokens costs (estimated GPU compute) under PAD_MAX_STEP_SHARE of the measured step period (or below
        ``pad_below_rows`` requests), unless the back-off says the batch's drafts are not accepted."""
        if self.pad_mode != "auto":
            return self.pad_mode == "on"
        cheap = 0 < running * (k + 1) * self.token_s <= PAD_MAX_STEP_SHARE * self.period_s
        pads = running < self.pad_below_rows or cheap
        if pads and running and self.backoff.low():  # drafts are not accepted: padding verifies filler only
            self.backoff.stats.unpadded_steps += 1
            return False
        return pads

    def lane_decisions(self, plan: StepPlan, *, max_model_len: int) -> LaneDecisions:
        """The step's decisions for the native lane (the same cut the Python engine applies)."""
        enabled = self.adaptive.enabled
        return LaneDecisions(
            k=plan.k,
            max_model_len=max_model_len,
            spec=plan.mode != "plain",
            pad=plan.pad,
            adaptive=enabled,
            floor=self.adaptive.cut(plan.running) if enabled else self.adaptive.min_path_prob,
            value=self.cost_model(plan.running).token_cost() if enabled else 0.0,
        )


def usable_width(width: int, k: int) -> int:
    """A narrow step's slots per request, or 0 (off) where ``width`` is not in 1..k-1 (k itself is vLLM's own
    uniform batch)."""
    return width if 0 < width < k else 0


def policy_widths(k: int) -> tuple[int, ...]:
    """The narrow widths the policy may choose at draft length ``k`` (each needs its own FULL CUDA graphs)."""
    return tuple(sorted({w for w in (NARROW_WIDTH, HIGH_MAT_WIDTH, LARGE_BATCH_WIDTH) if usable_width(w, k)}))


def growth_pays(paid: float | None, *, token_cost: float, min_share: float, probe: bool) -> bool:
    """Per-request slots grow past the latest draft while the share of the extra slots that held an accepted token
    (``paid``; None before any settled) reaches the token's price and ``min_share``, or on a probe note."""
    return probe or paid is None or paid >= max(token_cost, min_share)


@dataclass(frozen=True)
class SlotWidths:
    """Which uniform width a schedule gives every decoding request (0: per-request slots). ``narrow`` for
    ``narrow_rows`` = [from, below) running requests, widened to ``high`` = (width, min MAT) while the MAT is at least
    that; ``large`` = (width, max MAT) from ``below`` requests on while the MAT is at most that. A width must be in
    1..k-1 to be used (``usable_width``)."""

    k: int
    narrow: int = 0
    narrow_rows: tuple[int, int] = (0, 0)
    large: tuple[int, float] = (0, 0.0)
    high: tuple[int, float] = (0, 0.0)

    @classmethod
    def policy(cls, k: int, *, narrow: bool = True) -> SlotWidths:
        """The module constants' widths; ``narrow`` False: per-request slots only (no narrow graphs)."""
        return cls(
            k,
            narrow=NARROW_WIDTH if narrow else 0,
            narrow_rows=(NARROW_FROM_ROWS, NARROW_BELOW_ROWS),
            large=(LARGE_BATCH_WIDTH if narrow else 0, LOW_MAT),
            high=(HIGH_MAT_WIDTH, HIGH_MAT),
        )

    @property
    def narrow_width(self) -> int:
        return usable_width(self.narrow, self.k)

    @property
    def large_width(self) -> int:
        return usable_width(self.large[0], self.k)

    @property
    def high_width(self) -> int:
        return usable_width(self.high[0], self.k) if self.narrow_width else 0

    def choose(
        self, running: int, mat: float | None, *, low: bool, ragged_ready: Callable[[], bool] | None = None
    ) -> tuple[int, bool]:
        """(width, per-request for a high MAT) of a schedule of ``running`` requests: 0 on a ``low`` batch (drafts
        not accepted: no filler width); a mid-size schedule is narrow, unless the MAT is high and ``ragged_ready()``
        says the ragged graphs are captured, when each request keeps its own slots (True); a large one is narrow
        while the MAT is low."""
        lo, below = self.narrow_rows
        if low:
            return 0, False
        if self.narrow_width and lo <= running < below:
            high = mat is not None and mat >= self.high[1]
            if high and ragged_ready is not None and ragged_ready():
                return 0, True
            return (self.high_width if high and self.high_width else self.narrow_width), False
        if running < max(below, lo) or mat is None:
            return 0, False
        return (self.large_width if self.large_width and mat <= self.large[1] else 0), False
