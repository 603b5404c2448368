"""FULL CUDA graphs for narrow verify batches (``narrow_slots``): a second uniform query length beside vLLM's.

vLLM 0.26's V1 runner replays a decode batch from a FULL CUDA graph (attention inside, one launch) only when it is
*uniform* with ``uniform_decode_query_len = 1 + k`` tokens per request; any other batch runs as piecewise graphs
with eager attention between them, whose launches keep the host busy (GPU runs 76 and 84: the host came late in
81% of the steps at batch 32). A narrow schedule (``slots.SlotBook.width`` = w < k) verifies ``w + 1`` tokens for
every request, so it is uniform too, but at a length vLLM neither captures nor dispatches. Three wrappers add that
length, each a pass-through for any engine that is not ours with narrow slots:

1. ``CudagraphDispatcher.initialize_cudagraph_keys`` (end): for every narrow width ``w`` (``narrow_slots``,
   ``high_mat_narrow_slots``, ``large_batch_narrow_slots``, ``large_batch_high_mat_slots``) and every request count
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

The graphs are captured and replayed exactly as vLLM's own uniform ones, with a different query length: what
FlashAttention 3's scheduler metadata depends on (requests, max query length) is the same at capture and replay.
(vLLM's ``cudagraph_mode=FULL`` instead replays *mixed* batches from graphs captured for other shapes, which changed
outputs in run 18.) Version-checked by the source of the methods wrapped; anything unexpected: logged once, narrow
batches run piecewise (correct, only slower). Never imported by ``drafters/``; imports vLLM only inside the patch.

**Ragged batches** (``ragged_graphs``, schedule mode like the narrow graphs): requests with different draft
lengths, each at most ``q = k + 1`` tokens (per-request slots, steps without drafts). vLLM runs them as piecewise
graphs with eager attention. Where every attention backend supports full graphs of any batch (``AttentionCGSupport.ALWAYS``:
FlashAttention 3, Triton, Flex; checked by a wrapper on ``_check_and_update_cudagraph_mode``), one FULL key per
capture size ``T``: ``BatchDescriptor(num_tokens=T, num_reqs=max_num_seqs, uniform=False)`` (FULL_AND_PIECEWISE has
no other non-uniform FULL keys). Such a graph is captured from vLLM's uniform dummy batch (``cdiv(T, q)`` requests of
``q`` tokens, padded to ``max_num_seqs`` requests) and replayed for any batch of at most ``max_num_seqs`` requests and
``T`` tokens whose longest request has at most ``q``: ``_build_attention_metadata`` then states ``max_query_len = q``
(an upper bound, correct for varlen attention), so the kernel's launch choices that FlashAttention 3 derives from the
request count and the max query length (its scheduler metadata, split and GQA packing) are those of the capture, and
only the per-request lengths, read on the GPU, differ. vLLM's ``cudagraph_mode=FULL`` replays mixed batches with the
actual max query length from graphs captured with ``T`` (run 18: outputs changed); here the two agree by construction.

**Prefill-carrying ragged batches** (``ragged_prefill_tokens`` = P > q): a step that also carries prompt chunks of
at most P tokens each (short prompts joining a running batch: sustained load) gets a second family of FULL keys,
captured and replayed the same way with ``max_query_len = P`` (vLLM's uniform dummy of ``cdiv(T, P)`` requests of P
tokens). Its keys differ from the first family's by ``num_active_loras = PREFILL_TAG`` (vLLM's LoRA count, never
non-zero without LoRA; no keys where LoRA is configured); the capture hands vLLM the key without the tag. Without
them such steps run as piecewise graphs, whose launches the host could not keep up with on a slower host (run 142:
the GPU idled 7.0 ms before each of them at code batch 64, 1.5 ms before the ragged FULL steps).
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import inspect
import logging
from collections.abc import Iterator
from typing import Any

from specdec.vllm_plugin.logs import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)

_WRAPPED = "_specdec_wrapped"
NARROW_KEYS = "_specdec_narrow"  # dispatcher attribute: {query length: sorted request counts captured}
NARROW_Q = "_specdec_narrow_q"  # dispatcher attribute: query length of the batch being dispatched (None: vLLM's)
DISPATCHER_SOURCE = {  # method -> text its source must contain (the vLLM 0.26-0.32 code these wrappers assume)
    "initialize_cudagraph_keys": "self.add_cudagraph_key(",
    "dispatch": "_create_padded_batch_descriptor",
}
RUNNER_SOURCE = {
    "_determine_batch_execution_and_padding": "force_uniform_decode",
    "_warmup_and_capture": "uniform_decode=desc.uniform",
    "_dummy_run": "max_query_len = self.uniform_decode_query_len if uniform_decode",
}
RAGGED_SOURCE = {
    "_build_attention_metadata": "max_query_len=max_query_len",
    "_check_and_update_cudagraph_mode": "initialize_cudagraph_keys",
}
RAGGED_OK = "_specdec_ragged_ok"  # dispatcher attribute: every attention backend supports full graphs of any batch
RAGGED_KEYS = "_specdec_ragged"  # dispatcher attribute: (q, request count, sorted token counts) captured, or None
RAGGED_PREFILL = "_specdec_ragged_prefill"  # dispatcher attribute: the same for the prefill-carrying family, or None
PREFILL_TAG = 1  # num_active_loras of the prefill-carrying family's keys (vLLM's own keys have 0 without LoRA)
RAGGED_DESC = "_specdec_ragged_desc"  # dispatcher attribute: (tokens, requests, q) of the ragged key being dispatched
RAGGED_HIT = "_specdec_ragged_hit"  # dispatcher attribute: q when the last dispatch returned a ragged FULL key
RAGGED_Q = "_specdec_ragged_q"  # runner attribute: the max query length the attention metadata must state, or None
FULL_SUPPORT = "ALWAYS"  # AttentionCGSupport member a backend must report for ragged graphs
STATS = {"narrow_full": 0, "narrow_piecewise": 0, "narrow_keys": 0,  # this process's dispatches and keys
         "ragged_full": 0, "ragged_piecewise": 0, "ragged_keys": 0, "ragged_prefill_full": 0,
         "ragged_prefill_keys": 0}


def narrow_widths(vllm_config: Any) -> tuple[int, ...]:
    """Our engine's narrow widths (``SpecdecOptions.narrow_widths``), () for any other engine or setting."""
    from specdec.vllm_plugin.async_patch import _ours
    from specdec.vllm_plugin.options import options_from_vllm_config

    try:
        if not _ours(vllm_config):
            return ()
        return options_from_vllm_config(vllm_config).narrow_widths
    except Exception as exc:  # noqa: BLE001 - never fail an engine's start for an optimisation
        logger.debug("specdec: no narrow graphs (%r)", exc)
        return ()


