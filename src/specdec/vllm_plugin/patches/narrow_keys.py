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
from specdec.vllm_plugin.logs import LOGGER_NAME
from specdec.vllm_plugin.patches.graph_stats import dispatcher_stats
from specdec.vllm_plugin.patches.ragged_keys import sparse_ladder
from specdec.vllm_plugin.settings import PLAIN_WIDTH, engine_settings

logger = logging.getLogger(LOGGER_NAME)

# A plain (one-token) batch pads to its FULL graph's request count as no speculation's graphs pad it (vLLM's default
# ladder without speculation): every count up to 4 in powers of two, then every PLAIN_STEP requests up to
# PLAIN_WIDE_FROM, then every PLAIN_WIDE_STEP up to PLAIN_DENSE_UPTO. The narrow widths' sparser ladder
# (ragged_keys.GRAPH_LADDER_RATIO apart) would run a plain batch on up to that many times its rows, more than no
# speculation does, and a plain step's GPU time grows with its rows; every step of a backed-off batch is plain.
# Past PLAIN_DENSE_UPTO (where no speculation has no graphs) the sparse ladder.
PLAIN_SMALL = (1, 2, 4)
PLAIN_STEP = 8
PLAIN_WIDE_FROM = 256
PLAIN_WIDE_STEP = 16
PLAIN_DENSE_UPTO = 512


def narrow_widths(vllm_config: Any) -> tuple[int, ...]:
    """The widths our engine gets uniform FULL keys for (``EngineSettings.graph_widths``: plain, then schedule
    mode's narrow ones); () for any other engine."""
    try:
        settings = engine_settings(vllm_config)
        return settings.graph_widths if settings is not None else ()
    except Exception as exc:  # noqa: BLE001 - never fail an engine's start for an optimisation
        logger.debug("specdec: no narrow graphs (%r)", exc)
        return ()


def add_narrow_keys(
    dispatcher: Any, widths: tuple[int, ...], *, full_mode: Any, descriptor: Any, ceiling: int, plain_past: int
) -> list[int]:
    """Item 1: FULL keys of query length ``w + 1`` for every width ``w`` and a sparse ladder of the request counts
    of the dispatcher's uniform FULL keys (vLLM's), each below ``ceiling`` tokens (``profile_ceiling``). The plain
    width gets no speculation's ladder instead (``plain_ladder``), up to ``plain_past`` requests
    (``plain_request_limit``; vLLM's largest count where that is more), so every plain batch up to it finds a key.
    ``full_mode``: vLLM's ``CUDAGraphMode.FULL``; ``descriptor``: its ``BatchDescriptor``. Returns the request
    counts (sorted); {query length: counts} is stored on the dispatcher."""
    full = dispatcher.cudagraph_keys[full_mode]
    all_counts = sorted({d.num_reqs for d in full if d.uniform and not d.has_lora and d.num_reqs})
    keys = {}
    for w in widths:
        fits = [r for r in all_counts if (w + 1) * r < ceiling]
        if w == PLAIN_WIDTH and fits:  # no speculation's padding, up to vLLM's largest count or plain_past
            counts = plain_ladder(max(fits[-1], min(plain_past, ceiling - 1)))
        else:
            counts = sparse_ladder(fits)
        if counts:
            keys[w + 1] = counts
    for q, counts in keys.items():
        for r in counts:
            full.add(descriptor(num_tokens=q * r, num_reqs=r, uniform=True))
    setattr(dispatcher, NARROW_KEYS, keys)
    dispatcher_stats(dispatcher).narrow_keys = sum(len(c) for c in keys.values())
    return sorted({r for c in keys.values() for r in c})


def plain_ladder(largest: int) -> list[int]:
    """The request counts of the plain FULL graphs, up to ``largest`` (always kept): no speculation's ladder
    (``PLAIN_SMALL``, ``PLAIN_STEP``, ``PLAIN_WIDE_STEP``) up to ``PLAIN_DENSE_UPTO``, then the sparse ladder
    (``sparse_ladder``) of every ``PLAIN_WIDE_STEP`` requests."""
    dense = [
        *PLAIN_SMALL,
        *range(PLAIN_STEP, PLAIN_WIDE_FROM, PLAIN_STEP),
        *range(PLAIN_WIDE_FROM, PLAIN_DENSE_UPTO + 1, PLAIN_WIDE_STEP),
    ]
    counts = [r for r in dense if r < largest]
    if largest <= 0 or not counts:
        return [largest] if largest > 0 else []
    past = range(PLAIN_DENSE_UPTO + PLAIN_WIDE_STEP, largest, PLAIN_WIDE_STEP)
    return [*counts, *sparse_ladder([counts[-1], *past, largest])[1:]]


def plain_request_limit(dispatcher: Any, ceiling: int) -> int:
    """The most requests a plain (one-token) FULL graph may hold: vLLM's ``max_num_seqs``, the capture limit and
    ``ceiling`` (``profile_ceiling``) bound it. Plain steps of more requests than vLLM's largest uniform speculative
    graph (its k + 1 tokens a request: 64 requests at k = 16) get one-token FULL graphs up to it, as no speculation
    has; vLLM's piecewise graphs otherwise (a loaded server whose drafts are withheld: docs/results.md)."""
    reqs = int(dispatcher.vllm_config.scheduler_config.max_num_seqs)
    return min(reqs, int(dispatcher.compilation_config.max_cudagraph_capture_size or 0), ceiling - 1)


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


def narrow_holds(dispatcher: Any, q: int, num_reqs: int) -> bool:
    """Whether a FULL key of query length ``q`` holds ``num_reqs`` requests (its largest captured count)."""
    counts = getattr(dispatcher, NARROW_KEYS, {}).get(q)
    return bool(counts) and num_reqs <= counts[-1]


def narrow_query_len(dispatcher: Any, num_tokens: int, num_reqs: int, max_query_len: int) -> int | None:
    """Item 3: ``max_query_len`` if the batch is narrow (every request exactly that many tokens, a captured narrow
    length), else None."""
    keys = getattr(dispatcher, NARROW_KEYS, None)
    if not keys or max_query_len not in keys or num_tokens != max_query_len * num_reqs:
        return None
    return max_query_len
