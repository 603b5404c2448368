"""Backend timing: ``time_decode_step`` (used by the benchmark) and ``pick_backend`` (``backend: auto``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from specdec.drafters.model_backends import DraftBackend, StepInput, make_backend

logger = logging.getLogger("specdec.drafters.model")

CALIB_PROMPT_LEN = 64  # context tokens before the timed decode steps
CALIB_BATCH = 1


def time_decode_step(
    backend: DraftBackend, *, batch: int, prompt_len: int, steps: int, warmup: int = 2, seed: int = 0
) -> list[float]:
    """Seconds per single-token decode step for ``batch`` requests after a ``prompt_len`` prefill.

    Each step feeds one token per request and reads its logits (what a chain draft does per token).
    """
    rng = np.random.default_rng(seed)
    vocab = min(backend.vocab_size, 1000)
    states = [backend.new_state() for _ in range(batch)]
    prompts = rng.integers(2, vocab, size=(batch, prompt_len))  # [batch, prompt_len]
    backend.forward(
        [StepInput(s, p.tolist(), list(range(prompt_len)), [prompt_len - 1]) for s, p in zip(states, prompts)]
    )
    times = []
    for i in range(warmup + steps):
        toks = rng.integers(2, vocab, size=batch)  # [batch]
        pos = prompt_len + i
        t0 = time.perf_counter()
        backend.forward([StepInput(s, [int(t)], [pos], [0]) for s, t in zip(states, toks)])
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    for s in states:
        backend.release(s)
    return times


def pick_backend(
    path: str | Path, candidates: Sequence[str], *, steps: int, onnx_spin: bool = False, threads: int = 0
) -> DraftBackend:
    """Build every available candidate, time a few decode steps, keep the fastest."""
    best: tuple[float, DraftBackend] | None = None
    report = []
    for name in candidates:
        t0 = time.perf_counter()
        try:
            backend = make_backend(name, path, onnx_spin=onnx_spin, threads=threads)
            ms = 1e3 * float(
                np.median(time_decode_step(backend, batch=CALIB_BATCH, prompt_len=CALIB_PROMPT_LEN, steps=steps))
            )
        except Exception as exc:  # noqa: BLE001 - an unavailable backend is skipped, not fatal
            report.append(f"{name}: unavailable ({type(exc).__name__}: {str(exc)[:100]})")
            continue
        report.append(f"{name}: {ms:.3f} ms/step (setup {time.perf_counter() - t0:.1f} s)")
        if best is None or ms < best[0]:
            best = (ms, backend)
    if best is None:
        raise RuntimeError("no draft-model backend could be built: " + "; ".join(report))
    logger.info(
        "draft model backend=auto picked %s (batch %d decode step): %s", best[1].name, CALIB_BATCH, "; ".join(report)
    )
    return best[1]
