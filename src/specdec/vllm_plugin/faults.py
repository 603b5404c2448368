"""Test-only fault injection into the proposer's drafter (``SPECDEC_TEST_FAULTS``; not a user option).

The soak (``benchmarks/serve_soak.py --faults``) checks that a real ``vllm serve`` stays up and lossless while the
drafter fails: ``SPECDEC_TEST_FAULTS="raise:100"`` makes every 100th drafting call raise, ``"sleep:100"`` makes every
100th one sleep past the drafting deadline (``draft_timeout_ms``), ``"raise:100,sleep:50"`` both. The proposer reads
the variable once, where it builds its drafter (``proposer.SpecdecProposer``), wraps the drafter in
``FaultyDrafter`` and logs once that faults are injected. Sleeps are counted from half a period, so
"raise:100,sleep:100" raises on calls 100, 200, ... and sleeps on calls 50, 150, ...

A drafting call is one of the drafter's ``draft_batch`` / ``draft_chains`` (the Python engine), or one step of its
native lane (``lane_step``, ``lane_step_tokens``, thread mode's ``lane_collect``): the wrapper also wraps the lane, so
the fast paths see the faults too. What the plugin does with them is its usual handling of a failing or slow drafter:
no draft for that step, counted (``draft_errors``, ``draft_timeouts``) and logged once. A lane step that raises
does so before the lane runs (its requests are restarted from their context, as after any failure); a failing or late
thread-mode step does so after collecting the lane's result, so the lane has no step pending.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specdec.config import ConfigError
from specdec.drafters.base import Chain, Drafter, DraftRequest, WrappedDrafter
from specdec.tree import TokenTree
from specdec.vllm_plugin.logs import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)

FAULTS_ENV = "SPECDEC_TEST_FAULTS"
FAULT_KINDS = ("raise", "sleep")
SLEEP_OVER_DEADLINE = 2.0  # a sleeping call sleeps this many deadlines ...
SLEEP_WITHOUT_DEADLINE_S = 0.1  # ... or this long where there is no deadline (draft_timeout_ms=0)


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault raises."""


@dataclass
class Faults:
    """Every ``raise_every``-th drafting call raises, every ``sleep_every``-th sleeps ``sleep_s`` (0: never)."""

    raise_every: int = 0
    sleep_every: int = 0
    sleep_s: float = SLEEP_WITHOUT_DEADLINE_S
    calls: int = 0
    raised: int = 0
    slept: int = 0

    @classmethod
    def parse(cls, spec: str, *, timeout_ms: float) -> Faults | None:
        """``spec``: "kind:N[,kind:N]" (kinds ``FAULT_KINDS``), "" for none; ``timeout_ms``: the drafting deadline."""
        spec = spec.strip()
        if not spec:
            return None
        every: dict[str, int] = {}
        for part in spec.split(","):
            kind, _, n = part.strip().partition(":")
            if kind not in FAULT_KINDS or not n.strip().isdigit() or int(n) < 1:
                raise ConfigError(
                    f"{FAULTS_ENV}={spec!r}: {part.strip()!r} is not kind:N with kind in {FAULT_KINDS} and N >= 1 "
                    f"(e.g. 'raise:100' or 'raise:100,sleep:50'); unset it to inject no faults"
                )
            every[kind] = int(n)
        sleep_s = SLEEP_OVER_DEADLINE * timeout_ms / 1e3 if timeout_ms > 0 else SLEEP_WITHOUT_DEADLINE_S
        return cls(raise_every=every.get("raise", 0), sleep_every=every.get("sleep", 0), sleep_s=sleep_s)

    def due(self) -> str:
        """Count a drafting call; the fault due on it: "raise" on every ``raise_every``-th call, "sleep" on every
        ``sleep_every``-th counted from half a period (so equal periods never collide), else ""."""
        self.calls += 1
        if self.raise_every and self.calls % self.raise_every == 0:
            self.raised += 1
            return "raise"
        if self.sleep_every and self.calls % self.sleep_every == self.sleep_every // 2:
            self.slept += 1
            return "sleep"
        return ""

    def hit(self, where: str) -> bool:
        """Count a drafting call; raise or sleep if it is due. True if it slept (the call is late)."""
        fault = self.due()
        if fault == "raise":
            raise InjectedFault(f"{FAULTS_ENV}: injected failure of drafting call {self.calls} ({where})")
        if fault == "sleep":
            time.sleep(self.sleep_s)
            return True
        return False

    def as_dict(self) -> dict[str, int]:
        return {"test_fault_calls": self.calls, "test_faults_raised": self.raised, "test_faults_slept": self.slept}


class FaultyDrafter(WrappedDrafter):
    """``drafter`` with ``faults`` injected into its drafting calls (and its native lane's); everything else is
    the drafter's own."""

    def __init__(self, drafter: Drafter, faults: Faults) -> None:
        super().__init__(drafter)
        self.faults = faults

    def __getattr__(self, attr: str) -> Any:  # anything else the plugin reads from its drafter
        return getattr(self.inner, attr)

    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        self.faults.hit("draft_batch")
        return self.inner.draft_batch(requests)

    def draft_chains(self, requests: Sequence[DraftRequest]) -> list[Chain]:
        self.faults.hit("draft_chains")
        return self.inner.draft_chains(requests)

    def native_lane(self) -> FaultyLane | None:
        get = getattr(self.inner, "native_lane", None)
        lane = get() if callable(get) else None
        return FaultyLane(lane, self.faults) if lane is not None else None


class FaultyLane:
    """A drafter's native lane (``core/lane.py``) with the faults in its drafting steps."""

    def __init__(self, lane: Any, faults: Faults) -> None:
        self.lane = lane
        self.faults = faults

    def __getattr__(self, attr: str) -> Any:  # request_ids, lifecycle, configuration: the lane's own
        return getattr(self.lane, attr)

    def lane_step(self, *args: Any, **kwargs: Any) -> Any:
        self.faults.hit("lane_step")
        return self.lane.lane_step(*args, **kwargs)

    def lane_step_tokens(self, *args: Any, **kwargs: Any) -> Any:
        self.faults.hit("lane_step_tokens")
        return self.lane.lane_step_tokens(*args, **kwargs)

    def lane_collect(self, timeout: float | None) -> Any:
        result = self.lane.lane_collect(timeout)  # first: the lane is left with no step pending, whatever comes
        late = self.faults.hit("lane_collect")
        return None if late else result  # late: as a step past the deadline (its drafts dropped)


def inject_faults(drafter: Drafter, spec: str, *, timeout_ms: float) -> Drafter:
    """``drafter`` wrapped with the faults ``spec`` names (``SPECDEC_TEST_FAULTS``'s value; "" = ``drafter``
    itself), logged once."""
    faults = Faults.parse(spec, timeout_ms=timeout_ms)
    if faults is None:
        return drafter
    logger.warning(
        "specdec: %s=%r: injecting drafter faults (TEST ONLY: every %s-th drafting call raises, every %s-th sleeps "
        "%.0f ms)",
        FAULTS_ENV,
        spec,
        faults.raise_every or "no",
        faults.sleep_every or "no",
        1e3 * faults.sleep_s,
    )
    return FaultyDrafter(drafter, faults)
