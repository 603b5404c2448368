"""FULL CUDA graphs for narrow verify batches (``narrow_slots``): a second uniform query length beside vLLM's.

vLLM 0.26's V1 runner replays a decode batch from a FULL CUDA graph (attention inside, one launch) only when it is
*uniform* with ``uniform_decode_query_len = 1 + k`` tokens per request; any other batch runs as piecewise graphs
with eager attention between them, whose many launches keep the host busy long enough that it is often late with
the next step at mid-size batches. A narrow schedule (``slots.SlotBook.width`` = w < k) verifies ``w + 1`` tokens for
every request, so it is uniform too, but at a length vLLM neither captures nor dispatches. Three wrappers add that
length, each a pass-through for any engine that is not ours with narrow slots:

1. ``CudagraphDispatcher.initialize_cudagraph_keys`` (end): for every narrow width ``w`` (``narrow_slots``,
   ``high_mat_narrow_slots``, ``large_batch_narrow_slots``) and every request count
   ``r`` vLLM captures a uniform FULL graph for, a FULL key ``BatchDescriptor(num_tokens=(w + 1) * r, num_reqs=r,
   uniform=True)`` (a key differs from vLLM's by its tokens per request, so the two sets never collide). vLLM's
   capture loop (``capture_model``) and its memory profile capture every key.
2. ``CudagraphDispatcher.dispatch``: while the runner dispatches a narrow batch (``NARROW_Q`` set on the
   dispatcher), the key of the smallest captured ``r`` that holds its requests, FULL, if FULL is allowed and the key
   exists; otherwise the mixed-batch graphs vLLM would have used (piecewise).
3. ``GPUModelRunner._determine_batch_execution_and_padding``: a batch of ``num_reqs`` requests with exactly
   ``w + 1`` scheduled tokens each is dispatched as uniform, with ``NARROW_Q`` set; ``_warmup_and_capture`` of a
   narrow key runs vLLM's dummy batch with ``uniform_decode_query_len = w + 1`` (its requests, attention metadata and
   query length are then those of a narrow batch, as vLLM builds its own uniform ones).

Width 0 (``narrow_keys.PLAIN_WIDTH``, any mode of ours): a *plain* batch, one token per request (no draft verified:
a backed-off batch), gets the one-token uniform FULL graphs no speculation replays, instead of piecewise graphs
(thread mode) or a ragged graph padded to ``max_num_seqs`` requests (schedule mode).

The graphs are captured and replayed exactly as vLLM's own uniform ones, with a different query length: what
FlashAttention 3's scheduler metadata depends on (requests, max query length) is the same at capture and replay.
(vLLM's ``cudagraph_mode=FULL`` instead replays *mixed* batches from graphs captured for other shapes, whose scheduler
metadata then differs from the replayed batch's and can change outputs.) Version-checked by the source of the methods
wrapped (one row of ``patches.table`` per wrapper); anything unexpected: the start-up line says so, narrow batches run
piecewise (correct, only slower). Never imported by ``drafters/``; imports vLLM only inside the wrappers' makers.

The narrow keys and their dispatch rule (items 1-3): ``specdec.vllm_plugin.patches.narrow_keys``. Ragged batches
(requests of different lengths in one FULL graph): ``specdec.vllm_plugin.patches.ragged_keys``; the wrappers here
dispatch and capture them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import Any

from specdec.vllm_plugin.attrs import (
    NARROW_KEYS,
    NARROW_Q,
    RAGGED_DESC,
    RAGGED_HIT,
    RAGGED_KEYS,
    RAGGED_OK,
    RAGGED_PREFILL,
    RAGGED_Q,
)
from specdec.vllm_plugin.logs import LOGGER_NAME
from specdec.vllm_plugin.patches.common import sources_problem
from specdec.vllm_plugin.patches.graph_stats import GraphStats, dispatcher_stats
from specdec.vllm_plugin.patches.narrow_keys import (
    add_narrow_keys,
    narrow_descriptor,
    narrow_holds,
    narrow_query_len,
    narrow_widths,
    plain_request_limit,
)
from specdec.vllm_plugin.patches.ragged_keys import (
    add_ragged_keys,
    has_field,
    is_prefill_key,
    profile_ceiling,
    ragged_descriptor,
    ragged_family,
    ragged_key,
    ragged_prefill_tokens,
)
from specdec.vllm_plugin.settings import PLAIN_WIDTH, UNIFORM_PAST_LADDER_RAGGED

logger = logging.getLogger(LOGGER_NAME)

DISPATCHER_SOURCE = {  # method -> text its source must contain (the vLLM 0.26-0.32 code these wrappers assume)
    "initialize_cudagraph_keys": "self.add_cudagraph_key(",
    "dispatch": "_create_padded_batch_descriptor",
}
RUNNER_SOURCE = {
    "_determine_batch_execution_and_padding": "force_uniform_decode",
    "_warmup_and_capture": "uniform_decode=desc.uniform",
    "_dummy_run": "max_query_len = self.uniform_decode_query_len if uniform_decode",
}
MIB = 1 << 20


@contextlib.contextmanager
def _dispatching(dispatcher: Any, flag: str, value: Any) -> Iterator[None]:
    """While the runner classifies or captures one of our batches, the dispatcher knows it: ``NARROW_Q`` (a narrow
    batch's tokens per request) or ``RAGGED_DESC`` (a ragged batch's key); cleared after, whatever happens."""
    setattr(dispatcher, flag, value)
    try:
        yield
    finally:
        setattr(dispatcher, flag, None)


def dispatcher_problem(dispatcher_cls: Any) -> str:
    """'' if the dispatcher's methods are the ones the wrappers were written for and vLLM's graph types import."""
    problem = sources_problem(dispatcher_cls, DISPATCHER_SOURCE)
    if problem:
        return problem
    try:
        vllm_graph_types()
    except Exception as exc:  # noqa: BLE001 - another vLLM layout: no narrow graphs
        return f"vLLM's CUDAGraphMode or BatchDescriptor is not importable ({type(exc).__name__})"
    return ""


def runner_problem(runner_cls: Any) -> str:
    """'' if the runner's methods are the ones the narrow-graph wrappers were written for, else the reason."""
    return sources_problem(runner_cls, RUNNER_SOURCE)


