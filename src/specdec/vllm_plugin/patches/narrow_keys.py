"""Keys and dispatch rule of the FULL CUDA graphs for narrow verify batches (``narrow_slots``); ``graphs.py``
installs them (its wrappers call these) and its module docstring describes items 1-3.

A narrow batch verifies ``w + 1`` tokens for each of its ``r`` requests; its key is
``BatchDescriptor(num_tokens=(w + 1) * r, num_reqs=r, uniform=True)``, one per narrow width ``w`` and per request
count of vLLM's uniform FULL keys (a sparse ladder of them). The dispatcher holds the keys made (``NARROW_KEYS``)
and, while the runner dispatches or captures a narrow batch, its query length (``NARROW_Q``).
"""

from __future__ import annotations

import bisect
import logging
from typing import Any

from specdec.vllm_plugin.attrs import NARROW_KEYS, NARROW_Q
from specdec.vllm_plugin.entry.options import options_from_vllm_config
from specdec.vllm_plugin.logs import LOGGER_NAME
from specdec.vllm_plugin.modes.slots import narrow_widths as policy_narrow_widths
from specdec.vllm_plugin.patches.async_sched import is_our_config, is_schedule_config
from specdec.vllm_plugin.patches.graph_stats import dispatcher_stats
from specdec.vllm_plugin.patches.ragged_keys import sparse_ladder

logger = logging.getLogger(LOGGER_NAME)

# A step that verifies no draft (every request backed off, or none has one) schedules one token per request: with a
# speculative config vLLM's uniform key is k + 1 tokens per request, so such a step would run piecewise graphs (thread
# mode) or a ragged graph padded to max_num_seqs requests (schedule mode), dearer than no speculation's decode step.
# Width 0 gives it the uniform one-token FULL graphs no speculation replays.
PLAIN_WIDTH = 0
PLAIN_GRAPHS = True


def narrow_widths(vllm_config: Any) -> tuple[int, ...]:
    """The widths our engine gets uniform FULL keys for: ``PLAIN_WIDTH`` (any mode, while ``PLAIN_GRAPHS``), then
    in schedule mode the narrow widths (``modes.slots.narrow_widths``); () for any other engine."""
    try:
        if not is_our_config(vllm_config):
            return ()
        plain = (PLAIN_WIDTH,) if PLAIN_GRAPHS else ()
        if not is_schedule_config(vllm_config):
            return plain
        return plain + policy_narrow_widths(options_from_vllm_config(vllm_config))
    except Exception as exc:  # noqa: BLE001 - never fail an engine's start for an optimisation
        logger.debug("specdec: no narrow graphs (%r)", exc)
        return ()


def add_narrow_keys(
    dispatcher: Any, widths: tuple[int, ...], *, full_mode: Any, descriptor: Any, ceiling: int
) -> list[int]:
    """Item 1: FULL keys of query length ``w + 1`` for every width ``w`` and a sparse ladder of the request counts
    of the dispatcher's uniform FULL keys (vLLM's), each below ``ceiling`` tokens (``profile_ceiling``).
    ``full_mode``: vLLM's ``CUDAGraphMode.FULL``; ``descriptor``: its ``BatchDescriptor``. Returns the request
    counts (sorted); {query length: counts} is stored on the dispatcher."""
    full = dispatcher.cudagraph_keys[full_mode]
    all_counts = sorted({d.num_reqs for d in full if d.uniform and not d.has_lora and d.num_reqs})
    keys = {}
    for w in widths:
        counts = sparse_ladder([r for r in all_counts if (w + 1) * r < ceiling])
        if counts:
            keys[w + 1] = counts
    for q, counts in keys.items():
        for r in counts:
            full.add(descriptor(num_tokens=q * r, num_reqs=r, uniform=True))
    setattr(dispatcher, NARROW_KEYS, keys)
    dispatcher_stats(dispatcher).narrow_keys = sum(len(c) for c in keys.values())
    return sorted({r for c in keys.values() for r in c})


def narrow_descriptor(dispatcher: Any, num_tokens: int, *, descriptor: Any) -> Any:
    """Item 2: the captured key for a narrow batch of ``num_tokens`` (its query length from ``NARROW_Q``), or None
    when none holds it (more requests than the largest graph)."""
    q = getattr(dispatcher, NARROW_Q, None)
    counts = getattr(dispatcher, NARROW_KEYS, {}).get(q)
    if not counts:
        return None
    i = bisect.bisect_left(counts, -(-num_tokens // q))  # requests, rounded up to a captured count
    if i == len(counts):
        return None
    r = counts[i]
    return descriptor(num_tokens=q * r, num_reqs=r, uniform=True)


def narrow_query_len(dispatcher: Any, num_tokens: int, num_reqs: int, max_query_len: int) -> int | None:
    """Item 3: ``max_query_len`` if the batch is narrow (every request exactly that many tokens, a captured narrow
    length), else None."""
    keys = getattr(dispatcher, NARROW_KEYS, None)
    if not keys or max_query_len not in keys or num_tokens != max_query_len * num_reqs:
        return None
    return max_query_len
