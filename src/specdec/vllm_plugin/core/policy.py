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

Schedule mode's slot widths (``modes/slots.py``) read the same low-acceptance flag (``backoff.low``) and token price.
"""

from __future__ import annotations

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
