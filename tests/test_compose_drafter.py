"""Composition by score: best expected-accepted draft per request, ties to the earlier part, failures."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from specdec.drafters import build_drafter
from specdec.drafters.base import Drafter, DraftRequest
from specdec.drafters.compose import ComposedDrafter
from specdec.tree import TokenTree


class Fixed(Drafter):
    """Returns a fixed tree for every request; records lifecycle calls."""

    def __init__(self, name: str, tree: TokenTree, *, fail: str = "") -> None:
        self.name, self.tree, self.fail = name, tree, fail
        self.calls: list[tuple[str, str]] = []

    def _maybe_fail(self, what: str) -> None:
        if self.fail == what:
            raise RuntimeError(f"{self.name} broken in {what}")

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self._maybe_fail("start")
        self.calls.append(("start", request_id))

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.calls.append(("extend", request_id))

    def stop(self, request_id: str) -> None:
        self.calls.append(("stop", request_id))

    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        self._maybe_fail("draft")
        return [self.tree for _ in requests]


A = TokenTree.chain([1, 2, 3], [0.9, 0.9, 0.9])  # expected accepted 0.9 + 0.81 + 0.729 = 2.439
B = TokenTree.chain([1, 5], [1.0, 1.0])  # 2.0
C = TokenTree.chain([7, 8], [1.0, 1.0])  # 2.0 (ties with B)


def test_picks_best_score_and_forwards_lifecycle():
    a, b = Fixed("a", A), Fixed("b", B)
    comp = ComposedDrafter([b, a])
    comp.start("r", [1])
    comp.extend("r", [2])
    assert comp.draft("r", 8).tokens.tolist() == [1, 2, 3]
    comp.stop("r")
    assert a.calls == b.calls == [("start", "r"), ("extend", "r"), ("stop", "r")]
    assert comp.picks == [0, 1]


def test_tie_goes_to_earlier_drafter_and_budget_truncates():
    comp = ComposedDrafter([Fixed("c", C), Fixed("b", B)])
    assert comp.draft("r", 8).tokens.tolist() == [7, 8]
    comp2 = ComposedDrafter([Fixed("a", A), Fixed("b", B)])
    assert comp2.draft("r", 1).tokens.tolist() == [1]  # truncated to one node A scores 0.9 < B 1.0 (both: 1)
    assert len(comp2.draft("r", 2)) == 2


def test_failure_of_one_part_uses_the_others(caplog):
    comp = ComposedDrafter([Fixed("bad", A, fail="draft"), Fixed("good", B)])
    comp.start("r", [1])
    assert comp.draft("r", 8).tokens.tolist() == [1, 5]
    assert comp.failures["bad"] == 1
    comp2 = ComposedDrafter([Fixed("bad", A, fail="start"), Fixed("good", B)])
    comp2.start("r", [1])  # absorbed
    assert comp2.failures["bad"] == 1
    all_bad = ComposedDrafter([Fixed("x", A, fail="draft")])
    assert len(all_bad.draft("r", 8)) == 0


def test_merge_trees_under_budget():
    comp = ComposedDrafter([Fixed("a", A), Fixed("c", C)], merge=True)
    tree = comp.draft("r", 4, tree=True)
    assert len(tree) == 4
    assert tree.tokens.tolist() == [1, 2, 3, 7]  # best part first, shared prefixes merged, then C's root
    assert tree.parents.tolist() == [-1, 0, 1, -1]
    chain = comp.draft("r", 4)
    assert chain.is_chain() and chain.tokens.tolist() == [1, 2, 3]


def test_registry_builds_composition_of_real_drafters():
    comp = build_drafter(["suffix", "ngram"])
    assert isinstance(comp, ComposedDrafter) and comp.name == "suffix+ngram"
    prompt = [5, 6, 7, 8, 9, 5, 6, 7]
    comp.start("r", prompt)
    t = comp.draft("r", 4)
    assert t.tokens.tolist()[:2] == [8, 9]
    comp.stop("r")
    assert comp.active_requests() == []
    assert np.isfinite(t.expected_accepted())


def test_a_drafter_listed_twice_with_the_same_options_is_refused_and_other_options_are_not():
    from specdec.config import ConfigError

    with pytest.raises(ConfigError, match="'suffix' is listed twice with the same options; list each drafter once"):
        build_drafter(["suffix", "ngram", "suffix"])
    with pytest.raises(ConfigError, match="'suffix' is listed twice"):  # the per-name options make them equal
        build_drafter(["suffix", {"name": "suffix", "max_depth": 8}], {"suffix": {"max_depth": 8}})
    assert build_drafter(["suffix", {"name": "suffix", "max_depth": 8}]).name == "suffix+suffix"


def test_calibration_moves_picks_from_an_overconfident_part_to_an_accurate_one():
    # "loud" is sure of a wrong continuation (99% per token, never accepted); "quiet" predicts 0.6 per
    # token and is right. Raw scores favour loud (2.9 vs 1.4); observed acceptance must flip the choice.
    loud = Fixed("loud", TokenTree.chain([9, 9, 9], [0.99, 0.99, 0.99]))
    quiet = Fixed("quiet", TokenTree.chain([1, 2, 3], [0.6, 0.6, 0.6]))
    comp = ComposedDrafter([loud, quiet])
    comp.start("r", [0])
    chosen = []
    for _ in range(12):
        tree = comp.draft("r", 3)
        chosen.append(tree.tokens.tolist())
        truth = [1, 2, 3, 4]  # the target's continuation: quiet's draft + a bonus token
        accepted = len(tree.match_length(truth))
        comp.extend("r", truth[: accepted + 1])
    assert chosen[0] == [9, 9, 9]  # before any evidence the raw score decides
    assert chosen[-1] == [1, 2, 3] and comp.picks[1] > 0
    assert comp.calibration(0) < 0.5 < comp.calibration(1)  # loud: 8 / (8 + k * 2.9); quiet: above 1
    # without calibration the loud part keeps winning
    raw = ComposedDrafter([loud, quiet], calibrate=False)
    raw.start("r", [0])
    for _ in range(5):
        raw.extend("r", [1])
    assert raw.draft("r", 3).tokens.tolist() == [9, 9, 9]


def test_a_part_that_is_never_chosen_still_learns_and_takes_over():
    """A confident but wrong part wins the first step; the unchosen, right one is calibrated from the same
    outcome (emitted tokens), and as the two disagree on the first token, the judge of such disagreements
    (whose first token was right) moves to the right part at once."""
    wrong = Fixed("wrong", TokenTree.chain([9, 9, 9, 9], [0.95] * 4))  # scores ~3.5, never accepted
    right = Fixed("right", TokenTree.chain([1, 2, 3, 4], [0.6] * 4))  # scores ~1.3, always right
    comp = ComposedDrafter([wrong, right])
    comp.start("r", [0])
    chosen = []
    for step in range(6):
        tree = comp.draft("r", 4)
        chosen.append(tree.tokens.tolist())
        # the target continues 1 2 3 4; emitted = accepted prefix of the chosen draft + the target's next token
        accepted = len(tree.match_length([1, 2, 3, 4]))
        comp.extend("r", [1, 2, 3, 4, 5][: accepted + 1])
        if step == 0:  # "right" not chosen, but scored on the 1 observed token: 0.6 predicted, 1 accepted
            assert comp.accepted[1] == 1.0 and comp.predicted[1] == pytest.approx(0.6)
            assert comp.judge(1, 1.3) > 0.5 > comp.judge(0, 3.5)
    assert chosen[0] == [9, 9, 9, 9] and chosen[1:] == [[1, 2, 3, 4]] * 5
    assert comp.calibration(0) < comp.calibration(1)


def test_agreeing_parts_are_chosen_by_calibrated_score_not_by_the_judge():
    short = Fixed("short", TokenTree.chain([1, 2], [0.9, 0.9]))
    long = Fixed("long", TokenTree.chain([1, 2, 3, 4], [0.9] * 4))
    comp = ComposedDrafter([short, long])
    comp._dis_right[(0, 1)] = 50.0  # "short" has been the better judge: irrelevant while both start with 1
    comp._dis_seen[(0, 1)] = 50.0
    assert comp.draft("r", 4).tokens.tolist() == [1, 2, 3, 4]


def test_calibration_is_kept_per_score_band():
    """A part right on its long, confident drafts and wrong on its short ones is trusted only in the long band."""
    long_right = TokenTree.chain([1, 2, 3, 4], [0.95] * 4)  # score ~3.6: band [2, 4)
    short_wrong = TokenTree.chain([9], [0.9])  # score 0.9: band [0, 1)
    comp = ComposedDrafter([Fixed("copy", long_right)])
    comp.start("r", [0])
    for step in range(20):
        tree = long_right if step % 2 == 0 else short_wrong
        comp._pending["r"] = [(0, tree)]
        comp.extend("r", [1, 2, 3, 4, 5][: len(tree.match_length([1, 2, 3, 4])) + 1])
    assert comp.calibration(0, 3.6) > 0.9  # 4 accepted of 3.6 predicted, every time
    assert comp.calibration(0, 0.9) < 0.6  # 0 of 0.9, shrunk toward the overall ratio
    assert comp.calibration(0, 0.9) < comp.calibration(0) < comp.calibration(0, 3.6)


def test_a_longer_chain_that_continues_the_chosen_one_is_taken():
    """B = [1, 5] scores higher than the low-probability chain [1, 5, 6, 7], which extends it: the extension is
    accepted at least as far, so it is taken; a longer chain that diverges ([1, 9, ...]) is not."""
    ext = TokenTree.chain([1, 5, 6, 7], [0.6, 0.5, 0.5, 0.5])  # 0.6 + 0.3 + 0.15 + 0.075 = 1.125 < 2.0
    comp = ComposedDrafter([Fixed("b", B), Fixed("ext", ext)])
    assert comp.draft("r", 8).tokens.tolist() == [1, 5, 6, 7]
    assert comp.picks == [0, 1]
    assert comp.draft("r", 3).tokens.tolist() == [1, 5, 6]  # budget first, then the prefix test
    diverging = TokenTree.chain([1, 9, 6, 7], [0.6, 0.5, 0.5, 0.5])
    comp2 = ComposedDrafter([Fixed("b", B), Fixed("d", diverging)])
    assert comp2.draft("r", 8).tokens.tolist() == [1, 5]


def test_learned_statistics_fade_so_the_choice_follows_a_workload_change():
    """Part a is right for 300 steps, then part b is: with a memory of 50 steps the choice moves to b within
    tens of steps; without forgetting, 300 steps of history keep a in front far longer."""

    def run(memory):
        a = Fixed("a", TokenTree.chain([1, 2, 3], [0.9] * 3))
        b = Fixed("b", TokenTree.chain([7, 8, 9], [0.9] * 3))
        comp = ComposedDrafter([a, b], memory_steps=memory)
        comp.start("r", [0])
        for step in range(400):
            truth = [1, 2, 3, 4] if step < 300 else [7, 8, 9, 4]
            tree = comp.draft("r", 3)
            comp.extend("r", truth[: len(tree.match_length(truth)) + 1])
            if step >= 300 and tree.tokens.tolist() == [7, 8, 9]:
                return step - 300
        return 100

    assert run(50) < 40 < run(None)
