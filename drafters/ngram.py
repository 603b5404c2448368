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


class NgramIndex:
    """N-gram -> end positions (ascending) over one growing token sequence."""

    def __init__(self, tokens: Sequence[int] | np.ndarray, lengths: Iterable[int], *, keep_all: bool) -> None:
        self.tokens: list[int] = np.asarray(tokens, dtype=np.int64).tolist()
        self.lengths = sorted(set(int(n) for n in lengths), reverse=True)  # longest first
        self.keep_all = keep_all
        self.maps: dict[int, dict[tuple[int, ...], Any]] = {n: self._build(n) for n in self.lengths}

    @property
    def length(self) -> int:
        return len(self.tokens)

    def _build(self, n: int) -> dict[tuple[int, ...], Any]:
        t = self.tokens
        keys = list(zip(*(t[j:len(t) - n + 1 + j] for j in range(n)))) if len(t) >= n else []
        ends = range(n - 1, len(t))
        if not self.keep_all:
            return dict(zip(reversed(keys), reversed(ends)))  # later writes win: the earliest end stays
        out: dict[tuple[int, ...], list[int]] = {}
        for key, end in zip(keys, ends):
            lst = out.get(key)
            if lst is None:
                out[key] = [end]
            else:
                lst.append(end)
        return out

    def extend(self, token_ids: Sequence[int] | np.ndarray) -> None:
        t = self.tokens
        toks = token_ids.tolist() if isinstance(token_ids, np.ndarray) else [int(x) for x in token_ids]
        for tok in toks:
            t.append(tok)
            end = len(t) - 1
            for n in self.lengths:
                if end + 1 < n:
                    continue
                key = tuple(t[end - n + 1:])
                m = self.maps[n]
                if self.keep_all:
                    lst = m.get(key)
                    if lst is None:
                        m[key] = [end]
                    else:
                        lst.append(end)
                elif key not in m:
                    m[key] = end

    def longest_match(self) -> tuple[int, list[int]] | None:
        """(n, end positions of the earlier occurrences of the last n tokens, ascending), longest n first."""
        t = self.tokens
        last = len(t) - 1
        for n in self.lengths:
            if last < n:  # needs an earlier occurrence ending before `last`
                continue
            hit = self.maps[n].get(tuple(t[last - n + 1:]))
            if hit is None:
                continue
            if self.keep_all:
                ends = hit[:-1] if hit[-1] == last else hit
                if ends:
                    return n, ends
            elif hit != last:
                return n, [hit]
        return None

    def memory_bytes(self) -> int:
        per_entry = 120 if self.keep_all else 90  # tuple key + dict slot (+ list) in CPython, approximate
        return sys.getsizeof(self.tokens) + sum(len(m) for m in self.maps.values()) * per_entry


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
            hit = idx.longest_match() if idx is not None and req.budget > 0 else None
            if hit is None:
                out.append(TokenTree.empty())
                continue
            starts = [e + 1 for e in reversed(hit[1][-self.config.max_candidates:])]  # most recent first
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
