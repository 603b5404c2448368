"""Composition by score: several drafters behind one, choosing per request and step.

``ComposedDrafter([suffix, ngram])`` forwards every lifecycle call to all parts; at each step it asks
every part for a draft and keeps, per request, the one with the highest calibrated score: the part's
``TokenTree.expected_accepted()`` (sum of path probabilities) times that part's observed calibration, the
ratio of tokens its drafts really got accepted to what they predicted (learned online from ``extend``;
starts at 1 through a prior of ``CALIBRATION_PRIOR_TOKENS``), overall and per band of the part's own score
(``SCORE_BUCKET_EDGES``; a band starts from the part's overall ratio): a suffix drafter is reliable when it
predicts a long copy and over-confident when it predicts one or two tokens.

When the parts' drafts start with different tokens, at most one is right; the choice then goes to the part
whose first token has most often been the right one in such disagreements (counted online per part and score
band, from the emitted tokens), and only on a tie to the calibrated score. A small model drafter is usually
the better judge of the next token, a suffix drafter of how far a copy goes. Every part learns from every step, chosen
or not: the emitted tokens (the chosen draft's accepted prefix + the target's next token) are the target's
greedy continuation, so a part whose draft was not submitted is scored on them too, both sides cut at that
many tokens (its acceptance beyond them is unobserved). Learning only from chosen drafts would freeze a part
that starts behind. Drafters' probabilities are not on
one scale (frequency counts vs a model's softmax); calibration makes them comparable. Ties go to the
earlier drafter. With ``merge=True`` it instead unites the
parts' trees (shared prefixes merged, best-scored part first) under the budget; chain requests then get
the merged tree's best path. A part that raises is skipped for that call (counted in ``failures`` and
logged once per part and error type); its trees are dropped until it answers again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from specdec.drafters.base import Drafter, DraftRequest
from specdec.tree import TokenTree, best_chain, merge_trees

logger = logging.getLogger("specdec.drafters")
CALIBRATION_PRIOR_TOKENS = 8.0  # pseudo-tokens (predicted = accepted) each part's calibration starts with
SCORE_BUCKET_EDGES = (1.0, 2.0, 4.0, 8.0)  # calibration is also kept per band of the part's own score
DISAGREE_PRIOR = (1.0, 2.0)  # (right, seen) pseudo-counts of each part's first token when the parts disagree
MEMORY_STEPS = 200  # learned statistics decay by 1 - 1/MEMORY_STEPS per observed step (follows workload shifts)


class ComposedDrafter(Drafter):
    """Per request and step, the best-scored draft of several drafters (or their merged tree)."""

    name = "composed"

    def __init__(
        self,
        drafters: Sequence[Drafter],
        *,
        merge: bool = False,
        calibrate: bool = True,
        memory_steps: float | None = MEMORY_STEPS,
    ) -> None:
        if not drafters:
            raise ValueError("ComposedDrafter needs at least one drafter, e.g. [SuffixDrafter(), NgramDrafter()]")
        self.drafters = list(drafters)
        self.merge = merge
        self.name = "+".join(d.name for d in self.drafters)
        self.failures: dict[str, int] = {d.name: 0 for d in self.drafters}
        self.picks: list[int] = [0] * len(self.drafters)  # how often each part's draft was chosen
        self.calibrate = calibrate
        self.predicted: list[float] = [0.0] * len(self.drafters)  # decayed sums of scores (priors added at use)
        self.accepted: list[float] = [0.0] * len(self.drafters)  # ... and of accepted tokens
        self.decay = 1.0 if not memory_steps else 1.0 - 1.0 / float(memory_steps)
        # request -> [(part, draft)] of this step, the chosen one first, awaiting the outcome
        self._pending: dict[str, list[tuple[int, TokenTree]]] = {}
        self._band_pred: dict[tuple[int, int], float] = {}  # (part, score band) -> predicted tokens
        self._band_acc: dict[tuple[int, int], float] = {}  # ... and their accepted tokens
        self._dis_right: dict[tuple[int, int], float] = {}  # (part, band) -> first token right when parts disagreed
        self._dis_seen: dict[tuple[int, int], float] = {}
        self._logged: set[tuple[str, str]] = set()

    # ----------------------------------------------------------------- lifecycle
    def _each(self, method: str, *args: object) -> None:
        for d in self.drafters:
            try:
                getattr(d, method)(*args)
            except Exception as exc:  # noqa: BLE001 - one part failing must not stop the others
                self._fail(d, method, exc)

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self._each("start", request_id, prompt_ids)

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self._learn(pending, token_ids)
        self._each("extend", request_id, token_ids)

    def _learn(self, drafts: list[tuple[int, TokenTree]], emitted: Sequence[int]) -> None:
        """Update each part's calibration from this step's outcome (see the module docstring)."""
        # chosen draft: emitted = accepted path + one token the target chose, which no child of the path's
        # end carries, so the match length of the emitted tokens is the accepted count
        firsts = [first_token(t) for _, t in drafts]
        if len(set(firsts)) > 1 and emitted:  # the parts disagreed on the next token: whose was right?
            for (part, tree), first in zip(drafts, firsts):
                key = (part, score_band(score(tree)))
                self._dis_seen[key] = self._dis_seen.get(key, 0.0) + 1
                self._dis_right[key] = self._dis_right.get(key, 0.0) + (first == int(emitted[0]))
        if self.decay < 1.0:
            self._forget()
        horizon = len(emitted)  # other parts: only the first len(emitted) target tokens are known
        for j, (part, tree) in enumerate(drafts):
            predicted = score(tree) if j == 0 else score(tree, max_depth=horizon)
            accepted = len(tree.match_length(emitted))
            self.predicted[part] += predicted
            self.accepted[part] += accepted
            key = (part, score_band(score(tree)))
            self._band_pred[key] = self._band_pred.get(key, 0.0) + predicted
            self._band_acc[key] = self._band_acc.get(key, 0.0) + accepted

    def _forget(self) -> None:
        """Decay every learned statistic by one step, so the choice follows a change of workload."""
        k = self.decay
        self.predicted = [v * k for v in self.predicted]
        self.accepted = [v * k for v in self.accepted]
        for table in (self._band_pred, self._band_acc, self._dis_right, self._dis_seen):
            for key in table:
                table[key] *= k

    def stop(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._each("stop", request_id)

    def calibration(self, part: int, value: float | None = None) -> float:
        """Observed accepted / predicted tokens of the part's drafts (1.0 when not calibrating); with ``value``,
        of its drafts scored in the same band, shrunk toward the part's overall ratio."""
        if not self.calibrate:
            return 1.0
        prior = CALIBRATION_PRIOR_TOKENS
        overall = (self.accepted[part] + prior) / (self.predicted[part] + prior)
        if value is None:
            return overall
        key = (part, score_band(value))
        return (self._band_acc.get(key, 0.0) + prior * overall) / (self._band_pred.get(key, 0.0) + prior)

    def judge(self, part: int, value: float) -> float:
        """How often the part's first token was the right one when the parts disagreed (per score band)."""
        key = (part, score_band(value))
        right, seen = DISAGREE_PRIOR
        return (self._dis_right.get(key, 0.0) + right) / (self._dis_seen.get(key, 0.0) + seen)

    def close(self) -> None:
        self._each("close")

    def check_target(self, *, vocab_size: int, tokenizer_dir: str | None = None) -> None:
        for d in self.drafters:
            d.check_target(vocab_size=vocab_size, tokenizer_dir=tokenizer_dir)

    # ----------------------------------------------------------------- drafting
    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        per_part: list[list[TokenTree] | None] = []
        for d in self.drafters:
            try:
                trees = d.draft_batch(requests)
                if len(trees) != len(requests):
                    raise RuntimeError(f"returned {len(trees)} drafts for {len(requests)} requests")
                per_part.append([t.truncate(r.budget) for t, r in zip(trees, requests)])
            except Exception as exc:  # noqa: BLE001
                self._fail(d, "draft_batch", exc)
                per_part.append(None)
        return [self._choose(i, req, per_part) for i, req in enumerate(requests)]

    def _choose(self, i: int, req: DraftRequest, per_part: list[list[TokenTree] | None]) -> TokenTree:
        cands = [(k, trees[i]) for k, trees in enumerate(per_part) if trees is not None and len(trees[i])]
        if not cands:
            return TokenTree.empty()
        # best calibrated score first, ties: earlier part; on a first-token disagreement, the better judge first
        disagree = len({first_token(t) for _, t in cands}) > 1
        values = {k: score(t) for k, t in cands}
        scored = sorted(
            cands,
            key=lambda kt: (
                -self.judge(kt[0], values[kt[0]]) if disagree else 0.0,
                -values[kt[0]] * self.calibration(kt[0], values[kt[0]]),
                kt[0],
            ),
        )
        scored = _prefer_extension(scored)
        self.picks[scored[0][0]] += 1
        self._pending[req.request_id] = scored
        if not self.merge or len(scored) == 1:
            return scored[0][1]
        merged = merge_trees([t for _, t in scored], req.budget)
        return merged if req.tree else merged.to_chain(req.budget)

    def _fail(self, d: Drafter, what: str, exc: BaseException) -> None:
        self.failures[d.name] = self.failures.get(d.name, 0) + 1
        key = (d.name, type(exc).__name__)
        if key not in self._logged:
            self._logged.add(key)
            logger.warning(
                "drafter %s failed in %s: %r; the other drafters go on (further %s errors from it are not logged)",
                d.name,
                what,
                exc,
                type(exc).__name__,
            )

    # ----------------------------------------------------------------- introspection
    def active_requests(self) -> list[str]:
        seen: dict[str, None] = {}
        for d in self.drafters:
            seen.update(dict.fromkeys(d.active_requests()))
        return list(seen)

    def memory_bytes(self) -> int:
        return sum(d.memory_bytes() for d in self.drafters)


