"""The tree prize's static shapes (pure logic): rank paths of a tree's nodes, the per-depth, per-rank acceptance
table counted on a calibration slice, the best ``budget`` rank paths under it and a tree pruned to them; and the
drafter wrappers the replays run through (record each step's outcome, prune to a shape, count steps)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from specdec.drafters.base import Drafter, DraftRequest, WrappedDrafter
from specdec.tree import ROOT, TokenTree

RankPath = tuple[int, ...]  # ranks among siblings (0 = most probable) from the top level down to a node
MAX_DEPTH = 64  # deepest level of the acceptance table
MAX_RANK = 8  # ranks per level in the acceptance table
MAX_POOL = 256  # pool budget cap
POOL_FACTOR = 4  # pool budget = min(POOL_FACTOR * B, MAX_POOL)


def rank_paths(tree: TokenTree) -> list[RankPath]:
    """[n] the rank path of every node: siblings ranked by ``probs`` descending, ties (or no probs) by index."""
    n = len(tree)
    probs = tree.probs.tolist() if tree.probs is not None else [0.0] * n
    parents = tree.parents.tolist()
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    rank = [0] * n
    for group in kids.values():
        for r, i in enumerate(sorted(group, key=lambda j: (-probs[j], j))):
            rank[i] = r
    out: list[RankPath] = []
    for i, p in enumerate(parents):  # parents come first: their paths are known
        out.append((out[p] if p != ROOT else ()) + (rank[i],))
    return out


@dataclass
class RankStats:
    """Counts for the acceptance table: ``hits[d-1][r]`` steps whose true token at depth d was the rank-r child of
    the accepted depth-(d-1) node, out of ``reach[d-1]`` steps that accepted d - 1 tokens and knew the next one."""

    hits: np.ndarray = field(default_factory=lambda: np.zeros((MAX_DEPTH, MAX_RANK), np.int64))  # [D, R]
    reach: np.ndarray = field(default_factory=lambda: np.zeros(MAX_DEPTH, np.int64))  # [D]

    def observe(self, tree: TokenTree, truth: Sequence[int]) -> None:
        """Walk ``tree`` along ``truth`` (the true tokens known after the step: accepted + next) and count."""
        paths = rank_paths(tree) if len(tree) else []
        cur = ROOT
        for d, tok in enumerate(truth[:MAX_DEPTH]):
            self.reach[d] += 1
            nxt = next((c for c in tree.children(cur) if int(tree.tokens[c]) == int(tok)), None) if len(tree) else None
            if nxt is None:
                return
            r = paths[nxt][-1]
            if r < MAX_RANK:
                self.hits[d, r] += 1
            cur = nxt


def acceptance_table(stats: RankStats) -> np.ndarray:
    """[D, R] p[d-1][r] = hits / reach (0 where never reached), made non-increasing in r (running minimum)."""
    p = stats.hits / np.maximum(stats.reach, 1)[:, None]
    return np.minimum.accumulate(p, axis=1)


def static_shape(p: np.ndarray, budget: int) -> list[RankPath]:
    """The ``budget`` rank paths of highest value prod_i p[i][r_i] (ties: shallower, then lower ranks), best first.

    Grown best-first from the root: a path enters the frontier only after its parent (as first child) or its
    elder sibling, so the result is closed under both and, with ``p`` non-increasing in rank (and every value
    <= 1), holds the top ``budget`` values. Paths of value 0 are left out.
    """
    depth_max, rank_max = p.shape
    heap: list[tuple[float, int, RankPath, float]] = []  # (-value, depth, path, parent value)

    def push(path: RankPath, parent_value: float) -> None:
        d, r = len(path), path[-1]
        if d <= depth_max and r < rank_max:
            value = parent_value * float(p[d - 1, r])
            if value > 0.0:
                heapq.heappush(heap, (-value, d, path, parent_value))

    push((0,), 1.0)
    out: list[RankPath] = []
    while heap and len(out) < budget:
        neg, _d, path, parent_value = heapq.heappop(heap)
        out.append(path)
        push(path + (0,), -neg)
        push(path[:-1] + (path[-1] + 1,), parent_value)
    return out


def prune_to_shape(tree: TokenTree, shape: frozenset[RankPath]) -> TokenTree:
    """The nodes of ``tree`` whose rank path is in ``shape`` (closed under parents), in the tree's order."""
    if not len(tree):
        return tree
    keep = [i for i, rp in enumerate(rank_paths(tree)) if rp in shape]
    remap = {old: new for new, old in enumerate(keep)}
    parents = [ROOT if int(tree.parents[i]) == ROOT else remap[int(tree.parents[i])] for i in keep]
    probs = tree.probs[keep] if tree.probs is not None else None
    return TokenTree(tree.tokens[keep], np.asarray(parents, np.int32), probs)


def pool_budget(budget: int) -> int:
    return min(POOL_FACTOR * budget, MAX_POOL)


# ----------------------------------------------------------------------------- drafter wrappers for replay
class RecordingDrafter(WrappedDrafter):
    """Drafts the inner drafter's trees unchanged and feeds each step's outcome to ``stats`` (calibration)."""

    def __init__(self, inner: Drafter, stats: RankStats) -> None:
        super().__init__(inner)
        self.stats = stats
        self._pending: dict[str, TokenTree] = {}

    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        trees = self.inner.draft_batch(requests)
        for r, t in zip(requests, trees):
            self._pending[r.request_id] = t
        return trees

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        tree = self._pending.pop(request_id, None)
        if tree is not None:  # emitted = accepted path + the true next token: all the walk needs
            self.stats.observe(tree, list(token_ids))
        super().extend(request_id, token_ids)


class ShapedDrafter(WrappedDrafter):
    """Tree requests: the inner drafter's tree at the pool budget pruned to ``shape``; chains pass through."""

    def __init__(self, inner: Drafter, shape: Sequence[RankPath]) -> None:
        super().__init__(inner)
        self.shape = frozenset(shape)

    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        asks = [DraftRequest(r.request_id, pool_budget(r.budget), True, r.free) if r.tree else r for r in requests]
        trees = self.inner.draft_batch(asks)
        return [prune_to_shape(t, self.shape) if r.tree else t for r, t in zip(requests, trees)]


class StepCounter(WrappedDrafter):
    """Counts the steps (draft calls) of every request, for the paired bootstrap over records."""

    def __init__(self, inner: Drafter) -> None:
        super().__init__(inner)
        self.steps: dict[str, int] = {}

    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        for r in requests:
            self.steps[r.request_id] = self.steps.get(r.request_id, 0) + 1
        return self.inner.draft_batch(requests)