def ragged_enabled(vllm_config: Any) -> bool:
    """Our engine with ``ragged_graphs`` on (False for any other engine or setting)."""
    return ragged_prefill_tokens(vllm_config) >= 0


def ragged_prefill_tokens(vllm_config: Any) -> int:
    """Our engine with ``ragged_graphs`` on: its ``ragged_prefill_tokens`` (0: no prefill-carrying family; also with
    LoRA); -1 for any other engine or setting."""
    from specdec.vllm_plugin.async_patch import _ours
    from specdec.vllm_plugin.options import options_from_vllm_config

    try:
        if not _ours(vllm_config):
            return -1
        opts = options_from_vllm_config(vllm_config)
        if not opts.ragged_graphs:
            return -1
        return 0 if getattr(vllm_config, "lora_config", None) else opts.ragged_prefill_tokens
    except Exception as exc:  # noqa: BLE001 - never fail an engine's start for an optimisation
        logger.debug("specdec: no ragged graphs (%r)", exc)
        return -1


def add_ragged_keys(dispatcher: Any, q: int, *, full_mode: Any, descriptor: Any, prefill: bool = False) -> int:
    """FULL keys for ragged batches: one per capture size up to the capture limit, for ``max_num_seqs`` requests;
    ``(q, requests, sizes)`` is stored on the dispatcher. Returns the number of keys. Sizes past ``max_num_seqs *
    q`` get none: vLLM's uniform dummy batch, which captures them, cannot hold more (a small ``max_num_seqs``: the
    engine's start-up failed on batch 8, GPU run 147). ``prefill``: the prefill-carrying family (``PREFILL_TAG``,
    stored as ``RAGGED_PREFILL``)."""
    cc = dispatcher.compilation_config
    reqs = int(dispatcher.vllm_config.scheduler_config.max_num_seqs)
    limit = min(cc.max_cudagraph_capture_size or 0, reqs * q)  # what the uniform dummy batch can hold
    sizes = sorted({int(t) for t in (cc.cudagraph_capture_sizes or ()) if 0 < int(t) <= limit})
    full = dispatcher.cudagraph_keys[full_mode]
    tag = PREFILL_TAG if prefill else 0
    for t in sizes:
        full.add(descriptor(num_tokens=t, num_reqs=reqs, uniform=False, num_active_loras=tag))
    setattr(dispatcher, RAGGED_PREFILL if prefill else RAGGED_KEYS, (q, reqs, sizes) if sizes else None)
    STATS["ragged_prefill_keys" if prefill else "ragged_keys"] = len(sizes)
    return len(sizes)