def capture_problem(runner_cls: Any) -> str:
    """'' if the runner has ``capture_model`` (after which the added graphs' cost is logged)."""
    return "" if callable(getattr(runner_cls, "capture_model", None)) else "capture_model is missing"


def vllm_graph_types() -> tuple[Any, Any]:
    """vLLM's ``CUDAGraphMode`` and ``BatchDescriptor``."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    return CUDAGraphMode, BatchDescriptor


def _allowed_full(modes: Any, kwargs: dict[str, Any], has_lora: bool) -> bool:
    valid, invalid = kwargs.get("valid_modes"), kwargs.get("invalid_modes")
    allowed = set(valid or modes.valid_runtime_modes()) - set(invalid or ())
    return modes.FULL in allowed and not has_lora  # (not allowed: a warm-up's eager run, cascade attention)


def _without_full(modes: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with FULL among the invalid modes, unless nothing else would be allowed. vLLM's key for a
    non-uniform batch of T tokens, ``(T, min(T, max_num_seqs), uniform=False)``, is a ragged key from T = max_num_seqs
    on, so every non-uniform batch the runner did not classify as ragged (a prompt chunk longer than q) must not
    replay it."""
    valid, invalid = kwargs.get("valid_modes"), set(kwargs.get("invalid_modes") or ())
    if not set(valid or modes.valid_runtime_modes()) - invalid - {modes.FULL}:
        return kwargs
    return {**kwargs, "invalid_modes": invalid | {modes.FULL}}


