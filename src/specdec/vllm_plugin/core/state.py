"""Per-request and per-proposer records of ``ProposerCore`` (specdec/vllm_plugin/core.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from specdec.drafters.base import DraftRequest
from specdec.vllm_plugin.core.lane import MAX_CALIBRATION, MIN_CALIBRATION, MIN_CALIBRATION_MASS


@dataclass
class RequestState:
    n_known: int  # context length the drafter has seen
    last_draft: int = 0  # tokens submitted for it at the previous step (padding included)
    last_real: int = 0  # of which the drafter's own (before the confidence cut; padding excluded)
    last_pred: float | None = None  # sum of their path probabilities (None: drafter gave none)
    pred_ema: float = 0.0  # decayed sums of predicted (path probs) and accepted draft tokens: calibration
    acc_ema: float = 0.0

    def calibration(self) -> float:
        """accepted / predicted for this request (drafter probabilities are frequency estimates)."""
        if self.pred_ema < MIN_CALIBRATION_MASS:
            return 1.0
        return min(MAX_CALIBRATION, max(MIN_CALIBRATION, self.acc_ema / self.pred_ema))


class Order(NamedTuple):
    """One row's drafting order this step."""

    request: DraftRequest  # what the drafter is asked for (budget: max(own budget, pad))
    budget: int  # the drafter's own tokens, at most (before the confidence cut)
    pad: int  # submit exactly this many tokens (0: no padding)
    filler: int  # the request's last token: padding past the drafter's chain


@dataclass
class ProposerStats:
    steps: int = 0
    rows: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0  # of our drafts, as seen from the next step's sampled lengths
    emitted_tokens: int = 0
    propose_seconds: float = 0.0  # wall time inside propose (critical path: GPU idle meanwhile)
    timeouts: int = 0
    busy_skips: int = 0  # steps skipped because a timed-out draft was still running
    resyncs: int = 0
    started: int = 0
    stopped: int = 0
    plain_steps: int = 0
    drafted_steps: int = 0  # steps that handed vLLM at least one draft token (the rest verify no draft: plain graphs)
    early_refreshes: int = 0  # global-cache match fronts rebuilt before the step (schedule mode, refresh_early)

    def as_dict(self) -> dict[str, float]:
        d = dict(self.__dict__)
        d["propose_ms_per_step"] = 1e3 * self.propose_seconds / max(self.steps, 1)
        d["acceptance_rate"] = self.accepted_tokens / max(self.drafted_tokens, 1)
        return d