def ragged_ready() -> bool:
    """True once this process made ragged keys (the slot book, in the same process in schedule mode, then
    gives high-MAT steps per-request slots: ``high_mat_ragged``)."""
    return STATS["ragged_keys"] > 0


def ragged_key(dispatcher: Any, num_tokens: int, num_reqs: int, max_query_len: int) -> tuple[int, int, int] | None:
    """(tokens, requests, q) of the ragged key for a batch, or None where it takes another graph: vLLM's uniform
    batches (every request ``q`` tokens), a request longer than ``q`` (a prompt chunk) unless the prefill-carrying
    family's P holds it, more requests or tokens than captured."""
    keys = getattr(dispatcher, RAGGED_KEYS, None)
    if not keys or num_tokens < 1:
        return None
    q = keys[0]
    if max_query_len == q and num_tokens == q * num_reqs:
        return None  # vLLM's own uniform graphs
    if max_query_len > q:
        keys = getattr(dispatcher, RAGGED_PREFILL, None)
        if not keys or max_query_len > keys[0]:
            return None
    q, reqs, sizes = keys
    if num_reqs > reqs:
        return None
    i = bisect.bisect_left(sizes, num_tokens)
    return (sizes[i], reqs, q) if i < len(sizes) else None


def min_cudagraph_support(runner: Any, attention_backends: Any, kv_cache_groups: Any) -> str:
    """The lowest ``AttentionCGSupport`` name over the engine's attention backends (vLLM's own loop in
    ``_check_and_update_cudagraph_mode``); "" if none could be read."""
    lowest = None
    for backend_set, group in zip(attention_backends, kv_cache_groups):
        for backend in backend_set:
            support = backend.get_builder_cls().get_cudagraph_support(runner.vllm_config, group.kv_cache_spec)
            if lowest is None or support.value < lowest.value:
                lowest = support
    return getattr(lowest, "name", "")


def add_narrow_keys(dispatcher: Any, widths: tuple[int, ...], *, full_mode: Any, descriptor: Any) -> list[int]:
    """Item 1: FULL keys of query length ``w + 1`` for every width ``w`` and every request count of the
    dispatcher's uniform FULL keys (vLLM's). ``full_mode``: vLLM's ``CUDAGraphMode.FULL``; ``descriptor``: its
    ``BatchDescriptor``. Returns the request counts (sorted); {query length: counts} is stored on the dispatcher."""
    full = dispatcher.cudagraph_keys[full_mode]
    counts = sorted({d.num_reqs for d in full if d.uniform and not d.has_lora and d.num_reqs})
    keys = {w + 1: counts for w in widths} if counts else {}
    for q in keys:
        for r in counts:
            full.add(descriptor(num_tokens=q * r, num_reqs=r, uniform=True))
    setattr(dispatcher, NARROW_KEYS, keys)
    STATS["narrow_keys"] = len(counts) * len(keys)
    return counts


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