def _add_keys(dispatcher: Any, cudagraph_mode: Any, q: int, *, modes: Any, descriptor: Any) -> None:
    """Our keys beside vLLM's (item 1 and the ragged keys), for our engine only."""
    setattr(dispatcher, NARROW_KEYS, {})
    setattr(dispatcher, RAGGED_KEYS, None)
    setattr(dispatcher, RAGGED_PREFILL, None)
    full_decode = cudagraph_mode.decode_mode() == modes.FULL and cudagraph_mode.separate_routine()
    if not full_decode:
        return
    ceiling = profile_ceiling(dispatcher, modes.FULL)
    widths = narrow_widths(dispatcher.vllm_config) if ceiling else ()
    if widths:
        counts = add_narrow_keys(
            dispatcher,
            widths,
            full_mode=modes.FULL,
            descriptor=descriptor,
            ceiling=ceiling,
            plain_past=plain_request_limit(dispatcher, ceiling),
        )
        logger.info(
            "specdec: full CUDA graphs for plain and narrow verify batches (%s tokens per request, %d batch "
            "sizes up to %d requests)",
            "/".join(str(w + 1) for w in widths),
            len(counts),
            counts[-1] if counts else 0,
        )
    ragged_ok = getattr(dispatcher, RAGGED_OK, False) and cudagraph_mode.mixed_mode() == modes.PIECEWISE
    prefill = ragged_prefill_tokens(dispatcher.vllm_config) if ragged_ok and q > 1 and ceiling else -1
    if prefill < 0:
        return
    stats = dispatcher_stats(dispatcher)
    n = stats.ragged_keys = add_ragged_keys(dispatcher, q, full_mode=modes.FULL, descriptor=descriptor, ceiling=ceiling)
    logger.info("specdec: full CUDA graphs for ragged verify batches (%d sizes, at most %d tokens per request)", n, q)
    if n and prefill > q and has_field(descriptor, "num_active_loras"):
        n = add_ragged_keys(
            dispatcher, prefill, full_mode=modes.FULL, descriptor=descriptor, ceiling=ceiling, prefill=True
        )
        stats.ragged_prefill_keys = n
        logger.info(
            "specdec: full CUDA graphs for ragged batches with prompt chunks (%d sizes, at most %d tokens per request)",
            n,
            prefill,
        )


def wrap_initialize_keys(orig_init: Any, dispatcher_cls: Any) -> Any:
    """``initialize_cudagraph_keys`` (end): our keys beside vLLM's (item 1)."""
    modes, descriptor = vllm_graph_types()

    def initialize_cudagraph_keys(
        self: Any, cudagraph_mode: Any, uniform_decode_query_len: int = 1, *args: Any, **kwargs: Any
    ) -> Any:
        out = orig_init(self, cudagraph_mode, uniform_decode_query_len, *args, **kwargs)
        _add_keys(self, cudagraph_mode, int(uniform_decode_query_len), modes=modes, descriptor=descriptor)
        return out

    return initialize_cudagraph_keys


