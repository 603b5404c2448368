"""The gate's before/after verdict (benchmarks.gate_compare): hand-built results documents, hand-checked ratios."""

from __future__ import annotations

import math

import pytest

from benchmarks import gate_rules as rules
from benchmarks.gate_compare import cell_pairs, compare, geomean, render_compare
from benchmarks.gate_report import gate_verdicts, render


def _cell(tps: float, *, rep4: float, emit: float | None = 2.0, temperature: float = 0.0) -> dict:
    run = {"tokens_per_s": tps, "emitted_per_step": emit}
    if temperature:
        run["request_tokens_per_s"] = tps
    return {"runs": [run], "repeat4": rep4, "temperature": temperature}


def _gate(cells: dict[str, tuple[float, float, float, float, float, float]]) -> dict:
    """cells: key -> (nospec tps, nospec rep4, candidate tps, candidate rep4, before tps, before rep4)."""
    eng: dict[str, dict] = {m: {"cells": {}} for m in ("nospec", "specdec", "specdec-before")}
    for key, (n, nr, c, cr, b, br) in cells.items():
        t = 0.8 if key.endswith("s8") else 0.0
        eng["nospec"]["cells"][key] = {**_cell(n, rep4=nr, temperature=t), "runs": [{"tokens_per_s": n}] * 2}
        if t:
            eng["nospec"]["cells"][key]["runs"] = [{"tokens_per_s": n * 3, "request_tokens_per_s": n}] * 2
        eng["specdec"]["cells"][key] = _cell(c, rep4=cr, temperature=t)
        eng["specdec-before"]["cells"][key] = _cell(b, rep4=br, temperature=t)
    return {"engines": eng}


def _serve(none: float, cand: float, before: float | None) -> dict:
    servers = {"nospec": {"bench": {"median_tpot_ms": none}}, "specdec": {"bench": {"median_tpot_ms": cand}}}
    if before is not None:
        servers["specdec-before"] = {"bench": {"median_tpot_ms": before}}
    return {"tpot-8b": {"kind": "tpot", "servers": servers}}


def before_after(doc: dict) -> dict:
    """``compare`` over a document's cells as the report draws them."""
    cells = {tp: gate_verdicts(g)["cells"] for tp, g in doc["gates"].items()}
    return compare(cells, doc.get("serve", {}))


def pairs(gate: dict) -> list[dict]:
    return cell_pairs(gate_verdicts(gate)["cells"])


def test_cell_ratio_is_candidate_over_before_each_against_nospec():
    rows = pairs(_gate({"code/b8": (100.0, 0.80, 300.0, 0.80, 250.0, 0.82)}))
    assert len(rows) == 1
    r = rows[0]
    assert r["candidate"] == pytest.approx(3.0) and r["before"] == pytest.approx(2.5)
    assert r["ratio"] == pytest.approx(1.2) and r["emit"] == pytest.approx(1.0)
    assert r["comparable"]


def test_a_sampled_cell_is_judged_on_the_requests_own_rate():
    (r,) = pairs(_gate({"code/s8": (100.0, 0.36, 120.0, 0.36, 150.0, 0.37)}))
    assert r["candidate"] == pytest.approx(1.2) and r["before"] == pytest.approx(1.5)  # not over 300 tok/s
    assert r["ratio"] == pytest.approx(0.8)


@pytest.mark.parametrize(
    ("cand", "before", "comparable"),
    [
        (0.36, 0.43, False),  # the measured case: before's samples looped more (0.43 against 0.36)
        (0.18, 0.36, False),  # the candidate's looped less
        (0.41, 0.31, True),  # both within 0.05 of 0.36
        (0.31, 0.41, True),
        (None, 0.36, True),  # unknown: not excluded
    ],
)
def test_a_cell_counts_only_where_both_engines_repeat_like_nospec(cand, before, comparable):
    assert rules.rep4_comparable(0.36, cand, before) is comparable


