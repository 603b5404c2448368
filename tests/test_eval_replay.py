"""Trace replay: hand-computed counts, exact reconstruction (hypothesis), failure accounting, CSV."""

from __future__ import annotations

import csv
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.drafters.base import Drafter, DraftRequest
from specdec.eval.records import TraceRecord
from specdec.eval.replay import ReplayResult, accepted_length, replay
from specdec.tree import TokenTree


class ScriptedDrafter(Drafter):
    """Returns scripted trees keyed by context length; records every lifecycle call."""

    name = "scripted"

    def __init__(self, script: dict[int, TokenTree]) -> None:
        self.script = script
        self.ctx: dict[str, list[int]] = {}
        self.calls: list[tuple] = []

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self.ctx[request_id] = list(prompt_ids)
        self.calls.append(("start", request_id, list(prompt_ids)))

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.ctx[request_id].extend(token_ids)
        self.calls.append(("extend", request_id, list(token_ids)))

    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        return [self.script.get(len(self.ctx[r.request_id]), TokenTree.empty()) for r in requests]

    def stop(self, request_id: str) -> None:
        self.ctx.pop(request_id, None)
        self.calls.append(("stop", request_id))


def test_hand_computed_chain_counts() -> None:
    rec = TraceRecord("r0", [1, 2, 3], [4, 5, 6, 7, 8, 9])
    script = {
        3: TokenTree.chain([4, 5, 9]),  # accept 2 (+bonus 6) -> emits 4 5 6
        6: TokenTree.chain([7, 0]),  # accept 1 (+bonus 8) -> emits 7 8
        8: TokenTree.chain([9, 1]),
    }  # accept 1 = the last token: no bonus -> emits 9
    d = ScriptedDrafter(script)
    res = replay(d, [rec], budget=4, tree=False)
    assert (res.steps, res.drafted_tokens, res.accepted_tokens, res.emitted_tokens) == (3, 7, 4, 6)
    assert res.mat == pytest.approx(2.0)
    assert res.acceptance_rate == pytest.approx(4 / 7)
    assert res.per_position_drafted == [3, 3, 1]
    assert res.per_position_accepted == [3, 1, 0]
    assert res.per_position_acceptance == pytest.approx([1.0, 1 / 3, 0.0])
    assert d.calls == [
        ("start", "r0", [1, 2, 3]),
        ("extend", "r0", [4, 5, 6]),
        ("extend", "r0", [7, 8]),
        ("extend", "r0", [9]),
        ("stop", "r0"),
    ]
    assert (res.records, res.response_tokens, res.prompt_tokens) == (1, 6, 3)


def test_hand_computed_tree_counts() -> None:
    # root -> {5, 4}; 4 -> {6, 7}; 7 -> {8}. Truth 4 7 8 9: path 4-7-8 accepted (3), bonus 9.
    tree = TokenTree(np.array([5, 4, 6, 7, 8]), np.array([-1, -1, 1, 1, 3]))
    rec = TraceRecord("t", [0], [4, 7, 8, 9, 10])
    res = replay(ScriptedDrafter({1: tree}), [rec], budget=5, tree=True)
    # step 1: 5 nodes drafted (depth 3), accepted 3, emitted 4; step 2: empty draft, emits 10.
    assert (res.steps, res.drafted_tokens, res.accepted_tokens, res.emitted_tokens) == (2, 5, 3, 5)
    assert res.per_position_drafted == [1, 1, 1]
    assert res.per_position_accepted == [1, 1, 1]
    assert res.mat == pytest.approx(2.5)
    assert res.steps_with_draft == 1 and res.max_draft == 5


def test_budget_violation_and_chain_request_are_enforced() -> None:
    tree = TokenTree(np.array([5, 4, 6]), np.array([-1, -1, 1]))
    rec = TraceRecord("t", [0], [4, 6, 1])
    res = replay(ScriptedDrafter({1: tree}), [rec], budget=8, tree=False)  # a tree where a chain was asked
    assert res.budget_violations == 1 and res.accepted_tokens == 2  # best path 4-6 kept as a chain
    with pytest.raises(RuntimeError, match="budget 2"):
        replay(ScriptedDrafter({1: TokenTree.chain([4, 6, 1])}), [rec], budget=2, tree=False, strict=True)