def wrap_dispatch(orig_dispatch: Any, dispatcher_cls: Any) -> Any:
    """``dispatch``: a narrow or ragged batch gets its FULL key where one was captured (item 2)."""
    modes, descriptor = vllm_graph_types()

    def dispatch(
        self: Any, num_tokens: int, uniform_decode: bool = False, has_lora: bool = False, *args: Any, **kwargs: Any
    ) -> Any:
        ragged = getattr(self, RAGGED_DESC, None)
        if ragged is not None:  # a ragged batch (or the capture of a ragged key)
            tokens, reqs, q = ragged
            prefill = q != getattr(self, RAGGED_KEYS)[0]
            desc = ragged_descriptor(descriptor, tokens, reqs, prefill=prefill)
            stats = dispatcher_stats(self)
            if _allowed_full(modes, kwargs, has_lora) and desc in self.cudagraph_keys[modes.FULL]:
                if prefill:
                    stats.ragged_prefill_full += 1
                else:
                    stats.ragged_full += 1
                setattr(self, RAGGED_HIT, q)
                return modes.FULL, desc
            if kwargs.get("valid_modes") is None:  # (not a capture's eager warm-up)
                stats.ragged_piecewise += 1
            setattr(self, RAGGED_HIT, None)  # (a re-dispatch, e.g. data-parallel ranks agreeing on another mode)
            return orig_dispatch(self, num_tokens, False, has_lora, *args, **kwargs)
        if getattr(self, NARROW_Q, None) is None or not uniform_decode:
            if not uniform_decode and getattr(self, RAGGED_KEYS, None):
                kwargs = _without_full(modes, kwargs)  # vLLM's own lookup would find a ragged key: not its batch
            return orig_dispatch(self, num_tokens, uniform_decode, has_lora, *args, **kwargs)
        if _allowed_full(modes, kwargs, has_lora):
            desc = narrow_descriptor(self, num_tokens, descriptor=descriptor)
            stats = dispatcher_stats(self)
            if desc is not None and desc in self.cudagraph_keys[modes.FULL]:
                stats.narrow_full += 1
                stats.plain_full += getattr(self, NARROW_Q) == PLAIN_WIDTH + 1
                return modes.FULL, desc
            stats.narrow_piecewise += 1
        return orig_dispatch(self, num_tokens, False, has_lora, *args, **kwargs)  # vLLM's mixed-batch graphs

    return dispatch


def _classify(runner: Any, orig: Any, num_tokens: int, num_reqs: int, args: tuple, kwargs: dict[str, Any]) -> Any:
    """Items 3 and the ragged rule: how the runner dispatches a batch (vLLM's own call, told what we know)."""
    dispatcher = runner.cudagraph_dispatcher
    if getattr(dispatcher, NARROW_Q, None) is not None or kwargs.get("force_uniform_decode") is not None:
        return orig(runner, num_tokens, num_reqs, *args, **kwargs)  # a capture (or not ours to decide)
    max_query_len = int(kwargs.get("max_num_scheduled_tokens", args[1] if len(args) > 1 else 0))
    q = narrow_query_len(dispatcher, int(num_tokens), int(num_reqs), max_query_len)
    past_ladder = q is not None and UNIFORM_PAST_LADDER_RAGGED and not narrow_holds(dispatcher, q, int(num_reqs))
    key = ragged_key(dispatcher, int(num_tokens), int(num_reqs), max_query_len) if q is None or past_ladder else None
    if q is not None and key is None:  # narrow (or past its ladder with no ragged key either: as narrow)
        with _dispatching(dispatcher, NARROW_Q, q):
            return orig(runner, num_tokens, num_reqs, *args, force_uniform_decode=True, **kwargs)
    if key is None:
        return orig(runner, num_tokens, num_reqs, *args, **kwargs)
    with _dispatching(dispatcher, RAGGED_DESC, key):
        return orig(runner, num_tokens, num_reqs, *args, **kwargs)


def _is_ours(dispatcher: Any, desc: Any) -> bool:
    """``desc`` is one of the keys this plugin added (ragged or narrow), not one of vLLM's."""
    if ragged_family(dispatcher, desc) is not None:
        return True
    keys = getattr(dispatcher, NARROW_KEYS, None) or {}
    q = desc.num_tokens // desc.num_reqs if desc.uniform and desc.num_reqs else None
    return q in keys and q * desc.num_reqs == desc.num_tokens


@contextlib.contextmanager
def _measured_capture(stats: GraphStats) -> Iterator[None]:
    """Count one capture of our graphs: the device memory it took (free memory before minus after, so graph-pool
    blocks it reused count as nothing) and its seconds, into ``stats`` (the engine's)."""
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    free_before, t0 = torch.cuda.mem_get_info()[0] if cuda else 0, time.perf_counter()
    try:
        yield
    finally:
        if cuda:
            torch.cuda.synchronize()
            stats.added_graph_bytes += max(free_before - torch.cuda.mem_get_info()[0], 0)
        stats.added_graph_s += time.perf_counter() - t0
        stats.added_graphs_captured += 1