@contextlib.contextmanager
def _dispatching(dispatcher: Any, flag: str, value: Any) -> Iterator[None]:
    """While the runner classifies or captures one of our batches, the dispatcher knows it: ``NARROW_Q`` (a narrow
    batch's tokens per request) or ``RAGGED_DESC`` (a ragged batch's key); cleared after, whatever happens."""
    setattr(dispatcher, flag, value)
    try:
        yield
    finally:
        setattr(dispatcher, flag, None)


def _sources_ok(cls: Any, wanted: dict[str, str]) -> str:
    for name, text in wanted.items():
        fn = getattr(cls, name, None)
        try:
            ok = fn is not None and text in inspect.getsource(fn)
        except (OSError, TypeError):
            ok = False
        if not ok:
            return f"{cls.__name__}.{name} is not the one this patch was written for"
    return ""


def patch_narrow_graphs(runner_cls: Any, dispatcher_cls: Any) -> bool:
    """Install the wrappers (idempotent). Returns True if installed; False (logged) if vLLM's code differs. The
    ragged-batch wrappers need two more runner methods; where those differ only narrow graphs are installed."""
    problem = _sources_ok(dispatcher_cls, DISPATCHER_SOURCE) or _sources_ok(runner_cls, RUNNER_SOURCE)
    if problem:
        logger.warning("specdec: narrow_slots run without full CUDA graphs (%s)", problem)
        return False
    if getattr(dispatcher_cls.dispatch, _WRAPPED, False):
        return True
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    ragged_problem = _sources_ok(runner_cls, RAGGED_SOURCE)
    if ragged_problem:
        logger.warning("specdec: ragged verify batches run without full CUDA graphs (%s)", ragged_problem)
    _wrap_dispatcher(dispatcher_cls, CUDAGraphMode, BatchDescriptor)
    _wrap_runner(runner_cls, ragged=not ragged_problem)
    return True


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
    widths = narrow_widths(dispatcher.vllm_config)
    if widths:
        counts = add_narrow_keys(dispatcher, widths, full_mode=modes.FULL, descriptor=descriptor)
        logger.info("specdec: full CUDA graphs for narrow verify batches (%s tokens per request, %d batch "
                    "sizes up to %d requests)", "/".join(str(w + 1) for w in widths), len(counts),
                    counts[-1] if counts else 0)
    ragged_ok = getattr(dispatcher, RAGGED_OK, False) and cudagraph_mode.mixed_mode() == modes.PIECEWISE
    setattr(dispatcher, RAGGED_PREFILL, None)
    prefill = ragged_prefill_tokens(dispatcher.vllm_config) if ragged_ok and q > 1 else -1
    if prefill < 0:
        return
    n = add_ragged_keys(dispatcher, q, full_mode=modes.FULL, descriptor=descriptor)
    logger.info("specdec: full CUDA graphs for ragged verify batches (%d sizes, at most %d tokens per request)", n, q)
    if n and prefill > q and _has_field(descriptor, "num_active_loras"):
        n = add_ragged_keys(dispatcher, prefill, full_mode=modes.FULL, descriptor=descriptor, prefill=True)
        logger.info("specdec: full CUDA graphs for ragged batches with prompt chunks (%d sizes, at most %d tokens "
                    "per request)", n, prefill)


def _has_field(cls: Any, name: str) -> bool:
    return dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}