class FailingDrafter(ScriptedDrafter):
    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        raise RuntimeError("boom")


def test_drafter_failure_counts_and_goes_on() -> None:
    rec = TraceRecord("t", [0], [1, 2, 3])
    res = replay(FailingDrafter({}), [rec], budget=4, tree=False)
    assert res.draft_errors == 3 and res.steps == 3 and res.mat == 1.0
    with pytest.raises(RuntimeError, match="boom"):
        replay(FailingDrafter({}), [rec], budget=4, tree=False, strict=True)


def test_empty_responses_skipped_and_csv(tmp_path) -> None:
    recs = [TraceRecord("a", [1], []), TraceRecord("b", [1, 2], [3, 4])]
    out = tmp_path / "steps.csv"
    res = replay(ScriptedDrafter({2: TokenTree.chain([3, 4])}), recs, budget=2, tree=False, step_csv=out)
    assert res.records == 1 and res.records_skipped_empty == 1 and res.steps == 1 and res.emitted_tokens == 2
    with open(out) as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 1 and rows[0]["record"] == "b" and rows[0]["accepted"] == "2" and rows[0]["emitted"] == "2"


def test_accepted_length_chain_and_tree() -> None:
    assert accepted_length(TokenTree.chain([1, 2, 3]), [1, 2, 4]) == 2
    assert accepted_length(TokenTree.chain([1, 2, 3]), [1, 2]) == 2
    assert accepted_length(TokenTree.empty(), [1]) == 0
    assert accepted_length(TokenTree(np.array([1, 2, 3]), np.array([-1, -1, 1])), [2, 3, 9]) == 2


class OracleNoiseDrafter(Drafter):
    """Knows the truth; drafts a correct prefix of a random length then random junk (a random tree shape)."""

    name = "oracle-noise"

    def __init__(self, truth: dict[str, list[int]], seed: int) -> None:
        self.truth, self.rng, self.ctx = truth, np.random.default_rng(seed), {}

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self.ctx[request_id] = len(prompt_ids)
        self.p0 = len(prompt_ids)

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.ctx[request_id] += len(token_ids)

    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        out = []
        for r in requests:
            full = self.truth[r.request_id]
            pos = self.ctx[r.request_id]
            good = full[pos : pos + int(self.rng.integers(0, r.budget + 1))]
            junk = [int(t) + 1000 for t in self.rng.integers(0, 5, size=int(self.rng.integers(0, 3)))]
            toks = (list(good) + junk)[: r.budget]
            out.append(TokenTree.chain(toks))
        return out

    def stop(self, request_id: str) -> None:
        self.ctx.pop(request_id, None)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 50), max_size=6), st.lists(st.integers(0, 50), max_size=30)),
        min_size=1,
        max_size=5,
    ),
    st.integers(0, 6),
    st.integers(1, 3),
    st.integers(0, 2**16),
)
def test_replay_reconstructs_every_trace(pairs, budget, batch_size, seed) -> None:
    recs = [TraceRecord(f"r{i}", p, q) for i, (p, q) in enumerate(pairs)]
    truth = {r.id: r.prompt_list() + r.response_list() for r in recs}
    res = replay(
        OracleNoiseDrafter(truth, seed), recs, budget=budget, tree=False, keep_outputs=True, batch_size=batch_size
    )
    for r in recs:
        if r.response_ids.size:
            assert res.outputs[r.id] == r.response_list()
    assert res.emitted_tokens == res.response_tokens == sum(len(q) for _, q in pairs)
    no_bonus_steps = res.accepted_tokens + res.steps - res.emitted_tokens  # only a record's last step may lack it
    assert 0 <= no_bonus_steps <= sum(1 for r in recs if r.response_ids.size)
    assert res.accepted_tokens <= res.drafted_tokens <= budget * res.steps
    assert res.per_position_accepted == sorted(res.per_position_accepted, reverse=True)
    assert sum(res.per_position_accepted) == res.accepted_tokens


def test_as_dict_has_schema_keys() -> None:
    d = ReplayResult().as_dict()
    for key in (
        "mat",
        "acceptance_rate",
        "per_position_acceptance",
        "steps",
        "drafted_tokens",
        "accepted_tokens",
        "emitted_tokens",
        "draft_us_per_token",
        "update_us_per_token",
        "records",
        "response_tokens",
    ):
        assert key in d