def log_added_graphs(stats: GraphStats) -> None:
    """Once per engine (``stats``: its counts), after vLLM captured its graphs: how many graphs the plugin added and
    what they cost."""
    if not stats.added_graphs_captured or stats.added_graphs_logged:
        return
    stats.added_graphs_logged = 1
    logger.info(
        "specdec: added %d CUDA graphs (narrow %d, ragged %d, ragged with prompt chunks %d): %.0f MiB of "
        "device memory and %.1f s to capture; vLLM's memory profile counts them before sizing the KV cache",
        stats.added_graphs_captured,
        stats.narrow_keys,
        stats.ragged_keys,
        stats.ragged_prefill_keys,
        stats.added_graph_bytes / MIB,
        stats.added_graph_s,
    )


@contextlib.contextmanager
def _query_len(runner: Any, q: int) -> Iterator[None]:
    """vLLM's dummy batches (captures) have ``q`` tokens per request meanwhile."""
    saved = runner.uniform_decode_query_len
    runner.uniform_decode_query_len = q
    try:
        yield
    finally:
        runner.uniform_decode_query_len = saved


def wrap_determine(orig_determine: Any, runner_cls: Any) -> Any:
    """``_determine_batch_execution_and_padding``: a narrow batch dispatched as uniform, a ragged one to its key
    (item 3); the runner keeps the max query length its attention metadata must state."""

    def _determine_batch_execution_and_padding(
        self: Any, num_tokens: int, num_reqs: int, *args: Any, **kwargs: Any
    ) -> Any:
        dispatcher = self.cudagraph_dispatcher
        setattr(dispatcher, RAGGED_HIT, None)
        out = _classify(self, orig_determine, num_tokens, num_reqs, args, kwargs)
        setattr(self, RAGGED_Q, getattr(dispatcher, RAGGED_HIT, None))  # what the attention metadata must state
        return out

    return _determine_batch_execution_and_padding


def wrap_capture_model(orig_capture_model: Any, runner_cls: Any) -> Any:
    """``capture_model`` (end): the added graphs' cost, logged once per engine (``log_added_graphs``)."""

    def capture_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig_capture_model(self, *args, **kwargs)
        log_added_graphs(dispatcher_stats(self.cudagraph_dispatcher))
        return out

    return capture_model


def wrap_warmup_and_capture(orig_capture: Any, runner_cls: Any) -> Any:
    """``_warmup_and_capture``: a key of ours is captured from vLLM's dummy batch at its query length (item 3),
    its cost measured."""

    def _warmup_and_capture(self: Any, desc: Any, *args: Any, **kwargs: Any) -> Any:
        if not _is_ours(self.cudagraph_dispatcher, desc):
            return _capture_ours(self, desc, args, kwargs)
        with _measured_capture(dispatcher_stats(self.cudagraph_dispatcher)):
            return _capture_ours(self, desc, args, kwargs)

    def _capture_ours(self: Any, desc: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        dispatcher = self.cudagraph_dispatcher
        family = ragged_family(dispatcher, desc)
        if family is not None:
            # vLLM's uniform dummy batch (cdiv(T, q) requests of q tokens), dispatched to the ragged key
            q = family[0]
            with _query_len(self, q), _dispatching(dispatcher, RAGGED_DESC, (desc.num_tokens, desc.num_reqs, q)):
                untagged = {"num_active_loras": 0} if is_prefill_key(desc) else {}
                return orig_capture(self, dataclasses.replace(desc, uniform=True, **untagged), *args, **kwargs)
        keys = getattr(dispatcher, NARROW_KEYS, None)
        q = desc.num_tokens // desc.num_reqs if keys and desc.uniform and desc.num_reqs else None
        if q not in (keys or {}) or q * desc.num_reqs != desc.num_tokens:
            return orig_capture(self, desc, *args, **kwargs)
        with _query_len(self, q), _dispatching(dispatcher, NARROW_Q, q):  # dummy: num_reqs requests of q tokens
            return orig_capture(self, desc, *args, **kwargs)

    return _warmup_and_capture