def test_geomean_and_the_keep_rule_over_counted_cells_only():
    g = _gate(
        {
            "chat/b8": (100.0, 0.88, 210.0, 0.88, 200.0, 0.88),  # 1.05
            "code/b8": (100.0, 0.80, 190.0, 0.80, 200.0, 0.80),  # 0.95
            "code/s8": (100.0, 0.36, 50.0, 0.18, 150.0, 0.43),  # 0.33, not counted
        }
    )
    out = before_after({"gates": {"tp1": g}})
    t = out["tps"]["tp1"]
    assert t["geomean"] == pytest.approx(math.sqrt(1.05 * 0.95))  # 0.9987: no loss, and no win
    assert t["worst"] == pytest.approx(0.95)
    assert (out["win"], out["reason"], out["verdict"]) == (False, "no win", rules.FAIL)
    g["engines"]["specdec"]["cells"]["code/b8"]["runs"][0]["tokens_per_s"] = 200.0  # now 1.05 and 1.0: 1.0247
    assert before_after({"gates": {"tp1": g}})["verdict"] == rules.PASS
    g["engines"]["specdec"]["cells"]["code/b8"]["runs"][0]["tokens_per_s"] = 178.0  # 1.05 and 0.89: a cell lost
    lost = before_after({"gates": {"tp1": g}, "serve": _serve(4.9, 4.9, 5.35)})
    assert (lost["win"], lost["reason"], lost["verdict"]) == (True, "a loss", rules.FAIL)


@pytest.mark.parametrize(
    ("geo", "worst", "verdict"),
    [(0.98, 0.8, rules.PASS), (1.05, 0.7999, rules.FAIL), (0.9799, 1.0, rules.FAIL), (None, None, rules.NONE)],
)
def test_before_after_bounds(geo, worst, verdict):
    assert rules.before_after(geo, worst) == verdict


@pytest.mark.parametrize(("worst_set", "verdict"), [(0.95, rules.PASS), (0.9499, rules.FAIL), (None, rules.PASS)])
def test_before_after_set_bound(worst_set, verdict):
    assert rules.before_after(1.0, 0.9, worst_set) == verdict


def test_one_noisy_cell_is_pooled_by_its_set_a_set_that_loses_is_not():
    # the measured noise: one cell of two engines of one policy at 0.887 (TP=2 agentic b1 of 4a14c9b, never gated)
    cells = {
        "agentic/b1": (100.0, 0.31, 177.4, 0.31, 200.0, 0.31),  # 0.887
        "agentic/b8": (100.0, 0.64, 210.0, 0.64, 200.0, 0.64),  # 1.05
        "agentic/b32": (100.0, 0.57, 206.0, 0.57, 200.0, 0.57),  # 1.03
        "agentic/b64": (100.0, 0.51, 200.0, 0.51, 200.0, 0.51),  # 1.0
        "chat/b8": (100.0, 0.88, 204.0, 0.88, 200.0, 0.88),  # 1.02
    }
    serving_win = _serve(4.9, 4.9, 5.35)  # the candidate 1.0x no speculation's TPOT, before 1.09x
    out = before_after({"gates": {"tp1": _gate(cells)}, "serve": serving_win})
    t = out["tps"]["tp1"]
    assert t["sets"]["agentic"] == pytest.approx((0.887 * 1.05 * 1.03 * 1.0) ** 0.25)  # 0.990
    assert t["sets"]["chat"] == pytest.approx(1.02)
    assert t["worst"] == pytest.approx(0.887)
    assert (out["reason"], out["verdict"]) == ("a win", rules.PASS)
    # the whole agentic set 6% down, the TP's mean held up by chat: the set says loss
    lost = {
        k: (n, r, 188.0 if k.startswith("agentic") else 240.0, r, b, rb) for k, (n, r, _, _, b, rb) in cells.items()
    }
    out = before_after({"gates": {"tp1": _gate(lost)}, "serve": serving_win})
    t = out["tps"]["tp1"]
    assert t["sets"]["agentic"] == pytest.approx(0.94) and t["geomean"] == pytest.approx((0.94**4 * 1.2) ** 0.2)
    assert t["geomean"] >= rules.KEEP_GEOMEAN_MIN and t["worst"] >= rules.KEEP_CELL_FLOOR
    assert (out["reason"], out["verdict"]) == ("a loss", rules.FAIL)