def _wrap_dispatcher(cls: Any, modes: Any, descriptor: Any) -> None:
    orig_init, orig_dispatch = cls.initialize_cudagraph_keys, cls.dispatch

    @functools.wraps(orig_init)
    def initialize_cudagraph_keys(self: Any, cudagraph_mode: Any, uniform_decode_query_len: int = 1,
                                  *args: Any, **kwargs: Any) -> Any:
        out = orig_init(self, cudagraph_mode, uniform_decode_query_len, *args, **kwargs)
        _add_keys(self, cudagraph_mode, int(uniform_decode_query_len), modes=modes, descriptor=descriptor)
        return out

    @functools.wraps(orig_dispatch)
    def dispatch(self: Any, num_tokens: int, uniform_decode: bool = False, has_lora: bool = False,
                 *args: Any, **kwargs: Any) -> Any:
        ragged = getattr(self, RAGGED_DESC, None)
        if ragged is not None:  # a ragged batch (or the capture of a ragged key)
            tokens, reqs, q = ragged
            prefill = q != getattr(self, RAGGED_KEYS)[0]
            desc = descriptor(num_tokens=tokens, num_reqs=reqs, uniform=False,
                              num_active_loras=PREFILL_TAG if prefill else 0)
            if _allowed_full(modes, kwargs, has_lora) and desc in self.cudagraph_keys[modes.FULL]:
                STATS["ragged_prefill_full" if prefill else "ragged_full"] += 1
                setattr(self, RAGGED_HIT, q)
                return modes.FULL, desc
            if kwargs.get("valid_modes") is None:  # (not a capture's eager warm-up)
                STATS["ragged_piecewise"] += 1
            setattr(self, RAGGED_HIT, None)  # (a re-dispatch, e.g. data-parallel ranks agreeing on another mode)
            return orig_dispatch(self, num_tokens, False, has_lora, *args, **kwargs)
        if getattr(self, NARROW_Q, None) is None or not uniform_decode:
            if not uniform_decode and getattr(self, RAGGED_KEYS, None):
                kwargs = _without_full(modes, kwargs)  # vLLM's own lookup would find a ragged key: not its batch
            return orig_dispatch(self, num_tokens, uniform_decode, has_lora, *args, **kwargs)
        if _allowed_full(modes, kwargs, has_lora):
            desc = narrow_descriptor(self, num_tokens, descriptor=descriptor)
            if desc is not None and desc in self.cudagraph_keys[modes.FULL]:
                STATS["narrow_full"] += 1
                return modes.FULL, desc
            STATS["narrow_piecewise"] += 1
        return orig_dispatch(self, num_tokens, False, has_lora, *args, **kwargs)  # vLLM's mixed-batch graphs

    for fn in (initialize_cudagraph_keys, dispatch):
        setattr(fn, _WRAPPED, True)
    cls.initialize_cudagraph_keys, cls.dispatch = initialize_cudagraph_keys, dispatch


def _classify(runner: Any, orig: Any, num_tokens: int, num_reqs: int, args: tuple, kwargs: dict[str, Any]) -> Any:
    """Items 3 and the ragged rule: how the runner dispatches a batch (vLLM's own call, told what we know)."""
    dispatcher = runner.cudagraph_dispatcher
    if getattr(dispatcher, NARROW_Q, None) is not None or kwargs.get("force_uniform_decode") is not None:
        return orig(runner, num_tokens, num_reqs, *args, **kwargs)  # a capture (or not ours to decide)
    max_query_len = int(kwargs.get("max_num_scheduled_tokens", args[1] if len(args) > 1 else 0))
    q = narrow_query_len(dispatcher, int(num_tokens), int(num_reqs), max_query_len)
    if q is not None:
        with _dispatching(dispatcher, NARROW_Q, q):
            return orig(runner, num_tokens, num_reqs, *args, force_uniform_decode=True, **kwargs)
    key = ragged_key(dispatcher, int(num_tokens), int(num_reqs), max_query_len)
    if key is None:
        return orig(runner, num_tokens, num_reqs, *args, **kwargs)
    with _dispatching(dispatcher, RAGGED_DESC, key):
        return orig(runner, num_tokens, num_reqs, *args, **kwargs)


def _ragged_family(dispatcher: Any, desc: Any) -> tuple[int, int, list[int]] | None:
    """The ragged family a key being captured belongs to (its ``(q, requests, sizes)``), or None."""
    if desc.uniform:
        return None
    tagged = getattr(desc, "num_active_loras", 0) == PREFILL_TAG
    family = getattr(dispatcher, RAGGED_PREFILL if tagged else RAGGED_KEYS, None)
    return family if family and desc.num_reqs == family[1] else None


