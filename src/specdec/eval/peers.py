"""Benchmark-only peer drafters behind our ``Drafter`` interface (never used for serving).

* ``arctic``: ArcticInference 0.1.1 ``SuffixDecodingCache`` (the library behind vLLM's ``method: suffix``).
  Install with ``bash scripts/install_arctic.sh``. Defaults = vLLM's suffix defaults used in
  ``../shared/data/ANCHORS.md``: depth 24, 10,000 cached requests, max_spec_factor 1.0, min_token_prob 0.1.
  ``speculate`` gets the last ``max_depth`` context tokens; Arctic's per-node probabilities are path
  probabilities, converted here to P(token | parent path) for ``TokenTree.probs``.
* ``vllm-ngram``: vLLM's prompt-lookup rule, own code: the longest n in [min_n, max_n] whose last-n
  tokens occurred earlier in the context; the EARLIEST such occurrence; the up to k tokens after it
  (truncated at the end of the context). k = min(budget, num_speculative_tokens or budget).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from specdec.config import ConfigBase, rng
from specdec.drafters.base import Drafter, DraftRequest
from specdec.drafters.ngram import IndexedNgramDrafter, check_n_range
from specdec.tree import TokenTree

ARCTIC_INSTALL_HINT = "install the peer with `bash scripts/install_arctic.sh` (ArcticInference 0.1.1)"


@dataclass(frozen=True)
class ArcticConfig(ConfigBase):
    max_depth: int = rng(24, lo=2, hi=4096, doc="SuffixDecodingCache max_tree_depth")
    max_cached_requests: int = rng(10_000, lo=-1, hi=2**31 - 1, doc="-1: unbounded, 0: no global cache")
    max_spec_factor: float = rng(1.0, lo=0.0, hi=1000.0, doc="draft <= match_len * factor + offset")
    max_spec_offset: float = rng(0.0, lo=-1000.0, hi=1000.0, doc="see max_spec_factor")
    min_token_prob: float = rng(0.1, lo=0.0, hi=1.0, doc="stop below this path probability")


class ArcticDrafter(Drafter):
    """ArcticInference's SuffixDecodingCache as a Drafter (chain or tree drafts)."""

    name = "arctic"
    Config = ArcticConfig
    draft_options = frozenset(("max_spec_factor", "max_spec_offset", "min_token_prob"))

    def __init__(self, config: ArcticConfig | None = None, **overrides: Any) -> None:
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError as exc:
            raise ImportError(f"drafter 'arctic' needs arctic_inference: {ARCTIC_INSTALL_HINT}") from exc
        config = config or ArcticConfig()
        if overrides:
            config = config.replace(**overrides)
        self.config = config
        self.cache = SuffixDecodingCache(
            max_tree_depth=config.max_depth, max_cached_requests=config.max_cached_requests
        )
        self._context: dict[str, list[int]] = {}  # request -> its last tokens (>= max_depth kept)

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        if request_id in self._context:
            self.stop(request_id)
        prompt = np.ascontiguousarray(prompt_ids, dtype=np.int32)
        self.cache.start_request(request_id, prompt)
        self._context[request_id] = prompt[-self.config.max_depth :].tolist()

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        ctx = self._context.get(request_id)
        if ctx is None:
            raise KeyError(f"request {request_id!r} was never started (call start first)")
        if not len(token_ids):
            return
        toks = token_ids.tolist() if isinstance(token_ids, np.ndarray) else [int(t) for t in token_ids]
        self.cache.add_active_response(request_id, toks)
        ctx.extend(toks)
        depth = self.config.max_depth
        if len(ctx) > 4 * depth:
            del ctx[:-depth]

    def stop(self, request_id: str) -> None:
        if self._context.pop(request_id, None) is not None:
            self.cache.stop_request(request_id)

    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        c = self.config
        out = []
        for req in requests:
            ctx = self._context.get(req.request_id)
            if ctx is None or req.budget <= 0:
                out.append(TokenTree.empty())
                continue
            d = self.cache.speculate(
                req.request_id,
                ctx[-c.max_depth :],
                max_spec_tokens=req.budget,
                max_spec_factor=c.max_spec_factor,
                max_spec_offset=c.max_spec_offset,
                min_token_prob=c.min_token_prob,
                use_tree_spec=req.tree,
            )
            out.append(_arctic_tree(d.token_ids, d.parents, d.probs))
        return out

    def active_requests(self) -> list[str]:
        return list(self._context)

    def memory_bytes(self) -> int:
        try:
            return int(self.cache._global_tree.estimate_memory())
        except Exception:  # noqa: BLE001 - optional introspection of the peer
            return 0


def _arctic_tree(tokens: list[int], parents: list[int], path_probs: list[float]) -> TokenTree:
    """Arctic's draft as a TokenTree; its path probabilities become P(token | parent path).

    Plain Python on these short lists (cheaper than numpy), so the peer pays no extra wrapper cost.
    """
    n = len(tokens)
    if not n:
        return TokenTree.empty()
    cond = [
        min(1.0, max(0.0, pp / path_probs[par] if par >= 0 and path_probs[par] > 0 else pp))
        for pp, par in zip(path_probs, parents)
    ]
    if parents == list(range(-1, n - 1)):  # a chain: the same fast path as ours
        return TokenTree.chain(tokens, cond)
    # Arctic emits parents in topological order: built like our trees, without re-validation
    return TokenTree._trusted(np.asarray(tokens, np.int64), np.asarray(parents, np.int32), np.asarray(cond, np.float32))


@dataclass(frozen=True)
class VllmNgramConfig(ConfigBase):
    min_n: int = rng(2, lo=1, hi=64, doc="prompt_lookup_min")
    max_n: int = rng(4, lo=1, hi=64, doc="prompt_lookup_max")
    num_speculative_tokens: int = rng(0, lo=0, hi=4096, doc="k; 0: the step's budget")

    def validate(self, *, where: str = "") -> None:
        super().validate(where=where)
        check_n_range(self, where)


class VllmNgramDrafter(IndexedNgramDrafter):
    """vLLM's n-gram proposer rule (longest n, earliest occurrence, k tokens), chains only."""

    name = "vllm-ngram"
    Config = VllmNgramConfig
    keep_all = False

    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        out = []
        for req in requests:
            idx = self._index.get(req.request_id)
            k = min(req.budget, self.config.num_speculative_tokens or req.budget)
            if idx is None or k <= 0:
                out.append(TokenTree.empty())
                continue
            hit = idx.longest_match()
            if hit is None:
                out.append(TokenTree.empty())
                continue
            _n, ends = hit
            start = ends[0] + 1  # earliest occurrence
            toks = idx.tokens[start : min(start + k, idx.length)]
            out.append(TokenTree.chain(toks, np.ones(len(toks), np.float32)) if len(toks) else TokenTree.empty())
        return out
