"""The drafter's size gauges: host memory of its state and the suffix drafter's global cache (size and caps).

They are read from the drafter itself, which only the thread that drives it may call (the native suffix engine
settles a pending lane step on any call), so ``ProposerCore`` samples them on that thread, between steps, at most
every ``SAMPLE_PERIOD_S``; the metrics endpoint reads the last sample.
"""

from __future__ import annotations

from typing import Any

SAMPLE_PERIOD_S = 1.0  # the global cache's byte count walks its cached responses: sampled, not read per step


def drafter_gauges(drafter: Any) -> dict[str, int]:
    """``memory_bytes`` of the drafter (every part of a composition) and, where a suffix drafter is among its parts,
    its global cache's responses, tokens, bytes and caps (``global_cache_*``)."""
    out = {"memory_bytes": int(drafter.memory_bytes())}
    for part in getattr(drafter, "drafters", None) or (drafter,):
        read = getattr(part, "global_stats", None)
        if not callable(read):
            continue
        stats = read()
        config = getattr(part, "config", None)
        out.update(
            global_cache_requests=int(stats["cached_requests"]),
            global_cache_tokens=int(stats["cached_tokens"]),
            global_cache_bytes=int(stats["bytes"]),
            global_cache_max_requests=int(getattr(config, "max_cached_requests", 0)),
            global_cache_max_tokens=int(getattr(config, "max_cached_tokens", 0)),
        )
        break
    return out
