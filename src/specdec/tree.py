"""Token trees: the one draft type shared by every drafter and verifier.

A draft for one request is a tree of candidate continuations of the request's context. It is stored
flat, as parallel arrays over its ``n`` nodes in topological order:

* ``tokens[i]``  -- the token id of node ``i``;
* ``parents[i]`` -- the index of node ``i``'s parent, or ``ROOT`` (-1) when node ``i`` follows the
  last context token directly. Parents always come first: ``parents[i] < i``;
* ``probs[i]``   -- optional: the drafter's estimate of P(node i's token | its path), in [0, 1].

A chain of ``k`` tokens is the special case ``parents == [-1, 0, 1, ..., k-2]``. Sibling nodes must
carry distinct tokens (verification walks the tree by token id).

Verification feeds the target ``[last context token] + tree nodes`` in one forward pass: the root
(the last context token, index 0 of the flattened input) sits at position ``p0`` and node ``i`` at
``p0 + depth[i]``; every flattened input attends to its ancestors and itself (``ancestor_mask``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

ROOT = -1  # parent index of a node that hangs directly off the context


@dataclass(frozen=True)
class TokenTree:
    """A draft token tree (see the module docstring for the layout)."""

    tokens: np.ndarray  # [n] int64
    parents: np.ndarray  # [n] int32, ROOT or an earlier index
    probs: np.ndarray | None = None  # [n] float32 or None
    _depths: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)  # lazy [n] int32

    def __post_init__(self) -> None:
        tokens = np.ascontiguousarray(self.tokens, dtype=np.int64).reshape(-1)
        parents = np.ascontiguousarray(self.parents, dtype=np.int32).reshape(-1)
        if tokens.shape != parents.shape:
            raise ValueError(f"tokens has {tokens.size} nodes but parents has {parents.size}; they must match")
        if parents.size and (parents.min() < ROOT or np.any(parents >= np.arange(parents.size, dtype=np.int32))):
            raise ValueError(f"parents={parents.tolist()} must satisfy -1 <= parents[i] < i (topological order)")
        probs = self.probs
        if probs is not None:
            probs = np.ascontiguousarray(probs, dtype=np.float32).reshape(-1)
            if probs.shape != tokens.shape:
                raise ValueError(f"probs has {probs.size} entries for {tokens.size} nodes; they must match")
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "probs", probs)

    @classmethod
    def _trusted(
        cls, tokens: np.ndarray, parents: np.ndarray, probs: np.ndarray | None, depths: np.ndarray | None = None
    ) -> TokenTree:
        """Build without validation from arrays already of the right dtype and shape (hot paths)."""
        tree = object.__new__(cls)
        object.__setattr__(tree, "tokens", tokens)
        object.__setattr__(tree, "parents", parents)
        object.__setattr__(tree, "probs", probs)
        object.__setattr__(tree, "_depths", depths)
        return tree

    # ----------------------------------------------------------------- construction
    @classmethod
    def empty(cls) -> TokenTree:
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int32))

    @classmethod
    def chain(cls, tokens: Sequence[int] | np.ndarray, probs: Sequence[float] | np.ndarray | None = None) -> TokenTree:
        """A linear draft: each token follows the previous one."""
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = toks.size
        p = None
        if probs is not None:
            p = np.asarray(probs, dtype=np.float32).reshape(-1)
            if p.size != n:
                raise ValueError(f"probs has {p.size} entries for {n} nodes; they must match")
        return cls._trusted(toks, _chain_parents(n), p, _chain_depths(n))

    # ----------------------------------------------------------------- structure
    def __len__(self) -> int:
        return int(self.tokens.size)

    @property
    def depths(self) -> np.ndarray:
        """[n] int32: depth of each node (children of the root have depth 1)."""
        if self._depths is None:
            depths = np.zeros(self.parents.size, dtype=np.int32)
            for i, p in enumerate(self.parents.tolist()):
                depths[i] = 1 if p == ROOT else depths[p] + 1
            object.__setattr__(self, "_depths", depths)
        return self._depths  # type: ignore[return-value]

    @property
    def max_depth(self) -> int:
        return int(self.depths.max()) if len(self) else 0

    def is_chain(self) -> bool:
        return bool(np.array_equal(self.parents, np.arange(-1, len(self) - 1, dtype=np.int32)))

    def children(self, node: int) -> list[int]:
        """Indices of the children of ``node`` (``ROOT`` for the top level), in index order."""
        return np.flatnonzero(self.parents == node).tolist()

    def path_to(self, node: int) -> list[int]:
        """Node indices from the top level down to ``node`` inclusive."""
        path = []
        while node != ROOT:
            path.append(node)
            node = int(self.parents[node])
        return path[::-1]

    def path_probs(self) -> np.ndarray:
        """[n] float32: product of ``probs`` along each node's path (1.0 everywhere without probs)."""
        out = np.ones(len(self), np.float32)
        if self.probs is None:
            return out
        for i, p in enumerate(self.parents.tolist()):
            out[i] = self.probs[i] * (out[p] if p != ROOT else 1.0)
        return out

    def expected_accepted(self) -> float:
        """Expected number of accepted tokens under the drafter's own probabilities (0 without probs).

        Under the tree walk, node i is accepted iff its whole path is, so the expectation is the sum of
        path probabilities (siblings are disjoint events).
        """
        return float(self.path_probs().sum()) if self.probs is not None else 0.0

    # ----------------------------------------------------------------- verification helpers
    def positions(self, root_position: int) -> np.ndarray:
        """[n + 1] int64: positions of the flattened input ``[root] + nodes``."""
        return np.concatenate([[0], self.depths]).astype(np.int64) + root_position

    def ancestor_mask(self) -> np.ndarray:
        """[n + 1, n + 1] bool: ``mask[q, k]`` is True when flattened input ``k`` is ``q`` or its ancestor.

        Index 0 is the root (the last context token); node ``i`` is flattened index ``i + 1``.
        """
        n = len(self)
        mask = np.zeros((n + 1, n + 1), dtype=bool)
        mask[:, 0] = True
        for i, p in enumerate(self.parents.tolist()):
            mask[i + 1] = mask[p + 1]
            mask[i + 1, i + 1] = True
        return mask

    def accept_greedy(self, target_next: np.ndarray) -> tuple[list[int], int]:
        """Walk the tree along the target's greedy choices.

        ``target_next`` [n + 1]: the target's next token after the root (index 0) and after each node
        (index i + 1). Returns (accepted node indices from the top, the bonus token), where the bonus
        token is the target's choice after the last accepted node.
        """
        accepted: list[int] = []
        cur = ROOT
        while True:
            want = int(target_next[cur + 1])
            nxt = next((c for c in self.children(cur) if int(self.tokens[c]) == want), None)
            if nxt is None:
                return accepted, want
            accepted.append(nxt)
            cur = nxt

    def match_length(self, continuation: Sequence[int]) -> list[int]:
        """Longest root path whose tokens equal a prefix of ``continuation`` (node indices)."""
        accepted: list[int] = []
        cur = ROOT
        for tok in continuation:
            nxt = next((c for c in self.children(cur) if int(self.tokens[c]) == int(tok)), None)
            if nxt is None:
                break
            accepted.append(nxt)
            cur = nxt
        return accepted

    # ----------------------------------------------------------------- transforms
    def best_leaf(self) -> int:
        """The node that ends the most probable deepest path (first longest path without probs)."""
        if not len(self):
            return ROOT
        if self.probs is None:
            return int(np.argmax(self.depths))
        # Score a leaf by expected accepted tokens along its path (sum of path probabilities).
        cum = np.zeros(len(self), np.float64)
        pp = self.path_probs()
        for i, p in enumerate(self.parents.tolist()):
            cum[i] = pp[i] + (cum[p] if p != ROOT else 0.0)
        return int(np.argmax(cum))

    def to_chain(self, max_len: int | None = None) -> TokenTree:
        """The best root-to-leaf path as a chain (see ``best_leaf``), truncated to ``max_len``."""
        path = self.path_to(self.best_leaf()) if len(self) else []
        if max_len is not None:
            path = path[:max_len]
        probs = self.probs[path] if self.probs is not None else None
        return TokenTree.chain(self.tokens[path], probs)

    def truncate(self, budget: int) -> TokenTree:
        """Keep the first ``budget`` nodes (topological order keeps the result a valid tree)."""
        if budget >= len(self):
            return self
        probs = self.probs[:budget] if self.probs is not None else None
        depths = self._depths[:budget] if self._depths is not None else None
        return TokenTree._trusted(self.tokens[:budget], self.parents[:budget], probs, depths)

    def subtree_after(self, path: Sequence[int]) -> TokenTree:
        """The part of the tree below the node reached by token ``path``, re-rooted (empty if absent)."""
        cur = ROOT
        for tok in path:
            nxt = next((c for c in self.children(cur) if int(self.tokens[c]) == int(tok)), None)
            if nxt is None:
                return TokenTree.empty()
            cur = nxt
        inside = np.zeros(len(self), bool)  # [n] node lies strictly below `cur`
        for i, p in enumerate(self.parents.tolist()):
            inside[i] = p == cur or (p != ROOT and inside[p])
        keep = np.flatnonzero(inside).tolist()
        remap = {old: new for new, old in enumerate(keep)}
        parents = [remap.get(int(self.parents[i]), ROOT) for i in keep]
        probs = self.probs[keep] if self.probs is not None else None
        return TokenTree(self.tokens[keep], np.asarray(parents, np.int32), probs)

    def as_lists(self) -> tuple[list[int], list[int]]:
        return self.tokens.tolist(), self.parents.tolist()