@contextlib.contextmanager
def _query_len(runner: Any, q: int) -> Iterator[None]:
    """vLLM's dummy batches (captures) have ``q`` tokens per request meanwhile."""
    saved = runner.uniform_decode_query_len
    runner.uniform_decode_query_len = q
    try:
        yield
    finally:
        runner.uniform_decode_query_len = saved


def _wrap_runner(cls: Any, *, ragged: bool = True) -> None:
    orig_determine, orig_capture = cls._determine_batch_execution_and_padding, cls._warmup_and_capture

    @functools.wraps(orig_determine)
    def _determine_batch_execution_and_padding(self: Any, num_tokens: int, num_reqs: int, *args: Any,
                                               **kwargs: Any) -> Any:
        dispatcher = self.cudagraph_dispatcher
        setattr(dispatcher, RAGGED_HIT, None)
        out = _classify(self, orig_determine, num_tokens, num_reqs, args, kwargs)
        setattr(self, RAGGED_Q, getattr(dispatcher, RAGGED_HIT, None))  # what the attention metadata must state
        return out

    @functools.wraps(orig_capture)
    def _warmup_and_capture(self: Any, desc: Any, *args: Any, **kwargs: Any) -> Any:
        dispatcher = self.cudagraph_dispatcher
        family = _ragged_family(dispatcher, desc)
        if family is not None:
            # vLLM's uniform dummy batch (cdiv(T, q) requests of q tokens), dispatched to the ragged key
            q = family[0]
            with _query_len(self, q), _dispatching(dispatcher, RAGGED_DESC, (desc.num_tokens, desc.num_reqs, q)):
                return orig_capture(self, dataclasses.replace(desc, uniform=True, num_active_loras=0), *args,
                                    **kwargs)
        keys = getattr(dispatcher, NARROW_KEYS, None)
        q = desc.num_tokens // desc.num_reqs if keys and desc.uniform and desc.num_reqs else None
        if q not in (keys or {}) or q * desc.num_reqs != desc.num_tokens:
            return orig_capture(self, desc, *args, **kwargs)
        with _query_len(self, q), _dispatching(dispatcher, NARROW_Q, q):  # dummy: num_reqs requests of q tokens
            return orig_capture(self, desc, *args, **kwargs)

    wrapped = [("_determine_batch_execution_and_padding", _determine_batch_execution_and_padding),
               ("_warmup_and_capture", _warmup_and_capture)]
    if ragged:
        wrapped += _ragged_runner_wrappers(cls)
    for name, fn in wrapped:
        setattr(fn, _WRAPPED, True)
        setattr(cls, name, fn)


def _ragged_runner_wrappers(cls: Any) -> list[tuple[str, Any]]:
    """The attention metadata of a ragged FULL replay states the captured max query length; the dispatcher learns
    whether every attention backend supports full graphs of any batch before it makes its keys."""
    orig_build, orig_check = cls._build_attention_metadata, cls._check_and_update_cudagraph_mode

    @functools.wraps(orig_build)
    def _build_attention_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
        q = getattr(self, RAGGED_Q, None)
        if q is not None and "max_query_len" in kwargs:
            kwargs["max_query_len"] = max(int(kwargs["max_query_len"]), q)
        return orig_build(self, *args, **kwargs)

    @functools.wraps(orig_check)
    def _check_and_update_cudagraph_mode(self: Any, attention_backends: Any, kv_cache_groups: Any,
                                         *args: Any, **kwargs: Any) -> Any:
        try:
            support = min_cudagraph_support(self, attention_backends, kv_cache_groups)
        except Exception as exc:  # noqa: BLE001 - never fail an engine's start for an optimisation
            logger.debug("specdec: attention backends' CUDA graph support unknown (%r)", exc)
            support = ""
        setattr(self.cudagraph_dispatcher, RAGGED_OK, support == FULL_SUPPORT)
        return orig_check(self, attention_backends, kv_cache_groups, *args, **kwargs)

    return [("_build_attention_metadata", _build_attention_metadata),
            ("_check_and_update_cudagraph_mode", _check_and_update_cudagraph_mode)]
