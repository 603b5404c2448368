"""Schedule mode's capture of each step's sampled tokens (``CaptureRing``; the drafting: ``schedule.py``).

After sampling, the runner hook hands over the step's sampled tokens ``[rows, k+1]`` (-1 = rejected, on the GPU): a
non-blocking copy to a ring of pinned host buffers starts on a side stream, and the step's rows are noted. The
drafting reads the oldest captured steps in order, each once its copy is done (``_tokens``), into the token feed.
The same hook hands vLLM the per-row valid counts its async path needs (``counts``), computed on the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from specdec.vllm_plugin.core.gil import quick_reacquire
from specdec.vllm_plugin.modes.feed import TokenFeed, valid_counts
from specdec.vllm_plugin.modes.phases import PHASE_CAPTURE, PHASE_TOKENS, DraftingObserver

T = TypeVar("T")
RING_SLOTS = 4  # pinned buffers for sampled tokens; a slot is reused only after its step was read


def discard_counts(
    sampled: Any, discard: dict[int, int], discard_mask: Any, backup: Any, device: Any
) -> tuple[Any, Any]:
    """``valid_counts`` of sampled ``[rows, w]``; the tokens of discarded rows (``discard`` = {row: its last context
    token}, ``discard_mask`` [rows] bool on the device) go up from ``backup`` ([max_rows] pinned), which must not be
    reused before this step's copy ran."""
    if not discard:
        return valid_counts(sampled)
    host = backup[: int(sampled.shape[0])]
    host.zero_()
    for row, token in discard.items():
        host[row] = token
    return valid_counts(sampled, discard_mask, host.to(device, non_blocking=True))


@dataclass
class Capture:
    """One step's sampled tokens on their way to the host."""

    slot: int
    rows: int
    width: int
    req_ids: list[str]
    discard: set[int]
    event: Any = None  # torch.cuda.Event (None: copied synchronously, CPU tensors)


class CaptureRing:
    """The ring of pinned buffers for the sampled tokens of steps not read yet, and the token feed they go into."""

    def __init__(self, *, k: int, max_rows: int, device: Any) -> None:
        import torch

        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if cuda else None
        self.events = [torch.cuda.Event() if cuda else None for _ in range(RING_SLOTS)]
        self.ring = [torch.zeros((max_rows, k + 1), dtype=torch.int32, pin_memory=cuda) for _ in range(RING_SLOTS)]
        self.ring_np = [r.numpy() for r in self.ring]  # the same memory, read without torch's per-op overhead
        self.backups = [torch.zeros(max_rows, dtype=torch.int32, pin_memory=cuda) for _ in range(RING_SLOTS)]
        self.queue: list[Capture] = []
        self.last_req_ids: set[str] = set()
        self.next_slot = 0
        self.feed = TokenFeed()
        self.observer: DraftingObserver | None = None  # timing hook (``observe.py``): told each phase's wall time

    # ----------------------------------------------------------------- 1. capture (every step)
    def counts(self, sampled: Any, discard: dict[int, int], discard_mask: Any) -> tuple[Any, Any]:
        """``valid_counts`` for this step; ``discard`` = {row: its last context token}, ``discard_mask`` [rows]
        bool on the device. The backups go up from a pinned buffer of the slot the step's capture will use."""
        return discard_counts(sampled, discard, discard_mask, backup=self.backups[self.next_slot], device=self.device)

    def capture(self, sampled: Any, req_ids: Sequence[str], discard: set[int], *, requests: dict[str, Any]) -> None:
        """Start the copy of ``sampled`` [rows, w] (w <= k+1) and note the step's rows (runner: after sampling)."""
        return self._observed(PHASE_CAPTURE, self._capture, sampled, req_ids, discard, requests=requests)

    def _observed(self, phase: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``; with an observer (``observe.py``), its wall time told to it whether it returns or
        raises."""
        if self.observer is None:
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if self.observer is not None:
                self.observer.drafting_phase(phase, time.perf_counter() - t0)

    def _capture(self, sampled: Any, req_ids: Sequence[str], discard: set[int], *, requests: dict[str, Any]) -> None:
        import torch

        t0 = time.perf_counter()
        if len(self.queue) >= RING_SLOTS - 1:
            self._drain(upto=1)  # oldest first: its slot is reused next
        rows, width = int(sampled.shape[0]), int(sampled.shape[1])
        ids = list(req_ids[:rows])
        prev = self.last_req_ids
        for rid in ids:
            returning = rid not in prev and rid in self.feed.history
            if rid not in self.feed.history or returning:
                state = requests.get(rid)
                self.feed.admit(
                    rid,
                    getattr(state, "prompt_token_ids", None),
                    getattr(state, "output_token_ids", None),
                    returning=returning,
                )
        slot = self.next_slot
        self.next_slot = (slot + 1) % RING_SLOTS
        dst = self._slot_view(slot, rows, width)
        event = self.events[slot]
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())  # the runner's device is the current one
            with torch.cuda.stream(self.stream):
                dst.copy_(sampled, non_blocking=True)
                event.record(self.stream)
            sampled.record_stream(self.stream)
        else:
            dst.copy_(sampled)
        self.queue.append(Capture(slot, rows, width, ids, set(discard), event))
        self.last_req_ids = set(ids)
        self.feed.stats.captures += 1
        self.feed.stats.capture_seconds += time.perf_counter() - t0

    def _slot_view(self, slot: int, rows: int, width: int, ring: Sequence[Any] | None = None) -> Any:
        """Ring slot ``slot`` as a contiguous [rows, width] tensor (``ring``: the same slots as NumPy arrays, read
        without torch's per-op overhead). A [:rows, :width] slice would not be contiguous when width < k+1 (vLLM's
        k by batch size), and a device-to-host copy into a non-contiguous pinned tensor is not asynchronous: the
        capture then waited for the step's GPU work."""
        return (self.ring if ring is None else ring)[slot].reshape(-1)[: rows * width].reshape(rows, width)

    def _drain(self, upto: int | None = None) -> None:
        """Read captured steps in order (waiting for their copies) into the token feed."""
        count = len(self.queue) if upto is None else min(upto, len(self.queue))
        for cap in self.queue[:count]:
            self.feed.add(cap.req_ids, self._tokens(cap), cap.discard)
        del self.queue[:count]

    def _tokens(self, cap: Capture) -> np.ndarray:
        """A captured step's sampled tokens [rows, width] int32 (-1 = rejected), once its copy is done."""
        return self._observed(PHASE_TOKENS, self._read_tokens, cap)

    def _read_tokens(self, cap: Capture) -> np.ndarray:
        if cap.event is not None:
            t0 = time.perf_counter()
            with quick_reacquire():  # the drafting (and the GPU) must not wait a switch interval for the GIL after it
                cap.event.synchronize()
            self.feed.stats.wait_seconds += time.perf_counter() - t0
        return self._slot_view(cap.slot, cap.rows, cap.width, self.ring_np)
