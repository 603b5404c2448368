"""Hedge planning: which outcomes of the step being verified are worth pre-drafting for.

A step verifies draft ``D`` (a chain on vLLM, any tree in the reference verifier). Greedy
verification accepts a root path ``P`` of ``D`` and then emits one bonus token ``b`` that is NOT one
of ``D``'s children below ``P`` (otherwise it would have been accepted). So the outcome is
``emitted = tokens(P) + [b]``, and the next step's draft is a function of it. We rank outcomes by

    P(outcome) ~= reach(P) * stop(P) * q(b | P)

* ``reach(P)``: product of ``D``'s node probabilities along ``P`` (``DEFAULT_NODE_PROB`` per node
  when ``D`` has none);
* ``stop(P)``: 1 - sum of the probabilities of ``D``'s children below ``P`` (at least ``MIN_STOP``);
* ``q(b | P)``: the drafter's own belief in ``b`` after ``P``, read from "probe" trees: the drafter's
  tree at the same context with a larger budget (its alternatives at each depth of ``D``'s path), and
  its tree after ``D``'s best leaf (the bonus after full acceptance), normalised over the tokens ``D``
  does not already hold. Each probe is ``(prefix, tree)``: ``tree`` drafted after ``prefix``.

Pure functions on ``TokenTree``; no drafter calls here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from specdec.tree import ROOT, TokenTree

DEFAULT_NODE_PROB = 0.5  # belief in a draft node when the drafter gives no probabilities
MIN_STOP = 0.05  # floor of P(verification stops at a path): drafters are over-confident
RANK_DECAY = 0.5  # belief in the k-th probe alternative without probabilities: RANK_DECAY ** k


@dataclass(frozen=True)
class Outcome:
    """One hypothetical verification result: the tokens the step would emit, and its estimated chance."""

    emitted: tuple[int, ...]  # accepted draft tokens + bonus token
    score: float


def _node_probs(tree: TokenTree) -> np.ndarray:
    """[n] float64: node probabilities, DEFAULT_NODE_PROB where the tree has none."""
    if tree.probs is None:
        return np.full(len(tree), DEFAULT_NODE_PROB, np.float64)
    return np.clip(tree.probs.astype(np.float64), 0.0, 1.0)


def _children_index(tree: TokenTree) -> dict[int, list[int]]:
    """parent index (ROOT for the top) -> child node indices, in index order."""
    out: dict[int, list[int]] = {ROOT: []}
    for i, p in enumerate(tree.parents.tolist()):
        out.setdefault(int(p), []).append(i)
        out.setdefault(i, [])
    return out


Probe = tuple[tuple[int, ...], TokenTree]  # (token prefix it was drafted after, the drafter's tree)


def _alternatives(probes: Sequence[Probe], path: list[int]) -> list[tuple[int, float]]:
    """Bonus candidates after ``path`` from the probe with the longest prefix of ``path``."""
    best: Probe | None = None
    for prefix, tree in probes:
        if tuple(path[:len(prefix)]) == prefix and (best is None or len(prefix) > len(best[0])):
            best = (prefix, tree)
    return _probe_alternatives(best[1], path[len(best[0]):]) if best is not None else []


def _probe_alternatives(probe: TokenTree, path: list[int]) -> list[tuple[int, float]]:
    """(token, belief) of the probe tree's children below token path ``path`` (empty if absent)."""
    if not len(probe):
        return []
    kids = _children_index(probe)
    probs = probe.probs
    cur = ROOT
    for tok in path:
        nxt = next((c for c in kids[cur] if int(probe.tokens[c]) == tok), None)
        if nxt is None:
            return []
        cur = nxt
    out = []
    for rank, c in enumerate(kids[cur]):
        belief = float(probs[c]) if probs is not None else RANK_DECAY ** rank
        out.append((int(probe.tokens[c]), belief))
    return out


def rank_outcomes(draft: TokenTree, probes: Sequence[Probe], *, max_outcomes: int,
                  bonus_per_path: int = 2) -> list[Outcome]:
    """The ``max_outcomes`` most likely outcomes of verifying ``draft``, best first.

    ``probes``: the drafter's trees after token prefixes (``((), tree)`` = at the draft's own context).
    Outcomes whose bonus token no probe predicts are not enumerated (nothing to hedge on).
    """
    if max_outcomes <= 0:
        return []
    kids = _children_index(draft)
    probs = _node_probs(draft)
    tokens = draft.tokens.tolist()
    outcomes: list[Outcome] = []
    # Depth-first over the root and every node of the draft: (node, its token path, reach).
    stack: list[tuple[int, list[int], float]] = [(ROOT, [], 1.0)]
    while stack:
        node, path, reach = stack.pop()
        children = kids.get(node, [])
        held = {tokens[c] for c in children}
        stop = max(MIN_STOP, 1.0 - float(sum(probs[c] for c in children)))
        alts = [(t, b) for t, b in _alternatives(probes, path) if t not in held]
        total = sum(b for _, b in alts)
        if total > 0:
            for tok, belief in sorted(alts, key=lambda tb: -tb[1])[:bonus_per_path]:
                outcomes.append(Outcome(tuple(path) + (tok,), reach * stop * belief / total))
        for c in children:
            stack.append((c, path + [tokens[c]], reach * float(probs[c])))
    outcomes.sort(key=lambda o: (-o.score, len(o.emitted)))
    return outcomes[:max_outcomes]


def hedge_from_probe(probes: Sequence[Probe], emitted: tuple[int, ...], budget: int, *, tree: bool) -> TokenTree:
    """A cheap hedge: the subtree below ``emitted`` of the probe drafted after the longest prefix of it
    (for drafters without ``draft_after``; empty when no probe reaches that far)."""
    best: Probe | None = None
    for prefix, t in probes:
        if emitted[:len(prefix)] == prefix and (best is None or len(prefix) > len(best[0])):
            best = (prefix, t)
    if best is None:
        return TokenTree.empty()
    sub = best[1].subtree_after(list(emitted[len(best[0]):]))
    return sub.truncate(budget) if tree else sub.to_chain(budget)


def best_path_tokens(draft: TokenTree) -> tuple[int, ...]:
    """Tokens of the draft's best root-to-leaf path (the whole chain for a chain)."""
    return tuple(int(draft.tokens[i]) for i in draft.path_to(draft.best_leaf())) if len(draft) else ()
