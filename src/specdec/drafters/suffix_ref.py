"""Pure-Python reference engine of the suffix drafter (the native core in csrc/suffix_native.cpp mirrors it).

A bounded-depth suffix trie counts every substring of length <= ``depth`` of the sequences inserted:
``count[node]`` = occurrences of the node's token path, ``total[node]`` = sum of its children's counts,
so ``P(child | node) = count[child] / total[node]`` ignores occurrences with no continuation (the end
of the live context itself). One trie per active request (prompt + output so far) and one global trie
over the responses of finished requests, evicted oldest first past ``max_cached_requests`` or
``max_cached_tokens``. Each request keeps a frontier (the nodes of its last ``depth - 1`` suffixes), so
appending a token costs O(depth) dictionary lookups and drafting needs no search from the root.

Drafting (per trie, then the better of the request's and the global trie): for each match length m
(longest first) take the frontier node of the last m tokens, grow a chain (most frequent child) or a
tree (best-first by path probability) while the path probability stays >= ``min_prob``, at most
``budget`` nodes and ``floor(m * factor + offset)`` deep; score = sum of path probabilities (expected
accepted tokens); the strictly best score wins (ties: longer match, then the request's own trie).
Every tie-break (child order newest first, heap FIFO) matches the native core exactly.
"""

from __future__ import annotations

import heapq
import math
import sys
from collections import deque
from collections.abc import Sequence

from specdec.drafters.suffix_calib import Calibration

ROOT = 0
NODE_BYTES = 200  # rough CPython cost of one node (list slots + its dict entry)


class RefTrie:
    """Bounded-depth suffix trie; node ``0`` is the root. Children dicts keep creation order."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.token: list[int] = [-1]
        self.count: list[int] = [0]
        self.total: list[int] = [0]
        self.best: list[int] = [-1]
        self.parent: list[int] = [-1]
        self.children: list[dict[int, int] | None] = [{}]
        self.free: list[int] = []

    def live_nodes(self) -> int:
        return len(self.token) - len(self.free)

    def child(self, node: int, tok: int) -> int:
        kids = self.children[node]
        return kids.get(tok, -1) if kids else -1

    def _add_child(self, node: int, tok: int) -> int:
        kids = self.children[node]
        c = kids.get(tok, -1)
        if c >= 0:
            return c
        if self.free:
            c = self.free.pop()
            self.token[c], self.count[c], self.total[c], self.best[c] = tok, 0, 0, -1
            self.parent[c], self.children[c] = node, {}
        else:
            c = len(self.token)
            self.token.append(tok)
            self.count.append(0)
            self.total.append(0)
            self.best.append(-1)
            self.parent.append(node)
            self.children.append({})
        kids[tok] = c
        return c

    def _bump(self, node: int, c: int) -> None:
        self.count[c] += 1
        self.total[node] += 1
        b = self.best[node]
        if b < 0 or self.count[c] >= self.count[b]:  # ties: the most recently counted child
            self.best[node] = c

    def append(self, front: list[int], tok: int) -> None:
        """Append ``tok`` after the sequence whose suffix nodes are ``front`` (updated in place)."""
        n = len(front)
        keep = min(n + 1, self.depth)
        if n < keep:
            front.append(ROOT)
        for m in range(n - 1, -1, -1):
            c = self._add_child(front[m], tok)
            self._bump(front[m], c)
            if m + 1 < keep:
                front[m + 1] = c
        front[0] = ROOT

    def insert_sequence(self, seq: Sequence[int]) -> None:
        front = [ROOT]
        for t in seq:
            self.append(front, int(t))

    def remove_sequence(self, seq: Sequence[int]) -> None:
        """Undo ``insert_sequence(seq)``: decrement every substring occurrence, deepest first."""
        seq = [int(t) for t in seq]
        for s in range(len(seq)):
            path, cur = [], ROOT
            for i in range(s, min(len(seq), s + self.depth)):
                cur = self.child(cur, seq[i])
                if cur < 0:
                    break
                path.append(cur)
            for c in reversed(path):
                self._decrement(c)

    def _decrement(self, c: int) -> None:
        node = self.parent[c]
        self.count[c] -= 1
        self.total[node] -= 1
        if self.count[c] == 0:
            del self.children[node][self.token[c]]
            if self.best[node] == c:
                self.best[node] = -1
            self.children[c] = None
            self.free.append(c)
        if self.best[node] in (c, -1):
            best = -1
            for k in reversed(self.children[node].values()):  # newest first, like the native list
                if best < 0 or self.count[k] > self.count[best]:
                    best = k
            self.best[node] = best

    def step_match(self, front: list[int], tok: int) -> list[int]:
        """Frontier after ``tok`` for a read-only match (nodes of the suffixes that occur)."""
        out = [ROOT]
        for m in range(min(len(front), self.depth - 1)):
            c = self.child(front[m], tok)
            if c < 0:
                break
            out.append(c)
        return out

    def memory_bytes(self) -> int:
        return self.live_nodes() * NODE_BYTES + sys.getsizeof(self.token) * 6


def top_child(t: RefTrie, node: int) -> tuple[int, int, int, int] | None:
    """(token, count, node total, child) of the most frequent continuation of ``node``; None when nothing follows."""
    b = t.best[node]
    if t.total[node] <= 0 or b < 0:
        return None
    return t.token[b], t.count[b], t.total[node], b


def length_cap(m: int, factor: float, offset: float) -> int:
    return max(0, int(math.floor(m * factor + offset + 1e-9)))


def cont_prob(count: int, total: int, ell: int, leaf_prior: float) -> float:
    """P(next token | its path) from ``count`` of ``total`` occurrences; with ``leaf_prior`` > 0 a continuation seen
    once gets Laplace's rule of succession over the ``ell`` tokens matched so far: (ell + 1) / (ell + 1 + prior)."""
    if total == 1 and leaf_prior > 0:
        return (ell + 1.0) / (ell + 1.0 + leaf_prior)
    return count / total