@pytest.mark.parametrize(
    ("geomeans", "serve", "win"),
    [
        ([1.02], (None, None), True),
        ([1.0, 1.019], (1.08, 1.09), True),  # serving 0.01 under before's
        ([1.0, 1.019], (1.085, 1.09), False),  # the measured strict-recovery case: 1.089 against 1.092
        ([None], (1.08, None), False),
    ],
)
def test_a_change_must_win_something(geomeans, serve, win):
    assert rules.wins(geomeans, serve) is win


def test_serve_check_keeps_within_slack_of_before():
    assert rules.before_after_serve(1.10, 1.09) == rules.PASS  # 0.01 over: inside the slack
    assert rules.before_after_serve(1.1001 + 0.01, 1.09) == rules.FAIL
    assert rules.before_after_serve(1.13, None) == rules.NONE
    g = _gate({"chat/b8": (100.0, 0.88, 210.0, 0.88, 200.0, 0.88)})
    out = before_after({"gates": {"tp1": g}, "serve": _serve(4.9, 5.53, 5.35)})  # the measured granted-alone serve
    assert out["serve"] == (pytest.approx(5.53 / 4.9), pytest.approx(5.35 / 4.9))
    assert out["verdict"] == rules.FAIL  # cells keep, serving drops


def test_no_before_engine_no_section():
    g = _gate({"chat/b8": (100.0, 0.88, 210.0, 0.88, 200.0, 0.88)})
    del g["engines"]["specdec-before"]
    out = before_after({"gates": {"tp1": g}, "serve": _serve(4.9, 5.0, None)})
    assert out == {
        "tps": {},
        "serve": (None, None),
        "serve_checks": {},
        "win": False,
        "reason": "no win",
        "verdict": rules.NONE,
        "uncompared": ["tp1"],
    }
    assert render_compare(out) == []
    assert geomean([]) is None


def test_the_report_draws_the_section_within_its_width():
    g = _gate({"agentic/b32": (100.0, 0.57, 103.0, 0.56, 102.0, 0.57), "code/s8": (100.0, 0.37, 1.0, 0.1, 2.0, 0.4)})
    text = render({"kind": "specdec-gate", "gates": {"tp1": g}, "serve": _serve(4.9, 5.2, 5.35), "sources": []})
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("== specdec / before"))
    assert lines[i + 1].split()[2:] == ["|", "ag32", "co-s8"]
    assert lines[i + 3].split() == ["tp1", "1.010", "1.01", "|", "1.01", "0.50~"]
    assert "before/after: KEEP (a win)" in text  # serving 1.061 against 1.092
    assert max(map(len, lines)) <= 120


def _work(gate: dict, key: str, method: str, *, digests: list[str], drafted: float, accepted: float) -> None:
    gate["engines"][method]["cells"][key]["digests"] = digests
    gate["engines"][method]["cells"][key]["runs"][0].update(draft_tokens=drafted, accepted_tokens=accepted)


@pytest.mark.parametrize(
    ("cand", "before", "same"),
    [
        ((["a", "b"], 1000.0, 800.0), (["a", "b"], 1000.0, 800.0), True),
        ((["a", "b"], 1029.0, 800.0), (["a", "b"], 1000.0, 800.0), True),  # 2.8% more drafted: within 3%
        ((["a", "b"], 1040.0, 800.0), (["a", "b"], 1000.0, 800.0), False),  # 3.8%: other work
        ((["a", "b"], 1000.0, 760.0), (["a", "b"], 1000.0, 800.0), False),  # 5% fewer accepted
        ((["a", "c"], 1000.0, 800.0), (["a", "b"], 1000.0, 800.0), False),  # one output differs
        (([], 1000.0, 800.0), ([], 1000.0, 800.0), False),  # no digests: unknown
    ],
)
def test_same_work_needs_identical_outputs_and_drafted_and_accepted_within_tolerance(cand, before, same):
    assert rules.SAME_WORK_TOL == 0.03
    c = dict(zip(("digests", "drafted", "accepted"), cand))
    b = dict(zip(("digests", "drafted", "accepted"), before))
    assert rules.same_work(c, b) is same


