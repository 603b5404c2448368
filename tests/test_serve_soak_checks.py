"""The soak's checks by hand: faults against the plugin's counts and log, streamed gaps against the deadline, memory
growth after the cache's cap, greedy mismatches against vLLM ngram's."""

from __future__ import annotations

import pytest

from benchmarks import serve_soak_checks as sc

LOG = """INFO starting
WARNING drafter suffix failed for request(s) r1: InjectedFault('x'); those requests go on without a draft
WARNING specdec: drafting 3 request(s) took longer than draft_timeout_ms=50.0; that step goes on without drafts
INFO done"""


def test_fault_check_counts_and_log_lines() -> None:
    before = {"specdec_test_faults_raised": 2.0, "specdec_drafter_errors_total": 2.0}
    after = {"specdec_test_faults_raised": 202.0, "specdec_drafter_errors_total": 204.0,
             "specdec_test_faults_slept": 100.0, "specdec_deadline_misses_total": 100.0}  # fmt: skip
    out = sc.fault_check(["raise", "sleep"], before, after, LOG)
    assert out["raise"] == {"injected": 200.0, "handled": 202.0, "log_lines": 1, "ok": True}  # 1% of 200: 2
    assert out["sleep"]["ok"] and out["ok"]
    after["specdec_drafter_errors_total"] = 205.0  # 3 more than injected: past 1%
    assert not sc.fault_check(["raise"], before, after, LOG)["ok"]
    assert not sc.fault_check(["raise"], before, after | {"specdec_drafter_errors_total": 202.0}, LOG + "\n" + LOG)[
        "ok"
    ]  # the warning twice
    assert not sc.fault_check(["sleep"], {}, {}, LOG)["ok"]  # nothing injected proves nothing
    assert sc.fault_kinds("raise:100, sleep:50") == ["raise", "sleep"]


def _itl(counts: dict[str, float]) -> str:
    return "\n".join(f'vllm:inter_token_latency_seconds_bucket{{engine="0",le="{le}"}} {c}' for le, c in counts.items())


def _check(before: str, after: str, *, timeout_ms: float) -> dict:
    return sc.itl_verdict(sc.itl_window(before, after), timeout_ms=timeout_ms)


def test_itl_check_reads_vllms_histogram() -> None:
    before = _itl({"0.01": 10, "0.025": 10, "0.05": 10, "0.075": 10, "0.1": 10, "+Inf": 10})
    after = _itl({"0.01": 60, "0.025": 108, "0.05": 110, "0.075": 110, "0.1": 110, "+Inf": 110})
    out = _check(before, after, timeout_ms=50.0)  # 100 gaps: 50 under 10 ms, 48 under 25, 2 under 50
    assert out["gaps"] == 100 and out["p50_ms"] == pytest.approx(10.0)
    assert out["bound_ms"] == pytest.approx(70.0) and out["bound_edge_ms"] == pytest.approx(75.0)
    assert out["ok"] and out["over_bound_edge"] == 0 and out["over_deadline_edge"] == 0
    late = _itl({"0.01": 60, "0.025": 108, "0.05": 110, "0.075": 110, "0.1": 111, "+Inf": 111})
    out = _check(before, late, timeout_ms=50.0)  # one gap between 75 and 100 ms
    assert not out["ok"] and out["over_bound_edge"] == 1 and out["tail"] == {"100": 1.0}  # by its upper edge
    stall = _itl({"0.01": 60, "0.025": 108, "0.05": 110, "0.075": 110, "0.1": 111, "+Inf": 113})
    assert _check(before, stall, timeout_ms=50.0)["tail"] == {"100": 1.0, "inf": 2.0}  # two past the last
    assert not _check(before, before, timeout_ms=50.0)["ok"]  # nothing observed


def test_itl_against_a_no_speculation_baseline() -> None:
    before = _itl({"0.01": 0, "0.025": 0, "0.05": 0, "0.075": 0, "0.1": 0, "+Inf": 0})
    spec = _check(before, _itl({"0.01": 50, "0.025": 98, "0.05": 100, "0.075": 100, "0.1": 100, "+Inf": 101}),
                        timeout_ms=50.0)  # fmt: skip  # 1 of 101 gaps past the 75 ms edge
    assert not spec["ok"] and spec["bound_edge_ms"] == pytest.approx(75.0)
    # the baseline: 3 of 200 gaps past 75 ms (2 between 75 and 100, 1 past 100): vLLM's own tail is the larger
    base = _itl({"0.01": 150, "0.025": 195, "0.05": 197, "0.075": 197, "0.1": 199, "+Inf": 200})
    out = sc.with_baseline(spec, sc.itl_window(before, base))
    assert out["ok"] and not out["ok_absolute"]
    assert (out["baseline_gaps"], out["baseline_over_bound_edge"]) == (200, 3)
    # a baseline with no such gap: the plugin's one stays a failure
    clean = _itl({"0.01": 150, "0.025": 195, "0.05": 200, "0.075": 200, "0.1": 200, "+Inf": 200})
    assert not sc.with_baseline(spec, sc.itl_window(before, clean))["ok"]


def test_growth_counts_only_after_the_cap_is_reached() -> None:
    plugin = [(0.0, {sc.CACHE_REQUESTS: 10.0, sc.CACHE_MAX_REQUESTS: 100.0}),
              (2.0, {sc.CACHE_REQUESTS: 100.0, sc.CACHE_MAX_REQUESTS: 100.0})]  # fmt: skip
    assert sc.cap_reached_at(plugin) == 2.0 and sc.cap_reached_at(plugin[:1]) is None
    samples = [(0.0, 0, 500.0, 1.0), (2.0, 10, 1000.0, 1.0), (4.0, 20, 1040.0, 1.0), (6.0, 30, 1020.0, 1.0)]
    assert sc.growth_after(samples, 2, 2.0) == pytest.approx(0.04)  # 1,000 -> 1,040 MiB; the warm-up's 500 not
    assert sc.growth_after(samples, 2, float("inf")) is None


def test_greedy_mismatches_against_ngrams() -> None:
    ref = ["a", "b", "c", "d"]
    res = {
        "specdec-thread": sc.mismatches(["a", "x", "c", "d"], ref),
        "ngram": sc.mismatches(["a", "b", "y", "d"], ref),
    }
    assert res["specdec-thread"] == {"compared": 4, "differ": 1, "first": [1]}
    assert sc.compare_verdict(res) == {"ok": True, "limit": 1, "baseline": "ngram"}
    res["specdec-schedule"] = sc.mismatches(["x", "x", "c", "d"], ref)
    assert not sc.compare_verdict(res)["ok"]