def step_prob(top: tuple[int, int, int, int], ell: int, params: tuple, src: int) -> float:
    """P(the top continuation | its path): calibrated (``params[6]``, chains) or count / total."""
    _tok, c, total, _b = top
    calib = params[6]
    return calib.prob(src, ell, c, total) if calib is not None else cont_prob(c, total, ell, params[5])


def draft_chain(t: RefTrie, start: int, m: int, max_len: int, params: tuple, out: dict, src: int = 0) -> None:
    min_prob = params[4]
    path, cur = 1.0, start
    limit = min(max_len, params[0])
    while len(out["tokens"]) < limit:
        top = top_child(t, cur)
        if top is None:
            break
        q = step_prob(top, m + len(out["tokens"]), params, src)
        if path * q < min_prob:
            break
        path *= q
        out["parents"].append(len(out["tokens"]) - 1)
        out["tokens"].append(top[0])
        out["probs"].append(q)
        out["score"] += path
        cur = top[3]


def _push_children(
    t: RefTrie, node: int, path: float, parent: int, depth: int, m: int, params: tuple, seq: list[int], heap: list
) -> None:
    min_prob, leaf_prior = params[4], params[5]
    total = t.total[node]
    if total <= 0:
        return
    for c in reversed(t.children[node].values()):  # newest first
        q = cont_prob(t.count[c], total, m + depth - 1, leaf_prior)
        p = path * q
        if p >= min_prob:
            heapq.heappush(heap, (-p, seq[0], q, c, parent, depth))
            seq[0] += 1


def draft_tree(t: RefTrie, start: int, m: int, max_depth: int, params: tuple, out: dict) -> None:
    if max_depth < 1:
        return
    heap: list = []
    seq = [0]
    _push_children(t, start, 1.0, -1, 1, m, params, seq, heap)
    while heap and len(out["tokens"]) < params[0]:
        neg_p, _, q, c, parent, depth = heapq.heappop(heap)
        idx = len(out["tokens"])
        out["tokens"].append(t.token[c])
        out["parents"].append(parent)
        out["probs"].append(q)
        out["score"] += -neg_p
        if depth < max_depth:
            _push_children(t, c, -neg_p, idx, depth + 1, m, params, seq, heap)


def _empty() -> dict:
    return {"tokens": [], "parents": [], "probs": [], "score": 0.0, "match_len": 0, "source": -1}


def same_as_longer(t: RefTrie, front: list[int], m: int, params: tuple) -> bool:
    """The match of length ``m`` has the continuations of the one of length ``m + 1`` (as many occurrences with a
    continuation: the same ones), and that one's chain has room for all it may draft below the trie's depth."""
    budget, _tree, factor, offset = params[:4]
    room = t.depth - (m + 1)
    return room >= min(budget, length_cap(m + 1, factor, offset)) and t.total[front[m]] == t.total[front[m + 1]]


def best_draft(t: RefTrie, front: list[int], params: tuple, source: int, best: dict) -> dict:
    """Calibrated chains skip a match whose chain would be the next longer one's with one token less matched."""
    budget, tree, factor, offset = params[:4]
    for m in range(len(front) - 1, 0, -1):
        cap = length_cap(m, factor, offset)
        if min(budget, cap) <= best["score"]:
            break
        if t.total[front[m]] <= 0:
            continue
        if params[6] is not None and m + 1 < len(front) and same_as_longer(t, front, m, params):
            continue
        cand = _empty()
        if tree:
            draft_tree(t, front[m], m, cap, params, cand)
        else:
            draft_chain(t, front[m], m, cap, params, cand, source)
        if cand["score"] > best["score"]:
            cand["match_len"], cand["source"] = m, source
            best = cand
    return best


