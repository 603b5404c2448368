"""Non-blocking CPU<->GPU transfers for the drafting pipeline.

* ``DraftUploader``: drafts (lists of token ids, one per request row) -> a padded ``[n, k]`` int32 tensor
  on the GPU (what vLLM's async-scheduling path wants in ``runner._draft_token_ids``). Rows are written
  into a pinned host buffer and copied with ``non_blocking=True`` on a side stream; ``upload`` returns
  at once, and the consumer stream is made to wait on the copy's event (no host sync).
* ``SampledDownloader``: sampled token ids on the GPU -> a pinned host buffer, copied on a side stream
  after the producing stream's work; ``result()`` waits only on that copy's event (the wait releases
  the GIL, so drafting threads run meanwhile); ``ready()`` polls.

Both keep ``NUM_SLOTS`` host buffers in a ring, so a buffer is never rewritten while its copy may be in
flight or its result is still being read. Without CUDA (CPU tensors, CI) they degrade to plain
synchronous copies with identical results. This module imports torch lazily.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

PAD_ID = -1  # vLLM rejects draft id -1 unconditionally: a safe filler for short drafts
NUM_SLOTS = 2  # host buffers in the ring (double buffering)


def pad_drafts(drafts: Sequence[Sequence[int]], k: int, *, pad: int = PAD_ID,
               out: np.ndarray | None = None) -> np.ndarray:
    """[len(drafts), k] int32: each draft left-aligned, cut at ``k``, padded with ``pad``."""
    n = len(drafts)
    buf = np.empty((n, k), np.int32) if out is None else out[:n, :k]  # [n, k]
    buf.fill(pad)
    for i, d in enumerate(drafts):
        m = min(len(d), k)
        if m:
            buf[i, :m] = np.asarray(d[:m], dtype=np.int32)
    return buf


def _cuda_device(device: Any) -> bool:
    import torch

    return torch.device(device).type == "cuda" and torch.cuda.is_available()


class _Ring:
    """``NUM_SLOTS`` pinned (when CUDA) host buffers of shape [rows, cols] with a completion event each."""

    def __init__(self, rows: int, cols: int, *, dtype: Any, cuda: bool) -> None:
        import torch

        self.host = [torch.empty((rows, cols), dtype=dtype, pin_memory=cuda) for _ in range(NUM_SLOTS)]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(NUM_SLOTS)]
        self.next = 0

    def take(self) -> int:
        """The next slot, after its previous copy (if any) has completed."""
        slot = self.next
        self.next = (slot + 1) % NUM_SLOTS
        ev = self.events[slot]
        if ev is not None:
            ev.synchronize()  # normally long done: the ring is NUM_SLOTS steps deep
        return slot


class DraftUploader:
    """Drafts -> padded device tensor [n, k] via a pinned buffer and a side stream (see module doc)."""

    def __init__(self, max_rows: int, max_k: int, device: Any = "cpu", *, pad: int = PAD_ID) -> None:
        import torch

        if max_rows < 1 or max_k < 1:
            raise ValueError(f"max_rows={max_rows}, max_k={max_k}: both must be >= 1")
        self.max_rows, self.max_k, self.pad = max_rows, max_k, pad
        self.device = torch.device(device)
        self.cuda = _cuda_device(device)
        self.ring = _Ring(max_rows, max_k, dtype=torch.int32, cuda=self.cuda)
        self.dev = [torch.full((max_rows, max_k), pad, dtype=torch.int32, device=self.device)
                    for _ in range(NUM_SLOTS)]
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.last_slot: int | None = None

    def upload(self, drafts: Sequence[Sequence[int]], k: int | None = None) -> Any:
        """Start copying ``drafts`` to the device; returns the [n, k] device tensor (valid after ``wait``)."""
        import torch

        k = self.max_k if k is None else k
        if len(drafts) > self.max_rows or not 1 <= k <= self.max_k:
            raise ValueError(f"{len(drafts)} drafts with k={k} do not fit this uploader "
                             f"(max_rows={self.max_rows}, max_k={self.max_k}); build it larger")
        slot = self.ring.take()
        n = len(drafts)
        host, dev = self.ring.host[slot], self.dev[slot]
        pad_drafts(drafts, k, pad=self.pad, out=host.numpy())
        if self.stream is None:
            dev[:n, :k].copy_(host[:n, :k])
        else:
            # the device buffer may still be read by earlier work on the compute stream
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                dev[:n, :k].copy_(host[:n, :k], non_blocking=True)
                self.ring.events[slot].record(self.stream)
        self.last_slot = slot
        return dev[:n, :k]

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the current stream) wait for the last upload, without a host sync."""
        import torch

        if self.stream is None or self.last_slot is None:
            return
        target = stream if stream is not None else torch.cuda.current_stream(self.device)
        target.wait_event(self.ring.events[self.last_slot])


