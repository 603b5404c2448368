"""Adaptive speculation: draft only where it pays (never imports vLLM; unit-tested on CPU).

Three mechanisms, all cheap per step:

1. **Confidence cut by batch size.** A draft token whose path probability (the drafter's own estimate,
   ``TokenTree.probs``) is below ``min_path_prob + min_path_prob_per_seq * running_requests`` is dropped: at
   batch 1 a verified token is almost free, at batch 64 every extra token costs GPU time for all.
2. **Per-request acceptance.** A request whose acceptance EMA (accepted / drafted) falls below ``min_acceptance``
   drafts at most ``PROBE_TOKENS`` tokens per step until it recovers.
3. **Throughput check per batch-size bucket.** Steps are grouped in windows of ``probe_window_steps``; each window
   runs either with drafts ("spec") or without ("plain"), and its throughput (emitted tokens / wall time between
   proposer calls, so drafting cost is included) feeds an EMA per bucket (buckets: 1, 2, 3-4, 5-8, ...). A bucket
   drafts while spec >= ``min_speedup`` x plain; every ``probe_every``-th window runs the other mode to keep
   both estimates fresh. This is what makes specdec no slower than no speculation at any batch size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

PROBE_TOKENS = 2  # draft length for requests whose acceptance is poor
EMA_ALPHA = 0.3  # weight of the newest window's throughput
ACCEPT_EMA_ALPHA = 0.2  # weight of the newest step in a request's acceptance EMA
MAX_CUT = 0.9  # the confidence threshold never exceeds this


def bucket_of(num_running: int) -> int:
    """0 for 1 request, 1 for 2, 2 for 3-4, 3 for 5-8, ... (power-of-two buckets)."""
    return 0 if num_running <= 1 else int(math.ceil(math.log2(num_running)))


@dataclass
class BucketState:
    """Throughput estimates (tokens/s) of one batch-size bucket, and its window schedule."""

    spec_tps: float | None = None
    plain_tps: float | None = None
    windows: int = 0  # completed windows

    def best_mode(self, min_speedup: float) -> str:
        if self.spec_tps is None:
            return "spec"
        if self.plain_tps is None:
            return "plain"
        return "spec" if self.spec_tps >= min_speedup * self.plain_tps else "plain"


@dataclass
class Window:
    bucket: int
    mode: str
    t_start: float
    steps: int = 0
    emitted: int = 0


@dataclass
class AdaptiveController:
    """Decides per step whether to draft and how confident a token must be (see the module docstring)."""

    enabled: bool = True
    min_path_prob: float = 0.0
    min_path_prob_per_seq: float = 0.004
    min_acceptance: float = 0.1
    window_steps: int = 16
    probe_every: int = 32
    min_speedup: float = 1.0
    buckets: dict[int, BucketState] = field(default_factory=dict)
    window: Window | None = None
    plain_steps: int = 0
    spec_steps: int = 0

    # ----------------------------------------------------------------- per step
    def mode(self, num_running: int, now: float) -> str:
        """'spec' or 'plain' for the coming step (starts/rolls windows)."""
        if not self.enabled:
            return "spec"
        b = bucket_of(num_running)
        w = self.window
        if w is None or w.bucket != b or w.steps >= self.window_steps:
            if w is not None and w.bucket == b and w.steps >= self.window_steps:
                self._close(w, now)
            self.window = w = Window(bucket=b, mode=self._next_mode(b), t_start=now)
        if w.mode == "plain":
            self.plain_steps += 1
        else:
            self.spec_steps += 1
        return w.mode

    def observe(self, emitted: int) -> None:
        """Tokens emitted by the step that just finished (called before ``mode`` of the next step)."""
        if self.window is not None:
            self.window.steps += 1
            self.window.emitted += emitted

    def cut(self, num_running: int) -> float:
        """Minimum path probability a draft token must have at this batch size."""
        base = self.min_path_prob
        if self.enabled:
            base += self.min_path_prob_per_seq * max(0, num_running - 1)
        return min(base, MAX_CUT)

    def request_budget(self, budget: int, acceptance_ema: float | None) -> int:
        if self.enabled and acceptance_ema is not None and acceptance_ema < self.min_acceptance:
            return min(budget, PROBE_TOKENS)
        return budget

    # ----------------------------------------------------------------- windows
    def _next_mode(self, b: int) -> str:
        st = self.buckets.setdefault(b, BucketState())
        best = st.best_mode(self.min_speedup)
        if st.spec_tps is not None and st.plain_tps is not None and (st.windows + 1) % self.probe_every == 0:
            return "plain" if best == "spec" else "spec"
        return best

    def _close(self, w: Window, now: float) -> None:
        elapsed = now - w.t_start
        if elapsed <= 0 or w.steps == 0:
            return
        tps = w.emitted / elapsed
        st = self.buckets.setdefault(w.bucket, BucketState())
        st.windows += 1
        if w.mode == "spec":
            st.spec_tps = tps if st.spec_tps is None else (1 - EMA_ALPHA) * st.spec_tps + EMA_ALPHA * tps
        else:
            st.plain_tps = tps if st.plain_tps is None else (1 - EMA_ALPHA) * st.plain_tps + EMA_ALPHA * tps

    def as_dict(self) -> dict[str, object]:
        return {
            "spec_steps": self.spec_steps,
            "plain_steps": self.plain_steps,
            "buckets": {
                str(b): {"spec_tps": s.spec_tps, "plain_tps": s.plain_tps, "windows": s.windows}
                for b, s in sorted(self.buckets.items())
            },
        }


def update_acceptance(ema: float | None, drafted: int, accepted: int) -> float | None:
    """New acceptance EMA of a request after a step that verified ``drafted`` tokens."""
    if drafted <= 0:
        return ema
    rate = accepted / drafted
    return rate if ema is None else (1 - ACCEPT_EMA_ALPHA) * ema + ACCEPT_EMA_ALPHA * rate