class _Req:
    __slots__ = ("local", "context", "prompt_len", "local_front", "global_front", "version")

    def __init__(self, depth: int, prompt: Sequence[int]) -> None:
        self.local = RefTrie(depth)
        self.context = [int(t) for t in prompt]
        self.prompt_len = len(self.context)
        self.local_front = [ROOT]
        for t in self.context:
            self.local.append(self.local_front, t)
        self.global_front = [ROOT]
        self.version = -1


class RefEngine:
    """Same API as the native ``Engine``: start/extend/stop/draft keyed by int request ids."""

    def __init__(self, depth: int = 24, max_cached_requests: int = 10_000, max_cached_tokens: int = 100_000_000):
        if not 2 <= depth <= 4096:
            raise ValueError("depth must be in [2, 4096]")
        self.depth = depth
        self.max_requests = max_cached_requests
        self.max_tokens = max_cached_tokens
        self.global_trie = RefTrie(depth)
        self.version = 0
        self.cached: deque[list[int]] = deque()
        self.cached_tokens = 0
        self.requests: dict[int, _Req] = {}
        self.calib = Calibration()

    def _refresh(self, r: _Req) -> None:
        if r.version == self.version:
            return
        front = [ROOT]
        for t in r.context[-self.depth :]:
            front = self.global_trie.step_match(front, t)
        r.global_front, r.version = front, self.version

    def start(self, rid: int, tokens: Sequence[int]) -> None:
        r = _Req(self.depth, tokens)
        self.requests[rid] = r
        self._refresh(r)

    def extend(self, rid: int, tokens: Sequence[int]) -> None:
        r = self.requests.get(rid)
        if r is None:
            raise KeyError(f"request {rid} is not active (call start first)")
        self._refresh(r)
        for t in tokens:
            t = int(t)
            self._observe(r, t)
            r.context.append(t)
            r.local.append(r.local_front, t)
            r.global_front = self.global_trie.step_match(r.global_front, t)

    def _observe(self, r: _Req, tok: int) -> None:
        """The calibration learns whether each trie's top continuation of its longest match is ``tok``."""
        for src, t, front in ((0, r.local, r.local_front), (1, self.global_trie, r.global_front)):
            for m in range(len(front) - 1, 0, -1):
                top = top_child(t, front[m])
                if top is not None:
                    self.calib.observe(src, m, top[1], top[2], top[0] == tok)
                    break

    def stop(self, rid: int) -> None:
        r = self.requests.pop(rid, None)
        if r is not None:
            self.cache(r.context[r.prompt_len :])

    def cache(self, tokens: Sequence[int]) -> None:
        """Add a finished response to the global trie (what ``stop`` does with a request's), oldest evicted first."""
        resp = [int(t) for t in tokens]
        if self.max_requests <= 0 or self.max_tokens <= 0 or not resp:
            return
        self.global_trie.insert_sequence(resp)
        self.cached_tokens += len(resp)
        self.cached.append(resp)
        while self.cached and (len(self.cached) > self.max_requests or self.cached_tokens > self.max_tokens):
            old = self.cached.popleft()
            self.global_trie.remove_sequence(old)
            self.cached_tokens -= len(old)
            self.version += 1
        self.version += 1

    def draft(
        self,
        rid: int,
        budget: int,
        tree: bool,
        factor: float,
        offset: float,
        min_prob: float,
        use_local: bool,
        use_global: bool,
        leaf_prior: float = 0.0,
        calibrated: bool = False,
    ) -> tuple[list[int], list[int], list[float], float, int, int]:
        r = self.requests.get(rid)
        if r is None:
            raise KeyError(f"request {rid} is not active (call start first)")
        best = _empty()
        if budget > 0:
            calib = self.calib if calibrated and not tree else None  # trees keep count / total
            params = (budget, bool(tree), factor, offset, min_prob, leaf_prior, calib)
            if use_local:
                best = best_draft(r.local, r.local_front, params, 0, best)
            if use_global:
                self._refresh(r)
                best = best_draft(self.global_trie, r.global_front, params, 1, best)
        return best["tokens"], best["parents"], best["probs"], best["score"], best["match_len"], best["source"]

    def memory_bytes(self) -> int:
        total = self.global_trie.memory_bytes() + sum(len(c) for c in self.cached) * 8
        return total + sum(r.local.memory_bytes() + len(r.context) * 8 for r in self.requests.values())

    def global_stats(self) -> dict[str, int]:
        return {
            "nodes": self.global_trie.live_nodes(),
            "bytes": self.global_trie.memory_bytes(),
            "cached_tokens": self.cached_tokens,
            "cached_requests": len(self.cached),
        }

    def local_nodes(self, rid: int) -> int:
        r = self.requests.get(rid)
        return r.local.live_nodes() if r else 0
