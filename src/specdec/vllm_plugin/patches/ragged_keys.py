"""Keys, dispatch rule and runner wrappers of the ragged FULL CUDA graphs (``ragged_graphs``); ``graphs.py`` installs
them beside the narrow ones and counts their use.

**Ragged batches** (``ragged_graphs``, schedule mode like the narrow graphs): requests with different draft
lengths, each at most ``q = k + 1`` tokens (per-request slots, steps without drafts). vLLM runs them as piecewise
graphs with eager attention. Where every attention backend supports full graphs of any batch
(``AttentionCGSupport.ALWAYS``: FlashAttention 3, Triton, Flex; checked by a wrapper on
``_check_and_update_cudagraph_mode``), one FULL key per
capture size ``T``: ``BatchDescriptor(num_tokens=T, num_reqs=max_num_seqs, uniform=False)`` (FULL_AND_PIECEWISE has
no other non-uniform FULL keys). Such a graph is captured from vLLM's uniform dummy batch (``cdiv(T, q)`` requests of
``q`` tokens, padded to ``max_num_seqs`` requests) and replayed for any batch of at most ``max_num_seqs`` requests and
``T`` tokens whose longest request has at most ``q``: ``_build_attention_metadata`` then states ``max_query_len = q``
(an upper bound, correct for varlen attention), so the kernel's launch choices that FlashAttention 3 derives from the
request count and the max query length (its scheduler metadata, split and GQA packing) are those of the capture, and
only the per-request lengths, read on the GPU, differ. vLLM's ``cudagraph_mode=FULL`` replays mixed batches with the
actual max query length from graphs captured with ``T``, so capture and replay can disagree and outputs change; here
the two agree by construction.

**Prefill-carrying ragged batches** (``ragged_prefill_tokens`` = P > q): a step that also carries prompt chunks of
at most P tokens each (short prompts joining a running batch: sustained load) gets a second family of FULL keys,
captured and replayed the same way with ``max_query_len = P`` (vLLM's uniform dummy of ``cdiv(T, P)`` requests of P
tokens). Its keys differ from the first family's by ``num_active_loras = PREFILL_TAG`` (vLLM's LoRA count, never
non-zero without LoRA; no keys where LoRA is configured); the capture hands vLLM the key without the tag. Without
them such steps run as piecewise graphs, whose many launches a slower host cannot issue as fast as the GPU runs
them: the GPU idles before each such step, several times longer than before a step replayed from one FULL graph.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from typing import Any

from specdec.vllm_plugin.attrs import RAGGED_KEYS, RAGGED_OK, RAGGED_PREFILL, RAGGED_Q
from specdec.vllm_plugin.logs import LOGGER_NAME
from specdec.vllm_plugin.patches.common import sources_problem
from specdec.vllm_plugin.settings import engine_settings

logger = logging.getLogger(LOGGER_NAME)

RAGGED_SOURCE = {
    "_build_attention_metadata": "max_query_len=max_query_len",
    "_check_and_update_cudagraph_mode": "initialize_cudagraph_keys",
}
PREFILL_TAG = 1  # num_active_loras of the prefill-carrying family's keys (vLLM's own keys have 0 without LoRA)
FULL_SUPPORT = "ALWAYS"  # AttentionCGSupport member a backend must report for ragged graphs
GRAPH_LADDER_RATIO = 1.25  # consecutive sizes of our extra graphs differ by >= 25%: few graphs (start-up time and
# memory), and a replay pads a batch by less than a quarter of its tokens


def ragged_prefill_tokens(vllm_config: Any) -> int:
    """Our engine with ``ragged_graphs`` on: its ``ragged_prefill_tokens`` (0: no prefill-carrying family; also with
    LoRA); -1 for any other engine or setting (``EngineSettings.ragged_prefill_tokens``)."""
    try:
        settings = engine_settings(vllm_config)
        return settings.ragged_prefill_tokens if settings is not None else -1
    except Exception as exc:  # noqa: BLE001 - never fail an engine's start for an optimisation
        logger.debug("specdec: no ragged graphs (%r)", exc)
        return -1


def sparse_ladder(sizes: list[int], *, ratio: float = GRAPH_LADDER_RATIO) -> list[int]:
    """A subset of ascending ``sizes``: the smallest, then each next the smallest size at least ``ratio`` times the
    last kept one, and always the largest (so every size up to it still finds a key, padded by less than ``ratio``)."""
    kept: list[int] = []
    for size in sizes:
        if not kept or size >= kept[-1] * ratio:
            kept.append(size)
    if sizes and kept[-1] != sizes[-1]:
        kept.append(sizes[-1])
    return kept


def profile_ceiling(dispatcher: Any, full_mode: Any) -> int:
    """Our FULL keys stay below vLLM's second-largest FULL key (in tokens). vLLM's start-up memory profile captures
    the two largest FULL keys and charges every other FULL key the second one's cost; with one of ours among those
    two its one-time buffers were charged to every graph (hundreds of GiB for a few GiB of real graphs, and no room
    left for the KV cache). 0 (no keys of ours) when vLLM has fewer than two FULL keys."""
    tokens = sorted({int(d.num_tokens) for d in dispatcher.cudagraph_keys[full_mode]}, reverse=True)
    return tokens[1] if len(tokens) > 1 else 0


def add_ragged_keys(
    dispatcher: Any, q: int, *, full_mode: Any, descriptor: Any, ceiling: int, prefill: bool = False
) -> int:
    """FULL keys for ragged batches: a sparse ladder of capture sizes (``sparse_ladder``) below ``ceiling``
    (``profile_ceiling``) and the capture limit, for ``max_num_seqs`` requests; ``(q, requests, sizes)`` is stored on
    the dispatcher. Returns the number of keys. Sizes past ``max_num_seqs * q`` get none: vLLM's uniform dummy batch,
    which captures them, cannot hold more (with a small ``max_num_seqs`` the engine would fail to start).
    ``prefill``: the prefill-carrying family (``PREFILL_TAG``, stored as ``RAGGED_PREFILL``)."""
    cc = dispatcher.compilation_config
    reqs = int(dispatcher.vllm_config.scheduler_config.max_num_seqs)
    limit = min(cc.max_cudagraph_capture_size or 0, reqs * q, ceiling - 1)  # what the uniform dummy can hold
    sizes = sparse_ladder(sorted({int(t) for t in (cc.cudagraph_capture_sizes or ()) if 0 < int(t) <= limit}))
    full = dispatcher.cudagraph_keys[full_mode]
    for t in sizes:
        full.add(ragged_descriptor(descriptor, t, reqs, prefill=prefill))
    setattr(dispatcher, RAGGED_PREFILL if prefill else RAGGED_KEYS, (q, reqs, sizes) if sizes else None)
    return len(sizes)


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


def ragged_descriptor(descriptor: Any, num_tokens: int, num_reqs: int, *, prefill: bool) -> Any:
    """The key of a ragged graph; the prefill-carrying family's is tagged (only there: older descriptors lack the
    field)."""
    tagged = {"num_active_loras": PREFILL_TAG} if prefill else {}
    return descriptor(num_tokens=num_tokens, num_reqs=num_reqs, uniform=False, **tagged)


def is_prefill_key(desc: Any) -> bool:
    """``desc`` is a key of the prefill-carrying family."""
    return getattr(desc, "num_active_loras", 0) == PREFILL_TAG


def has_field(cls: Any, name: str) -> bool:
    """``cls`` is a dataclass with a field ``name`` (vLLM's ``BatchDescriptor`` and ``num_active_loras``)."""
    return dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}


