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
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from specdec.config import ConfigBase, ConfigError, rng
from specdec.drafters.base import Drafter, DraftRequest
from specdec.tree import ROOT, TokenTree


HASH_BASE = 0x100000001B3  # odd multiplier of the rolling n-gram hash (mod 2**64)
MASK64 = (1 << 64) - 1


def window_hash(window: Sequence[int]) -> int:
    """sum_j window[j] * HASH_BASE ** (n - 1 - j) mod 2**64 (what the numpy build computes)."""
    h = 0
    for x in window:
        h = (h * HASH_BASE + x) & MASK64
    return h


def suffix_hashes(tokens: list[int], end: int, max_n: int) -> list[int]:
    """``out[n - 1]`` = window_hash(tokens[end - n + 1:end + 1]) for n = 1..max_n (one pass from the end)."""
    out = []
    h, mult = 0, 1
    for k in range(min(max_n, end + 1)):
        h = (h + tokens[end - k] * mult) & MASK64
        mult = (mult * HASH_BASE) & MASK64
        out.append(h)
    return out


class NgramIndex:
    """N-gram -> end positions over one growing token sequence, for several n.

    Per n: ``head[hash]`` = the most recent end position of an n-gram with that hash (``keep_all``) or the
    earliest one (not ``keep_all``: vLLM's rule), and with ``keep_all`` a ``prev`` chain linking each end
    position to the previous end of the same hash. The prompt is indexed with numpy (sort by hash), each
    appended token in O(#lengths); hash collisions are filtered by comparing the tokens.
    """

    def __init__(self, tokens: Sequence[int] | np.ndarray, lengths: Iterable[int], *, keep_all: bool) -> None:
        arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
        self.tokens: list[int] = arr.tolist()
        self.lengths = sorted(set(int(n) for n in lengths), reverse=True)  # longest first
        if not self.lengths or self.lengths[-1] < 1:
            raise ValueError(f"n-gram lengths {self.lengths} must be >= 1")
        self.keep_all = keep_all
        self.head: dict[int, dict[int, int]] = {}
        self.prev: dict[int, list[int]] = {}
        for n in self.lengths:
            self._build(arr, n)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def _build(self, arr: np.ndarray, n: int) -> None:
        size = arr.size - n + 1
        prev = [-1] * arr.size
        if size <= 0:
            self.head[n], self.prev[n] = {}, prev
            return
        u = arr.astype(np.uint64)
        h = np.zeros(size, np.uint64)  # [size] rolling hash of the window ending at n - 1 + i
        with np.errstate(over="ignore"):
            for j in range(n):
                h = h * np.uint64(HASH_BASE) + u[j:j + size]
        ends = np.arange(n - 1, arr.size, dtype=np.int64)
        order = np.argsort(h, kind="stable")  # groups equal hashes, ends ascending inside a group
        hs, es = h[order], ends[order]
        same = hs[1:] == hs[:-1]  # [size - 1] element i + 1 continues the group of element i
        if self.keep_all:
            prev_arr = np.full(arr.size, -1, np.int64)
            prev_arr[es[1:][same]] = es[:-1][same]
            prev = prev_arr.tolist()
            pick = np.append(~same, True)  # the last (most recent) end of each group
        else:
            pick = np.insert(~same, 0, True)  # the first (earliest) end of each group
        self.head[n] = dict(zip(hs[pick].tolist(), es[pick].tolist()))
        self.prev[n] = prev

    def extend(self, token_ids: Sequence[int] | np.ndarray) -> None:
        t = self.tokens
        toks = token_ids.tolist() if isinstance(token_ids, np.ndarray) else [int(x) for x in token_ids]
        max_n = self.lengths[0]
        for tok in toks:
            t.append(tok)
            end = len(t) - 1
            hashes = suffix_hashes(t, end, max_n)
            for n in self.lengths:
                prev = self.prev[n]
                if end + 1 < n:
                    prev.append(-1)
                    continue
                h = hashes[n - 1]
                head = self.head[n]
                if self.keep_all:
                    prev.append(head.get(h, -1))
                    head[h] = end
                else:
                    prev.append(-1)
                    head.setdefault(h, end)

    def longest_match(self, max_candidates: int | None = None) -> tuple[int, list[int]] | None:
        """(n, end positions of earlier occurrences of the last n tokens), longest n first.

        ``keep_all``: the most recent ``max_candidates`` (None: all) ends, most recent first; otherwise the
        earliest end only.
        """
        t = self.tokens
        last = len(t) - 1
        hashes = suffix_hashes(t, last, self.lengths[0]) if last >= 0 else []
        for n in self.lengths:
            if last < n:  # needs an earlier occurrence ending before `last`
                continue
            window = t[last - n + 1:]
            e = self.head[n].get(hashes[n - 1], -1)
            prev = self.prev[n]
            ends: list[int] = []
            while e >= 0:
                if e != last and t[e - n + 1:e + 1] == window:
                    ends.append(e)
                    if not self.keep_all or (max_candidates is not None and len(ends) >= max_candidates):
                        break
                e = prev[e] if self.keep_all else -1
            if ends:
                return n, ends
        return None

    def memory_bytes(self) -> int:
        per_entry = 100  # dict slot + int objects, approximate (CPython)
        return sys.getsizeof(self.tokens) + sum(len(m) * per_entry + len(self.prev[n]) * 8
                                                for n, m in self.head.items())


@dataclass(frozen=True)
class NgramConfig(ConfigBase):
    min_n: int = rng(2, lo=1, hi=64, doc="shortest n-gram matched")
    max_n: int = rng(8, lo=1, hi=64, doc="longest n-gram matched (longer matches are preferred)")
    max_candidates: int = rng(8, lo=1, hi=1024, doc="most recent occurrences that vote on the continuation")
    min_token_prob: float = rng(0.1, lo=0.0, hi=1.0, doc="stop a path below this path probability")

    def validate(self, *, where: str = "") -> None:
        super().validate(where=where)
        if self.min_n > self.max_n:
            raise ConfigError(f"{where}min_n={self.min_n} > max_n={self.max_n}; min_n must be <= max_n")


class NgramDrafter(Drafter):
    """Prompt lookup over the request's own context (see the module docstring)."""

    name = "ngram"
    Config = NgramConfig

    def __init__(self, config: NgramConfig | None = None, **overrides: Any) -> None:
        config = config or NgramConfig()
        if overrides:
            config = config.replace(**overrides)
        self.config = config
        self._index: dict[str, NgramIndex] = {}

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self._index[request_id] = NgramIndex(prompt_ids, range(self.config.min_n, self.config.max_n + 1),
                                             keep_all=True)

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        idx = self._index.get(request_id)
        if idx is None:
            raise KeyError(f"request {request_id!r} was never started (call start first)")
        idx.extend(token_ids)

    def stop(self, request_id: str) -> None:
        self._index.pop(request_id, None)

    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        out = []
        for req in requests:
            idx = self._index.get(req.request_id)
            hit = idx.longest_match(self.config.max_candidates) if idx is not None and req.budget > 0 else None
            if hit is None:
                out.append(TokenTree.empty())
                continue
            starts = [e + 1 for e in hit[1]]  # most recent first
            out.append(vote_tree(idx.tokens, starts, budget=req.budget, tree=req.tree,
                                 min_prob=self.config.min_token_prob))
        return out

    def active_requests(self) -> list[str]:
        return list(self._index)

    def memory_bytes(self) -> int:
        return sum(i.memory_bytes() for i in self._index.values())


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