def _prefer_extension(scored: list[tuple[int, TokenTree]]) -> list[tuple[int, TokenTree]]:
    """If another part's chain continues the chosen chain (the chosen one is its prefix), take the longest such
    chain: it is accepted at least as far, since verification stops at the first wrong token."""
    best = scored[0][1]
    if not best.is_chain():
        return scored
    head = best.tokens.tolist()
    longer = [
        i
        for i, (_, t) in enumerate(scored[1:], 1)
        if len(t) > len(head) and t.is_chain() and t.tokens[: len(head)].tolist() == head
    ]
    if not longer:
        return scored
    pick = max(longer, key=lambda i: len(scored[i][1]))
    return [scored[pick]] + [c for i, c in enumerate(scored) if i != pick]


def first_token(tree: TokenTree) -> int:
    """The first token of the tree's most probable root path (-1 for an empty tree)."""
    tokens = best_chain(tree)[0]
    return int(tokens[0]) if tokens else -1


def score_band(value: float) -> int:
    """Index of ``value`` among ``SCORE_BUCKET_EDGES`` (0: below the first edge)."""
    return sum(value >= edge for edge in SCORE_BUCKET_EDGES)


def score(tree: TokenTree, *, max_depth: int | None = None) -> float:
    """Expected accepted tokens under the drafter's own probabilities (0 for an empty or prob-less tree),
    counting only nodes at depth <= ``max_depth`` when given."""
    if not len(tree) or tree.probs is None:
        return 0.0
    if max_depth is None:
        return tree.expected_accepted()
    return float(tree.path_probs()[tree.depths <= max_depth].sum())