_CHAIN_CACHE_MAX = 1024  # chains up to this length share precomputed parent/depth arrays
_CHAIN_PARENTS = np.arange(-1, _CHAIN_CACHE_MAX - 1, dtype=np.int32)
_CHAIN_DEPTHS = np.arange(1, _CHAIN_CACHE_MAX + 1, dtype=np.int32)
_CHAIN_PARENTS.setflags(write=False)
_CHAIN_DEPTHS.setflags(write=False)


def _chain_parents(n: int) -> np.ndarray:
    return _CHAIN_PARENTS[:n] if n <= _CHAIN_CACHE_MAX else np.arange(-1, n - 1, dtype=np.int32)


def _chain_depths(n: int) -> np.ndarray:
    return _CHAIN_DEPTHS[:n] if n <= _CHAIN_CACHE_MAX else np.arange(1, n + 1, dtype=np.int32)


def merge_trees(trees: Sequence[TokenTree], budget: int) -> TokenTree:
    """Union of several trees (shared prefixes merged), at most ``budget`` nodes, earlier trees first."""
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for tree in trees:
        local: dict[int, int] = {}
        for i in range(len(tree)):
            p = int(tree.parents[i])
            parent = ROOT if p == ROOT else local.get(p)
            if parent is None:
                continue
            key = (parent, int(tree.tokens[i]))
            if key not in index:
                if len(tokens) >= budget:
                    continue
                index[key] = len(tokens)
                tokens.append(key[1])
                parents.append(parent)
                probs.append(float(tree.probs[i]) if tree.probs is not None else 1.0)
            local[i] = index[key]
    any_probs = any(t.probs is not None for t in trees)
    return TokenTree(np.asarray(tokens, np.int64), np.asarray(parents, np.int32), probs if any_probs else None)


def best_chain(tree: TokenTree) -> tuple[list[int], list[float] | None]:
    """The chain to submit: the tree itself if it is one, else the greedy-by-probability root path.

    Returns (tokens [m], path probabilities [m] or None when the drafter gave no probabilities). Plain lists:
    this runs once per request per step (vLLM proposer), where numpy's per-call overhead would dominate.
    """
    n = len(tree)
    if n == 0:
        return [], None
    parents = tree.parents.tolist()
    probs = tree.probs.tolist() if tree.probs is not None else None
    if parents == list(range(-1, n - 1)):
        path = list(range(n))
    else:
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            kids.setdefault(p, []).append(i)
        path, node = [], ROOT
        while node in kids:
            node = max(kids[node], key=probs.__getitem__) if probs is not None else kids[node][0]
            path.append(node)
    tokens = tree.tokens.tolist()
    if probs is None:
        return [tokens[i] for i in path], None
    acc, path_probs = 1.0, []
    for i in path:
        acc *= probs[i]
        path_probs.append(acc)
    return [tokens[i] for i in path], path_probs