class SampledDownloader:
    """Sampled token ids (device, [n, w] int) -> pinned host, copied on a side stream (see module doc)."""

    def __init__(self, max_rows: int, width: int, device: Any = "cpu") -> None:
        import torch

        self.max_rows, self.width = max_rows, width
        self.device = torch.device(device)
        self.cuda = _cuda_device(device)
        self.ring = _Ring(max_rows, width, dtype=torch.int64, cuda=self.cuda)
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.pending: tuple[int, int, int] | None = None  # (slot, rows, cols)

    def start(self, ids: Any) -> None:
        """Queue the copy of ``ids`` [n, w'] (w' <= width) after the current stream's pending work."""
        import torch

        if ids.dim() != 2 or ids.shape[0] > self.max_rows or ids.shape[1] > self.width:
            raise ValueError(f"sampled ids of shape {tuple(ids.shape)} do not fit "
                             f"[max_rows={self.max_rows}, width={self.width}]; build the downloader larger")
        slot = self.ring.take()
        n, w = int(ids.shape[0]), int(ids.shape[1])
        host = self.ring.host[slot]
        if self.stream is None:
            host[:n, :w].copy_(ids)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                ids.record_stream(self.stream)  # keep the source alive until the copy ran
                host[:n, :w].copy_(ids, non_blocking=True)
                self.ring.events[slot].record(self.stream)
        self.pending = (slot, n, w)

    def ready(self) -> bool:
        if self.pending is None:
            return False
        ev = self.ring.events[self.pending[0]]
        return ev is None or bool(ev.query())

    def result(self) -> np.ndarray:
        """[n, w] int64 host copy of the last ``start`` (waits for that copy only)."""
        if self.pending is None:
            raise RuntimeError("SampledDownloader.result() called before start()")
        slot, n, w = self.pending
        ev = self.ring.events[slot]
        if ev is not None:
            ev.synchronize()
        return self.ring.host[slot][:n, :w].numpy().copy()


# ---------------------------------------------------------------------- GPU-side hedge lookup (async scheduling)
def pack_hedges(hedges: Sequence[dict[tuple[int, ...], Sequence[int]]], *, width: int, key_len: int,
                k: int, pad: int = PAD_ID) -> tuple[np.ndarray, np.ndarray]:
    """Pack per-row hedge tables ``{emitted tokens: next draft}`` into arrays for ``select_drafts``.

    Returns ``keys`` [n, width, key_len] int64 (each key left-aligned, padded with ``pad``; rows with fewer
    hedges get all-``pad`` keys that match nothing real) and ``drafts`` [n, width, k] int32. Keys longer
    than ``key_len`` and hedges past ``width`` are dropped (the first ``width`` in the dict's order kept).
    """
    n = len(hedges)
    keys = np.full((n, width, key_len), pad, np.int64)  # [n, H, L]
    drafts = np.full((n, width, k), pad, np.int32)  # [n, H, k]
    for i, table in enumerate(hedges):
        h = 0
        for key, draft in table.items():
            if h >= width:
                break
            if not 0 < len(key) <= key_len:
                continue
            keys[i, h, :len(key)] = key
            m = min(len(draft), k)
            drafts[i, h, :m] = np.asarray(draft[:m], np.int32)
            h += 1
    return keys, drafts


def select_drafts(sampled: Any, keys: Any, drafts: Any, *, pad: int = PAD_ID) -> tuple[Any, Any]:
    """On the device, pick each row's next draft from its hedges by the tokens the step emitted.

    ``sampled`` [n, L'] (vLLM's sampled ids: accepted + bonus, then ``pad``), ``keys`` [n, H, L],
    ``drafts`` [n, H, k]. A hedge matches when its key equals the row's emitted tokens exactly (padding
    included). Returns (``out`` [n, k] int32: the matching draft or all ``pad`` = no draft, ``hit`` [n] bool).
    No host synchronisation: usable between two forward passes under async scheduling.
    """
    import torch

    n, _, length = keys.shape
    s = sampled.to(keys.dtype)
    if s.shape[1] < length:  # [n, L]: pad the emitted ids to the key length
        s = torch.cat([s, s.new_full((n, length - s.shape[1]), pad)], dim=1)
    elif s.shape[1] > length:  # a longer emission than any key can only match if the tail is padding
        tail_pad = (s[:, length:] == pad).all(dim=1)
        s = torch.where(tail_pad[:, None], s[:, :length], s.new_full((n, length), pad - 1))
    match = (keys == s[:, None, :]).all(dim=2)  # [n, H]
    hit = match.any(dim=1)  # [n]
    idx = match.to(torch.int8).argmax(dim=1)  # [n] first matching hedge
    out = drafts[torch.arange(n, device=drafts.device), idx]  # [n, k]
    out = torch.where(hit[:, None], out, torch.full_like(out, pad))
    return out.to(torch.int32), hit
