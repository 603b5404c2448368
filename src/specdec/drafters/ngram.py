"""N-gram / prompt-lookup drafter: continue the context the way its earlier occurrences continued.

``NgramIndex`` keeps, per request and per n in the configured lengths, a hash index from each n-gram of
the context to the positions where it ends (all of them, or only the earliest for vLLM's rule). The
index is built once per prompt (C-speed tuple zips) and updated in O(#lengths) per appended token, so a
lookup costs O(#lengths) dictionary probes regardless of the context length.

``NgramDrafter``: the longest n whose last-n tokens occurred earlier wins; its most recent
``max_candidates`` occurrences vote on the continuation. A chain follows the majority at each depth
(ties: the most recent occurrence); a tree expands best-first by path probability, where a node's
probability is the share of the candidates that reach its parent and continue with its token, so
disagreeing occurrences become sibling branches. Paths stop under ``min_token_prob``.
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from specdec.config import ConfigBase, ConfigError, rng
from specdec.drafters.base import Drafter, DraftRequest
from specdec.drafters.base import token_ids as checked_ids
from specdec.tree import ROOT, TokenTree

NUMPY_BUILD_MIN = 2048  # prompts at least this long are indexed with numpy
HASH_BASE = 0x100000001B3  # odd multiplier of the numpy build's window hash (grouping only; keys are tuples)


class NgramIndex:
    """N-gram -> end positions over one growing token sequence, for several n.

    Per n: ``head[ngram]`` (a tuple of n token ids) = the most recent end position of that n-gram
    (``keep_all``) or its earliest one (not ``keep_all``: vLLM's rule), and with ``keep_all`` a ``prev``
    chain linking each end position to the previous end of the same n-gram. The prompt is indexed with
    numpy (exact grouping of all windows), each appended token in O(#lengths) dict operations.
    """

    def __init__(self, tokens: Sequence[int] | np.ndarray, lengths: Iterable[int], *, keep_all: bool) -> None:
        arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
        self.tokens: list[int] = arr.tolist()
        self.lengths = sorted(set(int(n) for n in lengths), reverse=True)  # longest first
        if not self.lengths or self.lengths[-1] < 1:
            raise ValueError(f"n-gram lengths {self.lengths} must be >= 1")
        self.keep_all = keep_all
        self.head: dict[int, dict[tuple[int, ...], int]] = {}
        self.prev: dict[int, list[int]] = {}
        for n in self.lengths:
            self._build(arr, n)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def _build(self, arr: np.ndarray, n: int) -> None:
        size = arr.size - n + 1
        if size <= 0:
            self.head[n], self.prev[n] = {}, [-1] * arr.size
            return
        if arr.size < NUMPY_BUILD_MIN:
            self._build_small(n)
            return
        windows = np.lib.stride_tricks.sliding_window_view(arr, n)  # [size, n] window ending at n - 1 + i
        h = np.zeros(size, np.uint64)  # [size] polynomial hash of each window (mod 2**64)
        with np.errstate(over="ignore"):
            for j in range(n):
                h = h * np.uint64(HASH_BASE) + arr[j : j + size].astype(np.uint64)
        order = np.argsort(h, kind="stable")  # equal windows together, ends ascending inside each
        gs, starts = h[order], order
        same = gs[1:] == gs[:-1]  # [size - 1] element i + 1 continues the n-gram of element i
        if same.any() and not np.array_equal(windows[starts[:-1][same]], windows[starts[1:][same]]):
            self._build_small(n)  # a hash collision (~never): take the exact loop
            return
        ends = starts + (n - 1)
        prev_arr = np.full(arr.size, -1, np.int64)
        if self.keep_all:
            prev_arr[ends[1:][same]] = ends[:-1][same]
            pick = np.append(~same, True)  # the last (most recent) end of each n-gram
        else:
            pick = np.insert(~same, 0, True)  # the first (earliest) end of each n-gram
        keys = map(tuple, windows[starts[pick]].tolist())
        self.head[n] = dict(zip(keys, ends[pick].tolist()))
        self.prev[n] = prev_arr.tolist()

    def _build_small(self, n: int) -> None:
        """Short prompts: a plain loop beats numpy's per-call overhead."""
        t = self.tokens
        head: dict[tuple[int, ...], int] = {}
        prev = [-1] * len(t)
        for i, key in enumerate(zip(*(t[j : len(t) - n + 1 + j] for j in range(n)))):
            end = i + n - 1
            if self.keep_all:
                prev[end] = head.get(key, -1)
                head[key] = end
            else:
                head.setdefault(key, end)
        self.head[n], self.prev[n] = head, prev

    def extend(self, token_ids: Sequence[int] | np.ndarray) -> None:
        t = self.tokens
        toks = token_ids.tolist() if isinstance(token_ids, np.ndarray) else [int(x) for x in token_ids]
        for tok in toks:
            t.append(tok)
            end = len(t) - 1
            for n in self.lengths:
                prev = self.prev[n]
                if end + 1 < n:
                    prev.append(-1)
                    continue
                key = tuple(t[end - n + 1 :])
                head = self.head[n]
                if self.keep_all:
                    prev.append(head.get(key, -1))
                    head[key] = end
                else:
                    prev.append(-1)
                    head.setdefault(key, end)

    def longest_match(self, max_candidates: int | None = None) -> tuple[int, list[int]] | None:
        """(n, end positions of earlier occurrences of the last n tokens), longest n first.

        ``keep_all``: the most recent ``max_candidates`` (None: all) ends, most recent first; otherwise the
        earliest end only.
        """
        t = self.tokens
        last = len(t) - 1
        for n in self.lengths:
            if last < n:  # needs an earlier occurrence ending before `last`
                continue
            e = self.head[n].get(tuple(t[last - n + 1 :]), -1)
            if e < 0:
                continue
            if not self.keep_all:
                if e != last:
                    return n, [e]
                continue
            prev = self.prev[n]
            if e == last:
                e = prev[e]
            ends: list[int] = []
            while e >= 0 and (max_candidates is None or len(ends) < max_candidates):
                ends.append(e)
                e = prev[e]
            if ends:
                return n, ends
        return None

    def memory_bytes(self) -> int:
        per_entry = 100  # dict slot + int objects, approximate (CPython)
        return sys.getsizeof(self.tokens) + sum(
            len(m) * per_entry + len(self.prev[n]) * 8 for n, m in self.head.items()
        )


def check_n_range(config: Any, where: str) -> None:
    """Shared check of n-gram configs: ``min_n <= max_n``."""
    if config.min_n > config.max_n:
        raise ConfigError(f"{where}min_n={config.min_n} > max_n={config.max_n}; min_n must be <= max_n")


@dataclass(frozen=True)
class NgramConfig(ConfigBase):
    min_n: int = rng(2, lo=1, hi=64, doc="shortest n-gram matched")
    max_n: int = rng(8, lo=1, hi=64, doc="longest n-gram matched (longer matches are preferred)")
    max_candidates: int = rng(8, lo=1, hi=1024, doc="most recent occurrences that vote on the continuation")
    min_token_prob: float = rng(0.1, lo=0.0, hi=1.0, doc="stop a path below this path probability")

    def validate(self, *, where: str = "") -> None:
        super().validate(where=where)
        check_n_range(self, where)


class IndexedNgramDrafter(Drafter):
    """Request lifecycle over one ``NgramIndex`` per request (shared by ``ngram`` and the ``vllm-ngram`` peer).

    Subclasses set ``Config`` (with ``min_n``/``max_n``), ``keep_all`` (keep every occurrence, or only the
    first) and implement ``draft_batch``.
    """

    keep_all = True

    def __init__(self, config: Any = None, **overrides: Any) -> None:
        config = config or self.Config()  # type: ignore[attr-defined]
        if overrides:
            config = config.replace(**overrides)
        self.config = config
        self._index: dict[str, NgramIndex] = {}

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self._index[request_id] = NgramIndex(
            checked_ids(prompt_ids), range(self.config.min_n, self.config.max_n + 1), keep_all=self.keep_all
        )

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        idx = self._index.get(request_id)
        if idx is None:
            raise KeyError(f"request {request_id!r} was never started (call start first)")
        idx.extend(checked_ids(token_ids))

    def stop(self, request_id: str) -> None:
        self._index.pop(request_id, None)

    def active_requests(self) -> list[str]:
        return list(self._index)

    def memory_bytes(self) -> int:
        return sum(i.memory_bytes() for i in self._index.values())


class NgramDrafter(IndexedNgramDrafter):
    """Prompt lookup over the request's own context (see the module docstring)."""

    name = "ngram"
    Config = NgramConfig
    keep_all = True

    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        out = []
        for req in requests:
            idx = self._index.get(req.request_id)
            hit = idx.longest_match(self.config.max_candidates) if idx is not None and req.budget > 0 else None
            if hit is None:
                out.append(TokenTree.empty())
                continue
            starts = [e + 1 for e in hit[1]]  # most recent first
            out.append(
                vote_tree(idx.tokens, starts, budget=req.budget, tree=req.tree, min_prob=self.config.min_token_prob)
            )
        return out


def _groups(tokens: list[int], starts: list[int], depth: int) -> list[tuple[int, list[int]]]:
    """Candidates grouped by their token at ``depth`` (order of first appearance = recency)."""
    groups: dict[int, list[int]] = {}
    end = len(tokens)
    for s in starts:
        if s + depth < end:
            groups.setdefault(tokens[s + depth], []).append(s)
    return list(groups.items())


def vote_tree(tokens: list[int], starts: list[int], *, budget: int, tree: bool, min_prob: float) -> TokenTree:
    """Draft from the continuations at ``starts`` (most recent first): majority chain or best-first tree."""
    out_tok: list[int] = []
    out_par: list[int] = []
    out_prob: list[float] = []
    heap: list[tuple[float, int, float, int, int, int, list[int]]] = []  # (-path, seq, q, tok, parent, depth, cands)
    seq = 0

    def push(cands: list[int], depth: int, path: float, parent: int) -> None:
        nonlocal seq
        groups = _groups(tokens, cands, depth)
        total = sum(len(g) for _, g in groups)
        if tree:
            chosen = groups
        else:  # chain: the majority (first = most recent among equals)
            chosen = [max(groups, key=lambda g: len(g[1]))] if groups else []
        for tok, group in chosen:
            q = len(group) / total
            if path * q >= min_prob:
                heapq.heappush(heap, (-path * q, seq, q, tok, parent, depth, group))
                seq += 1

    push(starts, 0, 1.0, ROOT)
    while heap and len(out_tok) < budget:
        neg, _, q, tok, parent, depth, group = heapq.heappop(heap)
        node = len(out_tok)
        out_tok.append(tok)
        out_par.append(parent)
        out_prob.append(q)
        push(group, depth + 1, -neg, node)
    if not out_tok:
        return TokenTree.empty()
    return TokenTree(np.asarray(out_tok, np.int64), np.asarray(out_par, np.int32), np.asarray(out_prob, np.float32))