def ragged_family(dispatcher: Any, desc: Any) -> tuple[int, int, list[int]] | None:
    """The ragged family a key being captured belongs to (its ``(q, requests, sizes)``), or None."""
    if desc.uniform:
        return None
    family = getattr(dispatcher, RAGGED_PREFILL if is_prefill_key(desc) else RAGGED_KEYS, None)
    return family if family and desc.num_reqs == family[1] else None


def ragged_problem(runner_cls: Any) -> str:
    """'' if the two runner methods the ragged wrappers need are the ones they were written for, else the reason."""
    return sources_problem(runner_cls, RAGGED_SOURCE)


def wrap_build_metadata(orig_build: Any, runner_cls: Any) -> Any:
    """``_build_attention_metadata``: the attention metadata of a ragged FULL replay states the captured max query
    length."""

    def _build_attention_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
        q = getattr(self, RAGGED_Q, None)
        if q is not None and "max_query_len" in kwargs:
            kwargs["max_query_len"] = max(int(kwargs["max_query_len"]), q)
        return orig_build(self, *args, **kwargs)

    return _build_attention_metadata


def wrap_check_mode(orig_check: Any, runner_cls: Any) -> Any:
    """``_check_and_update_cudagraph_mode``: the dispatcher learns whether every attention backend supports full
    graphs of any batch before it makes its keys."""

    def _check_and_update_cudagraph_mode(
        self: Any, attention_backends: Any, kv_cache_groups: Any, *args: Any, **kwargs: Any
    ) -> Any:
        try:
            support = min_cudagraph_support(self, attention_backends, kv_cache_groups)
        except Exception as exc:  # noqa: BLE001 - never fail an engine's start for an optimisation
            logger.debug("specdec: attention backends' CUDA graph support unknown (%r)", exc)
            support = ""
        setattr(self.cudagraph_dispatcher, RAGGED_OK, support == FULL_SUPPORT)
        return orig_check(self, attention_backends, kv_cache_groups, *args, **kwargs)

    return _check_and_update_cudagraph_mode