def test_the_noise_floor_is_the_same_work_cells_ratio_and_does_not_change_the_verdict():
    g = _gate(
        {
            "chat/b1": (100.0, 0.9, 600.0, 0.9, 500.0, 0.9),  # same work: 1.2
            "chat/b8": (100.0, 0.9, 200.0, 0.9, 250.0, 0.9),  # same work: 0.8
            "code/b8": (100.0, 0.8, 300.0, 0.8, 300.0, 0.8),  # other outputs: counted, not same work
            "code/s8": (100.0, 0.37, 1.0, 0.37, 1.0, 0.37),  # sampled: never same work
        }
    )
    for key in ("chat/b1", "chat/b8"):
        for m in ("specdec", "specdec-before"):
            _work(g, key, m, digests=["x", "y"], drafted=100.0, accepted=90.0)
    _work(g, "code/b8", "specdec", digests=["x"], drafted=100.0, accepted=90.0)
    _work(g, "code/b8", "specdec-before", digests=["z"], drafted=100.0, accepted=90.0)
    for m in ("specdec", "specdec-before"):
        _work(g, "code/s8", m, digests=["s"], drafted=100.0, accepted=90.0)
    out = before_after({"gates": {"tp1": g}})
    same = out["tps"]["tp1"]["same_work"]
    assert same["cells"] == 2 and same["geomean"] == pytest.approx(math.sqrt(1.2 * 0.8))
    assert (same["low"], same["high"]) == (pytest.approx(0.8), pytest.approx(1.2))
    assert out["tps"]["tp1"]["geomean"] == pytest.approx((1.2 * 0.8 * 1.0 * 1.0) ** 0.25)  # the verdict's: all four
    text = "\n".join(render_compare(out))
    assert "same work (outputs identical, drafted and accepted within 3%): 2 cells, geomean 0.980, 0.80-1.20" in text


def test_two_pairs_give_each_cell_the_geometric_mean_of_their_ratios():
    g = _gate({"chat/b8": (100.0, 0.88, 220.0, 0.88, 200.0, 0.88), "code/b8": (100.0, 0.8, 300.0, 0.8, 300.0, 0.8)})
    eng = g["engines"]
    eng["specdec.2"] = {"cells": {"chat/b8": _cell(180.0, rep4=0.88), "code/b8": _cell(330.0, rep4=0.8)}}
    eng["specdec-before.2"] = {"cells": {"chat/b8": _cell(200.0, rep4=0.88), "code/b8": _cell(300.0, rep4=0.8)}}
    rows = {r["key"]: r for r in pairs(g)}
    assert rows["chat/b8"]["pairs"] == [pytest.approx(1.1), pytest.approx(0.9)]
    assert rows["chat/b8"]["ratio"] == pytest.approx(math.sqrt(1.1 * 0.9))
    assert rows["code/b8"]["ratio"] == pytest.approx(math.sqrt(1.0 * 1.1))
    out = before_after({"gates": {"tp1": g}})
    t = out["tps"]["tp1"]
    assert t["pairs"] == [pytest.approx(math.sqrt(1.1 * 1.0)), pytest.approx(math.sqrt(0.9 * 1.1))]
    assert t["geomean"] == pytest.approx((1.1 * 0.9 * 1.0 * 1.1) ** 0.25)
    eng["specdec-before.2"]["cells"]["code/b8"]["repeat4"] = 0.9  # one engine of one pair loops: not counted
    assert not {r["key"]: r for r in pairs(g)}["code/b8"]["comparable"]
    assert "pairs (each a geomean; the cell is theirs): 1.049, 0.995" in "\n".join(render_compare(out))
