"""Adaptive speculation: draft only where it pays (never imports vLLM; unit-tested on CPU).

Mechanisms, all cheap per step:

1. **Cost-model confidence cut** (``StepCostModel``). Each engine step's period (time between proposer calls, so
   drafting is included) is fitted online as ``a + b * T``, T = tokens the step verified (rows + draft tokens).
   One fit per batch-size bucket. A draft token with path probability ``p`` (the drafter's estimate, calibrated
   per request by its observed accepted / predicted ratio) is worth sending iff it adds more expected tokens than
   it costs time at the current rate: ``p * calib >= b * tokens_per_second``. At batch 1 on a big GPU ``b`` is ~0 (draft everything); at batch 64
   each token costs everyone, so only confident tokens go. ``min_path_prob`` (+ ``min_path_prob_per_seq`` x
   running requests) is a fixed floor on top.
2. **Per-request acceptance.** A request whose acceptance EMA (accepted / drafted) falls below ``min_acceptance``
   drafts at most ``PROBE_TOKENS`` tokens per step until it recovers.
3. **Throughput A/B per batch-size bucket** (``ab_windows``, off by default since GPU run 19). vLLM's speculative step has a
   large fixed cost beside the per-token one (measured on an H200 with the 53M target: a spec step costs
   2-3x a plain one at batch 8-64 even with ~3 draft tokens per request), which a per-token fit cannot see. Steps are grouped in windows of ``probe_window_steps``; each window
   runs either with drafts ("spec") or without ("plain"), and its throughput (emitted tokens / wall time between
   proposer calls, so drafting cost is included) feeds an EMA per bucket (buckets: 1, 2, 3-4, 5-8, ...). A bucket
   drafts while spec >= ``min_speedup`` x plain; every ``probe_every``-th window runs the other mode to keep
   both estimates fresh (while plain leads, spec is re-tried after ``PLAIN_PROBE_EVERY`` windows, then after twice
   as many each time, up to ``probe_every``). This keeps specdec no slower than the same engine without drafts. It cannot see vLLM's
   own no-spec engine, which is faster still on a host-bound target (Model Runner V2, async scheduling: every
   CPU drafter runs on V1 with synchronous scheduling); measured in docs/vllm.md, run 17.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

PROBE_TOKENS = 2  # draft length for requests whose acceptance is poor
EMA_ALPHA_MIN = 0.1  # weight of the newest window in a mode's throughput estimate (after the first 10)
ACCEPT_EMA_ALPHA = 0.2  # weight of the newest step in a request's acceptance EMA
MAX_CUT = 0.9  # the confidence threshold never exceeds this
PLAIN_PROBE_EVERY = 4  # while plain leads a bucket, every 4th window drafts again (spec is the normal mode)
SPEC_BIAS = 1.03  # hysteresis: plain must beat spec by 3% (measurement noise) before drafting stops


def bucket_of(num_running: int) -> int:
    """0 for 1 request, 1 for 2, 2 for 3-4, 3 for 5-8, ... (power-of-two buckets)."""
    return 0 if num_running <= 1 else int(math.ceil(math.log2(num_running)))


@dataclass
class BucketState:
    """Throughput estimates (tokens/s) of one batch-size bucket, and its window schedule.

    Each mode keeps decayed sums of emitted tokens and seconds (ratio of sums: robust for one-step windows);
    the decay is ``max(EMA_ALPHA_MIN, 1 / samples)``, a running mean that turns into an EMA."""

    spec_tok: float = 0.0
    spec_sec: float = 0.0
    spec_n: int = 0
    plain_tok: float = 0.0
    plain_sec: float = 0.0
    plain_n: int = 0
    windows: int = 0  # completed windows
    since_probe: int = 0  # windows opened since the last probe of the other mode
    plain_gap: int = PLAIN_PROBE_EVERY  # while plain leads: windows between spec probes (doubles per probe)

    @property
    def spec_tps(self) -> float | None:
        return self.spec_tok / self.spec_sec if self.spec_n else None

    @property
    def plain_tps(self) -> float | None:
        return self.plain_tok / self.plain_sec if self.plain_n else None

    def add(self, mode: str, tokens: int, seconds: float) -> None:
        n = getattr(self, f"{mode}_n") + 1
        a = max(EMA_ALPHA_MIN, 1.0 / n)
        setattr(self, f"{mode}_n", n)
        setattr(self, f"{mode}_tok", (1 - a) * getattr(self, f"{mode}_tok") + a * tokens)
        setattr(self, f"{mode}_sec", (1 - a) * getattr(self, f"{mode}_sec") + a * seconds)

    def best_mode(self, min_speedup: float) -> str:
        if self.spec_tps is None:
            return "spec"
        if self.plain_tps is None:
            return "plain"
        return "spec" if self.spec_tps * SPEC_BIAS >= min_speedup * self.plain_tps else "plain"


@dataclass
class Window:
    bucket: int
    mode: str
    t_start: float
    steps: int = 0
    emitted: int = 0
    tainted: bool = False  # a step of it ran a prefill: its throughput says nothing about decoding


@dataclass
class AdaptiveController:
    """Decides per step whether to draft and how confident a token must be (see the module docstring)."""

    enabled: bool = True
    min_path_prob: float = 0.0
    min_path_prob_per_seq: float = 0.0
    ab_windows: bool = True
    min_acceptance: float = 0.1
    window_steps: int = 1
    probe_every: int = 32
    min_speedup: float = 1.0
    buckets: dict[int, BucketState] = field(default_factory=dict)
    window: Window | None = None
    plain_steps: int = 0
    spec_steps: int = 0

    # ----------------------------------------------------------------- per step
    def mode(self, num_running: int, now: float) -> str:
        """'spec' or 'plain' for the coming step (starts/rolls windows)."""
        if not self.enabled or not self.ab_windows:
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

    def observe(self, emitted: int, *, prefill: bool = False) -> None:
        """Tokens emitted by the step that just finished (called before ``mode`` of the next step);
        ``prefill``: that step also prefilled a request (the window is then not used for the estimate)."""
        if self.window is not None:
            self.window.steps += 1
            self.window.emitted += emitted
            self.window.tainted |= prefill

    def cut(self, num_running: int, model_cut: float = 0.0) -> float:
        """Minimum path probability a draft token must have (fixed floor, per-seq term, cost model)."""
        base = self.min_path_prob
        if self.enabled:
            base = max(base + self.min_path_prob_per_seq * max(0, num_running - 1), model_cut)
        return min(base, MAX_CUT)

    def request_budget(self, budget: int, acceptance_ema: float | None) -> int:
        if self.enabled and acceptance_ema is not None and acceptance_ema < self.min_acceptance:
            return min(budget, PROBE_TOKENS)
        return budget

    # ----------------------------------------------------------------- windows
    def _next_mode(self, b: int) -> str:
        st = self.buckets.setdefault(b, BucketState())
        best = st.best_mode(self.min_speedup)
        if st.spec_tps is None or st.plain_tps is None:
            return best
        # drafting is the normal mode: while plain leads, spec is re-tried after PLAIN_PROBE_EVERY windows, then
        # after twice as many each time plain still leads (up to probe_every), so that a noisy early estimate
        # cannot hold a bucket in plain mode for long (measured: 30-step lock-ins with a fixed probe_every)
        if best == "spec":
            st.plain_gap = PLAIN_PROBE_EVERY
        every = self.probe_every if best == "spec" else min(st.plain_gap, self.probe_every)
        st.since_probe += 1
        if st.since_probe < every:
            return best
        st.since_probe = 0
        if best == "plain":
            st.plain_gap = min(2 * st.plain_gap, self.probe_every)
        return "plain" if best == "spec" else "spec"

    def _close(self, w: Window, now: float) -> None:
        elapsed = now - w.t_start
        if elapsed <= 0 or w.steps == 0 or w.tainted:
            return
        st = self.buckets.setdefault(w.bucket, BucketState())
        st.windows += 1
        st.add(w.mode, w.emitted, elapsed)

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
                self.known_slope = max(0.0, (self.sxy / self.n - self.sx * self.sy / self.n ** 2) / var)

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
        return {"slope_us_per_token": 1e6 * self.slope, "tokens_per_s": self.rate, "token_cost": self.token_cost(),
                "intercept_ms": 1e3 * (self.sy - self.slope * self.sx) / self.n if self.n else None}


MIN_FIT_STEPS = 8  # steps before the fitted slope is used
MIN_FIT_VARIANCE = 4.0  # tokens^2: below it the verified-token counts did not vary enough to fit a slope
