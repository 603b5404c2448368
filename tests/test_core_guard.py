"""DraftGuard: drafter failures degrade to "no draft", are counted and logged once; strict re-raises."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest

from specdec.drafters.base import Drafter, DraftGuard, DraftRequest
from specdec.tree import TokenTree


class Scripted(Drafter):
    """Drafts a 6-token chain; raises what ``fail`` holds (once per draft call) or returns a wrong count."""

    name = "scripted"

    def __init__(self) -> None:
        self.fail: list[BaseException | str] = []

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        if request_id == "bad-start":
            raise KeyError("start failed")

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        pass

    def stop(self, request_id: str) -> None:
        pass

    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        if self.fail:
            what = self.fail.pop(0)
            if what == "short":
                return []
            raise what  # type: ignore[misc]
        return [TokenTree.chain([1, 2, 3, 4, 5, 6]) for _ in requests]


REQS = [DraftRequest("req-a", 4), DraftRequest("req-b", 2)]


def test_drafts_are_cut_to_the_budget():
    trees = DraftGuard(Scripted()).draft_batch(REQS)
    assert [t.tokens.tolist() for t in trees] == [[1, 2, 3, 4], [1, 2]]


def test_failure_gives_empty_drafts_counted_and_logged_once(caplog):
    caplog.set_level(logging.WARNING, logger="specdec.drafters")
    drafter = Scripted()
    drafter.fail = [RuntimeError("x1"), RuntimeError("x2"), ValueError("v")]
    guard = DraftGuard(drafter)
    for _ in range(3):
        assert all(len(t) == 0 for t in guard.draft_batch(REQS))
    assert guard.stats.errors == 3
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2  # one per kind of error
    assert "req-a, req-b" in messages[0] and "RuntimeError('x1')" in messages[0]
    assert len(guard.draft_batch(REQS)[0]) == 4  # recovered: drafts again
    assert guard.stats.draft_seconds > 0


def test_wrong_number_of_drafts_is_a_failure():
    drafter = Scripted()
    drafter.fail = ["short"]
    guard = DraftGuard(drafter)
    assert [len(t) for t in guard.draft_batch(REQS)] == [0, 0]
    assert guard.stats.errors == 1


def test_strict_reraises():
    drafter = Scripted()
    drafter.fail = [RuntimeError("strict")]
    with pytest.raises(RuntimeError, match="strict"):
        DraftGuard(drafter, strict=True).draft_batch(REQS)


def test_lifecycle_failures_are_absorbed(caplog):
    caplog.set_level(logging.WARNING, logger="specdec.drafters")
    guard = DraftGuard(Scripted())
    guard.call("start", "bad-start", [1, 2])
    assert guard.stats.errors == 1 and "bad-start" in caplog.records[0].getMessage()
    with pytest.raises(KeyError):
        DraftGuard(Scripted(), strict=True).call("start", "bad-start", [1])
    assert guard.stats.as_dict()["draft_errors"] == 1


def test_chain_drafts_are_cut_to_the_budget_and_failures_give_empty_chains(caplog):
    guard = DraftGuard(Scripted())
    assert guard.draft_chains(REQS) == [([1, 2, 3, 4], None), ([1, 2], None)]  # default: from draft_batch
    guard.drafter.fail = [RuntimeError("boom"), "short"]
    with caplog.at_level(logging.WARNING):
        assert guard.draft_chains(REQS) == [([], None), ([], None)]
        assert guard.draft_chains(REQS) == [([], None), ([], None)]  # wrong count: a failure too
    assert guard.stats.errors == 2
